"""DeepSeek-V3.2's keep sampling mask: kept sets, truncated log-probs and their gradient, and the
sampler-vs-trainer mismatch with top-p 0.9 back to float noise (HF engine, tiny Llama, CPU)."""
import math

import numpy as np
import pytest
import torch

from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
from rlpipe.engines.hf import HFEngine
from rlpipe.engines.logprobs import batched_completion_logprobs, make_packed_batch
from rlpipe.engines.truncation import (batched_kept_sets, batched_truncated_logprobs, completion_logprobs_truncated,
                                       kept_sets, truncated_target_logprobs)

VOCAB, EOS_ID, PAD_ID = 32, 2, 0  # the tiny Llama of conftest.py
TOP_P = SamplingParams(temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=12)


def test_kept_sets_by_hand_and_the_target_is_always_kept():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    # mass before each sorted token [0, 0.5, 0.8, 0.95]: top-p 0.9 drops only the last
    sets = kept_sets(logits, torch.tensor([1, 3]), temperature=1.0, top_k=0, top_p=0.9)
    assert [s.tolist() for s in sets] == [[0, 1, 2], [0, 1, 2, 3]]  # row 1: its target joins the set
    assert kept_sets(logits, torch.tensor([0, 0]), temperature=1.0, top_k=2, top_p=1.0)[0].tolist() == [0, 1]


def test_truncated_logprob_and_its_gradient_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).requires_grad_(True)
    value = truncated_target_logprobs(logits, torch.tensor([1]), [np.array([0, 1, 2])], temperature=1.0)
    # renormalised over {0, 1, 2}: 0.3 / 0.95
    assert value.item() == pytest.approx(math.log(0.3 / 0.95), rel=1e-6)
    (grad,) = torch.autograd.grad(value.sum(), logits)
    # onehot(1) - p^S with p^S = [0.5, 0.3, 0.15, 0] / 0.95
    expected = torch.tensor([[-0.5 / 0.95, 1 - 0.3 / 0.95, -0.15 / 0.95, 0.0]])
    torch.testing.assert_close(grad, expected)


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, device="cpu", dtype="float32", batch_size=64, eos_token_ids=[EOS_ID],
                      pad_token_id=PAD_ID)
    gen = torch.Generator().manual_seed(3)
    requests = [PromptRequest(prompt_token_ids=tuple(torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()),
                              seed=derive_seed(7, i), n=4)
                for i, n in enumerate(torch.randint(2, 9, (8,), generator=gen))]
    out = engine.generate(requests, TOP_P)
    prompts = [list(r.prompt_token_ids) for r, group in zip(requests, out) for _ in group]
    completions = [c for group in out for c in group]
    return engine.model, prompts, [c.token_ids for c in completions], [np.array(c.sampler_logprobs) for c in completions]


def test_top_p_sampler_vs_trainer_mismatch_is_float_noise(sampled):
    model, prompts, completions, sampler = sampled
    full, _ = batched_completion_logprobs(model, prompts, completions, pad_token_id=PAD_ID, temperature=0.8,
                                          max_tokens_per_batch=256, chunk_size=16, with_entropy=False)
    truncated, kept, full_again, entropy = batched_kept_sets(model, prompts, completions, temperature=0.8, top_k=0,
                                                             top_p=0.9, max_tokens_per_batch=256, chunk_size=16)
    flat = lambda rows: np.concatenate(rows)  # noqa: E731
    before = np.abs(flat(full) - flat(sampler))
    after = np.abs(flat(truncated) - flat(sampler))
    # the full softmax puts the dropped tail's mass back: a bias of -log(kept mass) on every truncated token
    assert before.mean() > 1e-2
    assert after.max() < 1e-5  # float noise between the cached decode and the packed forward
    assert all(len(s) < VOCAB for row in kept for s in row)
    np.testing.assert_allclose(flat(full_again), flat(full), atol=1e-6)  # the same pass gives the full ones
    assert all(len(e) == len(c) for e, c in zip(entropy, completions))
    # pi_old on its own kept sets gives the same numbers through the training path
    again = batched_truncated_logprobs(model, prompts, completions, kept, temperature=0.8, max_tokens_per_batch=256,
                                       chunk_size=16)
    np.testing.assert_allclose(flat(again), flat(truncated), atol=1e-6)


