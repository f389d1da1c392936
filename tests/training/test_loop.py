"""The optimisation loop: split invariance, on-policy first step, filters, determinism, non-finite losses."""
import copy
import dataclasses

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.config import CriticTrainConfig, LoraConfig, TrainConfig
from rlpipe.errors import TrainingError
from rlpipe.training.loop import train_policy
from rlpipe.training.objective import Normalisers, TrainingData, micro_batch_loss

PAD = 0
NO_LORA = LoraConfig(rank=None, alpha=32.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                     train_embeddings=False)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).float()


def config(**over):
    base = dict(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.2, dual_clip_c=None, kl_beta=0.05, kl_estimator="k3",
                loss_aggregation="seq-mean-token-mean", epochs=1, minibatch_size=8, micro_batch_size=8,
                max_tokens_per_micro_batch=0, lr=1e-2,
                weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1e9, entropy_coef=0.01,
                device="cpu", dtype="float32", chunk_size=3, max_skipped_steps=0,
                checkpoint_every_steps=0, checkpoint_every_s=0.0, checkpoint_fsync=False, save_dtype="auto",
                master_weights="auto", gspo_form="sequence", kl_importance_weighted=False,
                kl_log_ratio_clamp=20.0, kl_value_clamp=10.0, kl_clamp_scope="every_estimator",
                token_mean_scope="minibatch", off_policy_mask_scope="whole_loss", sequence_count="nonempty",
                gmpo_clip_sign="sequence", entropy_mask_form="policy_term", ratio_cap=None, sapo_tau_pos=1.0,
                sapo_tau_neg=1.05, policy_log_ratio_clamp=20.0, gspo_log_ratio_clamp=20.0, top_entropy_quantile=1.0, keep_sampling_mask=True,
                off_policy_mask_delta=None, tis_cap=None, target_kl=None, gradient_checkpointing=False,
                compile_layers=False, max_sampler_mismatch=None, lora=NO_LORA,
                critic=CriticTrainConfig(lr=1e-2, value_coef=0.5, value_clip_eps=0.2, max_grad_norm=1e9))
    return TrainConfig(**{**base, **over})


def data(n=8, seed=1):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 24, size=rng.integers(2, 6)).tolist() for _ in range(n)]
    completions = [rng.integers(1, 24, size=rng.integers(1, 7)).tolist() for _ in range(n)]
    adv = [np.full(len(c), rng.normal(), dtype=np.float32) for c in completions]
    ref = [rng.normal(-3, 0.5, size=len(c)).astype(np.float32) for c in completions]
    return make_data(prompts, completions, adv, ref)


def make_data(prompts, completions, adv, ref, sampler=None):
    sampler = sampler if sampler is not None else [r.copy() for r in ref]
    return TrainingData(prompts, completions, adv, ref, sampler_logprobs=sampler,
                        sequence_advantages=np.array([a[0] if len(a) else 0.0 for a in adv], dtype=np.float32),
                        trainable=np.ones(len(prompts), dtype=bool))


def trained(cfg, d, seed=0):
    model = tiny_model(seed)
    result = train_policy(model, d, cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0, max_length=6)
    return model, result


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def accumulated_grad(cfg, d, micro: int):
    """The gradient of one optimizer step over all of ``d``, accumulated over micro-batches of ``micro``."""
    model = tiny_model(0)
    model.eval()
    d.old_logprobs = [lp - 0.1 * (i % 3) for i, lp in enumerate(d.ref_logprobs)]  # some ratios clip
    lengths = [len(c) for c in d.completion_token_ids]
    for start in range(0, len(lengths), micro):
        idx = list(range(start, min(start + micro, len(lengths))))
        norm = Normalisers(sum(lengths), len(lengths), 6)
        loss, _ = micro_batch_loss(model, None, d, idx, cfg, temperature=0.7, pad_token_id=PAD,
                                   norm_for=lambda mask, norm=norm: norm)
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_micro_batch_split_does_not_change_the_gradient(mode):
    cfg = config(loss_aggregation=mode)
    whole = accumulated_grad(cfg, data(), micro=8)
    split = accumulated_grad(cfg, data(), micro=2)
    assert whole.abs().max() > 1e-3
    assert torch.allclose(whole, split, rtol=1e-5, atol=1e-7)


def test_micro_batch_split_gives_the_same_trained_model_step():
    """Through the whole loop (AdamW), one step with 1 or 4 micro-batches: same grad norm, same weights."""
    whole, r1 = trained(config(), data())
    split, r2 = trained(config(micro_batch_size=2), data())
    assert r1.steps[0]["grad_norm"] == pytest.approx(r2.steps[0]["grad_norm"], rel=1e-5)
    # Adam's first step is ~lr * sign(g): components whose gradient is ~0 may flip on float noise,
    # so compare where the gradient is not negligible (the gradient itself is checked above).
    moved = (flat(whole) - flat(tiny_model(0))).abs()
    assert (flat(whole) - flat(split)).abs()[moved > 1e-3].max() < 1e-5


def test_first_step_is_on_policy_and_weights_move():
    _, result = trained(config(epochs=2, minibatch_size=4, micro_batch_size=2), data())
    assert len(result.steps) == 2 * 2
    assert result.steps[0]["ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert result.steps[0]["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert result.steps[0]["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert result.steps[-1]["approx_kl"] > 0
    assert result.metrics["logprob_change_mean"] != 0
    assert [len(x) for x in result.old_logprobs] == [len(c) for c in data().completion_token_ids]


def test_filtered_rows_are_not_trained_on():
    d = data()
    d.trainable[3] = False
    d.token_advantages[3][:] = 1e6  # would dominate the update if it leaked in
    kept = np.flatnonzero(d.trainable)
    only_kept = make_data([d.prompt_token_ids[i] for i in kept], [d.completion_token_ids[i] for i in kept],
                          [d.token_advantages[i] for i in kept], [d.ref_logprobs[i] for i in kept])
    cfg = config(minibatch_size=16, micro_batch_size=16)
    a, _ = trained(cfg, d)
    b, _ = trained(cfg, only_kept)
    assert torch.allclose(flat(a), flat(b), atol=1e-6)


def test_training_is_deterministic():
    a, ra = trained(config(epochs=2, minibatch_size=4), data())
    b, rb = trained(config(epochs=2, minibatch_size=4), data())
    assert torch.equal(flat(a), flat(b))
    assert ra.steps == rb.steps


def test_non_finite_advantage_stops_training():
    d = data()
    d.token_advantages[0][0] = np.nan
    with pytest.raises(TrainingError, match="non-finite loss"):
        trained(config(), d)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        config().lr = 1.0


def poisoned(d: TrainingData, rows) -> TrainingData:
    for i in rows:
        d.token_advantages[i][:] = np.nan
    return d


def test_a_poisoned_minibatch_is_skipped_and_counted():
    """Row 0 carries NaN advantages: the one minibatch holding it per epoch is skipped (weights untouched there)."""
    cfg = config(epochs=2, minibatch_size=2, micro_batch_size=1, max_skipped_steps=2)
    model, result = trained(cfg, poisoned(data(), [0]))
    assert result.metrics["skipped_steps"] == 2
    assert result.metrics["optimizer_steps"] == 2 * 4 - 2
    assert [s["epoch"] for s in result.steps] == [0, 0, 0, 1, 1, 1]  # one of the 4 minibatches of each epoch
    assert all(np.isfinite(s["loss"]) and np.isfinite(s["grad_norm"]) for s in result.steps)
    assert torch.isfinite(flat(model)).all()
    assert not torch.equal(flat(model), flat(tiny_model(0)))


def test_a_skipped_step_leaves_no_gradient_behind():
    """Micro-batch 1 is fine and 2 is NaN: the skipped step must not leak micro-batch 1's gradient into the next."""
    d = poisoned(data(), [1])
    d.trainable[:] = False
    d.trainable[[0, 1]] = True
    model, result = trained(config(minibatch_size=2, micro_batch_size=1, max_skipped_steps=1), d)
    assert result.metrics["skipped_steps"] == 1 and result.steps == []
    assert torch.equal(flat(model), flat(tiny_model(0)))
    assert all(p.grad is None for p in model.parameters())


def test_more_skipped_steps_than_allowed_fail_the_stage():
    with pytest.raises(TrainingError, match=r"3 optimizer steps had a non-finite .* train.max_skipped_steps=2"):
        trained(config(epochs=3, minibatch_size=8, max_skipped_steps=2), poisoned(data(), range(8)))


def test_a_non_finite_gradient_is_skipped(monkeypatch):
    calls = []

    def clip(params, max_norm):
        calls.append(1)
        return torch.tensor(float("inf")) if len(calls) == 1 else torch.tensor(0.5)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    _, result = trained(config(epochs=2, minibatch_size=8, max_skipped_steps=1), data())
    assert result.metrics["skipped_steps"] == 1
    assert [s["step"] for s in result.steps] == [1]


def test_resuming_from_a_saved_state_ends_with_the_same_weights_and_steps():
    cfg = config(epochs=3, minibatch_size=3, micro_batch_size=2, checkpoint_every_steps=4)
    states = []
    full, full_result = trained(cfg, data())
    model = tiny_model(0)
    train_policy(model, data(), cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0, max_length=6,
                 save_state=lambda st: states.append(copy.deepcopy(st)))
    assert [s["step"] for s in states] == [4, 8]
    for state in states:
        resumed = tiny_model(0)
        result = train_policy(resumed, data(), cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0,
                              max_length=6, resume=state)
        assert torch.equal(flat(resumed), flat(full))
        assert result.steps == full_result.steps and result.metrics == full_result.metrics


def test_sampler_mismatch_by_hand():
    import polars as pl

    from rlpipe.training.report import sampler_mismatch

    frame = pl.DataFrame({"sampler_logprobs": [[-1.0, -2.0], [-0.5]], "policy_mask": [[True, True], [True]]})
    old = [np.array([-1.1, -2.0]), np.array([-0.2])]
    # |diffs| = 0.1, 0.0, 0.3 -> mean 0.1333, max 0.3
    assert sampler_mismatch(frame, old) == pytest.approx({"sampler_mismatch_mean_abs": 0.4 / 3,
                                                          "sampler_mismatch_max_abs": 0.3})
    # multi-turn: the observation token (sampler 0.0, trainer -5.0) is not the policy's and does not count
    turns = pl.DataFrame({"sampler_logprobs": [[-1.0, 0.0, -2.0]], "policy_mask": [[True, False, True]]})
    # |diffs| over policy tokens = 0.1, 0.0 -> mean 0.05, max 0.1
    assert sampler_mismatch(turns, [np.array([-1.1, -5.0, -2.0])]) == pytest.approx(
        {"sampler_mismatch_mean_abs": 0.05, "sampler_mismatch_max_abs": 0.1})


def test_micro_batches_are_cut_by_count_and_token_cap():
    from rlpipe.training.loop import cut_micro_batches

    d = data()
    sizes = [len(p) + len(c) for p, c in zip(d.prompt_token_ids, d.completion_token_ids)]
    order = [3, 0, 7, 1, 5, 2, 6, 4]
    assert cut_micro_batches(order, d, config(micro_batch_size=3)) == [[3, 0, 7], [1, 5, 2], [6, 4]]
    cap = sizes[3] + sizes[0]  # the first two fit exactly; the third opens a new micro-batch
    cut = cut_micro_batches(order, d, config(micro_batch_size=8, max_tokens_per_micro_batch=cap))
    assert cut[0] == [3, 0]
    assert [i for m in cut for i in m] == order  # order kept, nothing lost
    assert all(sum(sizes[i] for i in m) <= cap or len(m) == 1 for m in cut)
    # a cap below one sequence's length gives it a micro-batch of its own
    assert cut_micro_batches(order, d, config(micro_batch_size=8, max_tokens_per_micro_batch=1)) == [[i] for i in order]


def test_a_token_cap_does_not_change_the_trained_step():
    """Token-capped micro-batches give the step of one big micro-batch (the normalisers are the step's)."""
    whole, r1 = trained(config(), data())
    capped, r2 = trained(config(max_tokens_per_micro_batch=12), data())
    assert r1.steps[0]["grad_norm"] == pytest.approx(r2.steps[0]["grad_norm"], rel=1e-5)
    moved = (flat(whole) - flat(tiny_model(0))).abs()
    assert (flat(whole) - flat(capped)).abs()[moved > 1e-3].max() < 1e-5