def test_truncated_logprobs_gradient_matches_autograd_of_the_logits(sampled):
    model, prompts, completions, _ = sampled
    _, kept, _, _ = batched_kept_sets(model, prompts[:3], completions[:3], temperature=0.8, top_k=0, top_p=0.9,
                                      max_tokens_per_batch=256, chunk_size=16)
    batch = make_packed_batch(prompts[:3], completions[:3])
    weights = torch.randn(3, max(len(c) for c in completions[:3]), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    full, _, truncated = completion_logprobs_truncated(model, batch, kept, temperature=0.8, chunk_size=5,
                                                       with_entropy=False)
    (truncated * weights).sum().backward()
    got = model.lm_head.weight.grad.clone()
    model.zero_grad()
    # reference: each sequence's own full forward, logits masked to its kept sets
    total = 0.0
    for b in range(3):
        ids = torch.tensor([prompts[b] + completions[b]])
        logits = model(input_ids=ids).logits[0, len(prompts[b]) - 1:-1].float() / 0.8
        for t, target in enumerate(completions[b]):
            mask = torch.full((VOCAB,), float("-inf"))
            mask[torch.from_numpy(kept[b][t].astype(np.int64))] = 0.0
            z = logits[t] + mask
            total = total + weights[b, t] * (z[target] - torch.logsumexp(z, -1))
    total.backward()
    torch.testing.assert_close(got, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    assert torch.all(truncated >= full - 1e-6)  # renormalising over a subset never lowers a log-prob
    model.zero_grad()


def test_train_loop_keeps_the_sampling_mask(sampled):
    from rlpipe.training.loop import train_policy
    from tests.training.test_loop import config, make_data

    model, prompts, completions, sampler = sampled
    adv = [np.full(len(c), (-1.0) ** i, dtype=np.float32) for i, c in enumerate(completions)]
    ref = [s.astype(np.float32) for s in sampler]
    cfg = config(kl_beta=0.0, entropy_coef=0.0, minibatch_size=32, micro_batch_size=8, epochs=1)
    with torch.no_grad():
        start = [p.clone() for p in model.parameters()]
    try:
        d = make_data(prompts, completions, adv, ref, sampler=[s.astype(np.float32) for s in sampler])
        result = train_policy(model, d, cfg, temperature=0.8, pad_token_id=PAD_ID, seed=1, iteration=0, max_length=12,
                              truncation=(0, 0.9))
        mismatch = np.abs(np.concatenate(result.old_logprobs) - np.concatenate(sampler))
        assert mismatch.max() < 1e-5 and result.metrics["keep_sampling_mask"] is True
        assert 0.9 <= result.metrics["sampling_kept_mass_mean"] < 1.0
        # the first step is on-policy on the truncated distributions: every ratio is 1
        assert result.steps[0]["ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert result.steps[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)


def test_kept_sets_survive_a_resume_state():
    from rlpipe.training.loop_state import kept_from_state, kept_to_state

    kept = [[np.array([0, 3], np.int32), np.array([5], np.int32)], []]
    back = kept_from_state(kept_to_state(kept))
    assert [[s.tolist() for s in row] for row in back] == [[[0, 3], [5]], []]
    assert all(isinstance(t, torch.Tensor) for pair in kept_to_state(kept) for t in pair)  # weights_only loads


def test_resume_with_the_keep_sampling_mask_ends_where_the_uninterrupted_run_ends(sampled, tmp_path):
    import copy

    from rlpipe.training.loop import train_policy
    from rlpipe.training.resume import load_state, save_state
    from tests.training.test_loop import config, flat, make_data

    model, prompts, completions, sampler = sampled
    start = copy.deepcopy(model.state_dict())
    adv = [np.full(len(c), (-1.0) ** i, dtype=np.float32) for i, c in enumerate(completions)]

    def data():
        return make_data(prompts, completions, adv, [s.astype(np.float32) for s in sampler],
                         sampler=[s.astype(np.float32) for s in sampler])

    cfg = config(kl_beta=0.05, epochs=2, minibatch_size=16, micro_batch_size=8, checkpoint_every_steps=2)
    run = dict(temperature=0.8, pad_token_id=PAD_ID, seed=1, iteration=0, max_length=12, truncation=(0, 0.9))
    try:
        states = []
        model.load_state_dict(start)
        full = train_policy(model, data(), cfg, **run, save_state=lambda st: states.append(copy.deepcopy(st)))
        full_weights = flat(model).clone()
        save_state(tmp_path, states[0], fsync=False)  # through the file: weights_only must load the kept sets
        model.load_state_dict(start)
        resumed = train_policy(model, data(), cfg, **run, resume=load_state(tmp_path))
        assert torch.equal(flat(model), full_weights)
        assert resumed.steps == full.steps and resumed.metrics == full.metrics
    finally:
        model.load_state_dict(start)


def test_kl_in_reward_at_top_p_0_9_counts_the_reference_mass_outside_the_kept_set(sampled):
    """Issue 33, item 4 (docs/ppo.md, "The KL in the reward under top-p or top-k").

    The advantage stage's d_t = log pi_sampler(o_t) - log pi_ref(o_t) takes the sampler's log-prob truncated to
    S_t and the reference's full softmax. With pi_ref = pi_old (same weights), the truth is KL 0, but
    d_t = log pi^S(o_t) - log pi(o_t) = -log pi_ref(S_t) in [0, -log 0.9] at top-p 0.9: every token is
    penalised. Both log-probs on the same S_t (the reference truncated to the sampler's kept sets) give 0.
    """
    from rlpipe.algorithms.ragged import token_kl

    model, prompts, completions, sampler = sampled  # the reference is the sampling model itself
    ref_full, _ = batched_completion_logprobs(model, prompts, completions, pad_token_id=PAD_ID, temperature=0.8,
                                              max_tokens_per_batch=256, chunk_size=16, with_entropy=False)
    _, kept, _, _ = batched_kept_sets(model, prompts, completions, temperature=0.8, top_k=0, top_p=0.9,
                                      max_tokens_per_batch=256, chunk_size=16)
    ref_same_support = batched_truncated_logprobs(model, prompts, completions, kept, temperature=0.8,
                                                  max_tokens_per_batch=256, chunk_size=16)
    flat = lambda rows: np.concatenate(rows).astype(np.float64)  # noqa: E731
    mask = np.ones(len(flat(sampler)), dtype=bool)
    stage = token_kl(flat(sampler), flat(ref_full), mask, estimator="k1")  # what the advantage stage uses now
    same = token_kl(flat(sampler), flat(ref_same_support), mask, estimator="k1")
    # -log pi_ref(S_t) from the kept sets directly: the reference's mass on S_t is exp(log pi(o) - log pi^S(o))
    outside = flat(ref_same_support) - flat(ref_full)
    np.testing.assert_allclose(stage, outside, atol=1e-5)
    assert stage.min() > -1e-5 and stage.max() < -math.log(0.9) + 1e-5
    assert stage.mean() > 0.01 and (stage > 1e-3).mean() > 0.5  # a systematic penalty on most tokens
    assert np.abs(same).max() < 1e-5  # the same distribution on both sides: KL 0, as it should be
