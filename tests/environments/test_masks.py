"""Every stage honours the policy mask: observation tokens are in the ids, never in the loss, KL, entropy,
advantages, corrections or statistics (hand-computed where a number is asserted)."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from rlpipe.stages.advantage import compute_advantages
from rlpipe.stages.reference_logprob import reference_metrics
from rlpipe.stages.score import score_rows
from rlpipe.training.loop import train_policy
from rlpipe.training.objective import Normalisers, micro_batch_loss
from tests.stages.test_advantage import cfg as advantage_cfg
from tests.stages.test_score import cfg as score_cfg
from tests.training.test_loop import PAD, config, make_data, tiny_model

# ---------------------------------------------------------------------------------------------
# train: the objective


def multi_turn_data(*, perturb: bool, seed: int = 4):
    """8 sequences whose completions hold an observation block; with ``perturb`` every per-token value at
    the observation tokens is replaced by an extreme one."""
    rng = np.random.default_rng(seed)
    prompts, completions, masks = [], [], []
    for _ in range(8):
        prompts.append(rng.integers(1, 24, size=rng.integers(2, 5)).tolist())
        n = int(rng.integers(6, 11))
        completions.append(rng.integers(1, 24, size=n).tolist())
        start = int(rng.integers(1, n - 2))
        masks.append(np.array([not (start <= t < start + 2) for t in range(n)]))
    adv = [np.full(len(c), rng.normal(), dtype=np.float32) for c in completions]
    ref = [rng.normal(-3, 0.5, size=len(c)).astype(np.float32) for c in completions]
    sampler = [r - rng.uniform(0, 0.8, size=len(r)).astype(np.float32) for r in ref]
    old = [r - rng.uniform(0, 0.3, size=len(r)).astype(np.float32) for r in ref]
    if perturb:
        for m, *values in zip(masks, adv, ref, sampler, old):
            for v, extreme in zip(values, (40.0, -30.0, -25.0, -35.0)):
                v[~m] = extreme
    d = make_data(prompts, completions, adv, ref, sampler=sampler)
    d.policy_mask, d.old_logprobs = masks, old
    d.sequence_advantages = np.array([a[0] for a in adv], dtype=np.float32)
    return d


def loss_and_grad(cfg, d):
    model = tiny_model(0)
    model.eval()
    tokens = sum(d.policy_tokens(i) for i in range(8))
    loss, health = micro_batch_loss(model, None, d, list(range(8)), cfg, temperature=0.7, pad_token_id=PAD,
                                    norm_for=lambda mask: Normalisers(tokens, 8, 10))
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), health


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("extras", [{}, {"tis_cap": 2.0, "off_policy_mask_delta": 0.1, "kl_importance_weighted": True},
                                    {"policy_loss": "gspo", "dual_clip_c": 3.0}])
def test_a_loss_with_observation_tokens_perturbed_is_unchanged(mode, extras):
    cfg = config(loss_aggregation=mode, kl_beta=0.1, entropy_coef=0.01, **extras)
    loss, grad, health = loss_and_grad(cfg, multi_turn_data(perturb=False))
    loss_p, grad_p, health_p = loss_and_grad(cfg, multi_turn_data(perturb=True))
    assert torch.equal(loss, loss_p) and torch.equal(grad, grad_p)
    assert {k: float(v) for k, v in health.items()} == {k: float(v) for k, v in health_p.items()}
    assert float(health["num_valid_tokens"]) == sum(int(m.sum()) for m in multi_turn_data(perturb=False).policy_mask)
    # the perturbation is big enough to matter where it is not masked:
    unmasked = multi_turn_data(perturb=True)
    unmasked.policy_mask = None
    assert not torch.equal(loss_and_grad(cfg, unmasked)[0], loss)


def test_token_mean_divides_by_the_policy_tokens_of_the_step():
    """First step, ratio 1 (pi_old recomputed by the trainer), no KL or entropy: loss = -sum_policy(A) / N_policy.

    Row 0: A = 1.0 on 4 policy tokens (2 observation tokens); row 1: A = -0.5 on 3 policy tokens (1 observation):
    -(4 * 1.0 + 3 * (-0.5)) / 7 = -2.5 / 7 = -0.357142...
    """
    d = make_data([[3, 4], [5, 6, 7]], [[8, 9, 10, 11, 12, 13], [14, 15, 16, 17]],
                  [np.full(6, 1.0, dtype=np.float32), np.full(4, -0.5, dtype=np.float32)],
                  [np.zeros(6, dtype=np.float32), np.zeros(4, dtype=np.float32)])
    d.policy_mask = [np.array([1, 1, 0, 0, 1, 1], dtype=bool), np.array([1, 0, 1, 1], dtype=bool)]
    assert [d.policy_tokens(0), d.policy_tokens(1)] == [4, 3]
    cfg = config(loss_aggregation="token-mean", kl_beta=0.0, entropy_coef=0.0, lr=0.0, minibatch_size=2,
                 micro_batch_size=1)
    result = train_policy(tiny_model(0), d, cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0, max_length=6)
    (step,) = result.steps
    assert step["tokens"] == 7 and step["loss"] == pytest.approx(-2.5 / 7, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# advantage


def turn_rows(**columns) -> pl.DataFrame:
    n = len(columns["reward"])
    base = {"prompt_id": [0] * n, "sample_idx": pl.Series(range(n), dtype=pl.Int32), "truncated": [False] * n,
            "finish_reason": ["done"] * n}
    frame = pl.DataFrame({**base, **columns})
    return frame.with_columns(pl.col("policy_mask").list.len().cast(pl.Int32).alias("completion_length"))


def test_a_sequence_advantage_reaches_only_policy_tokens():
    rows = turn_rows(reward=[1.0, 0.0], policy_mask=[[True, False, False, True], [True, True, False]])
    frame, _, _ = compute_advantages(rows, advantage_cfg())
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # group (1, 0): mean 0.5, sample std sqrt(0.5)
    assert frame["token_advantages"][0].to_list() == pytest.approx([a, 0.0, 0.0, a], abs=1e-6)
    assert frame["token_advantages"][1].to_list() == pytest.approx([-a, -a, 0.0], abs=1e-6)


def test_gae_steps_over_observation_tokens():
    """gamma = lam = 1, no KL: tokens (p, p, o, o, p), score 1 on the last policy token, V = (0.1, 0.2, 9, 9, 0.3).

    A_4 = 1 - 0.3 = 0.7; A_1 = 0 + V_4 - V_1 + A_4 = 0.1 + 0.7 = 0.8; A_0 = V_1 - V_0 + A_1 = 0.9; the values
    of the observation tokens (9) never enter. Returns A + V = 1.0 at each policy token.
    """
    rows = turn_rows(reward=[1.0], policy_mask=[[True, True, False, False, True]],
                     sampler_logprobs=[[-1.0, -1.0, 0.0, 0.0, -1.0]], ref_logprobs=[[-1.0, -1.0, -7.0, -7.0, -1.0]],
                     values=[[0.1, 0.2, 9.0, 9.0, 0.3]])
    frame, _, _ = compute_advantages(rows, advantage_cfg(estimator="gae", kl={"beta": 0.0}))
    assert frame["token_advantages"][0].to_list() == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.7], abs=1e-6)
    assert frame["returns"][0].to_list() == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0], abs=1e-6)
    # with the KL in the reward, an observation token's (large) ref log-ratio costs nothing
    with_kl, m, _ = compute_advantages(rows, advantage_cfg(estimator="gae", kl={"beta": 0.5}))
    assert with_kl["token_advantages"][0].to_list() == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.7], abs=1e-6)
    assert m["kl_reward_observed"] == 0.0


def test_an_infra_error_row_is_left_out_of_its_group_and_of_the_loss():
    rows = turn_rows(reward=[1.0, 0.0, 0.0], policy_mask=[[True], [True, False], [True]])
    rows = rows.with_columns(finish_reason=pl.Series(["done", "infra_error", "done"]))
    frame, metrics, _ = compute_advantages(rows, advantage_cfg())
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # the group is (1.0, 0.0): the infra row's fallback 0.0 is not in it
    assert frame["advantage"].to_list() == pytest.approx([a, 0.0, -a], abs=1e-6)
    assert frame["filtered_reason"].to_list() == [None, "infra_error", None]
    assert frame["group_size"].to_list() == [2, 2, 2] and frame["token_advantages"][1].to_list() == [0.0, 0.0]
    assert metrics["filtered"]["infra_error"] == 1 and metrics["num_samples"] == 3


def test_dapo_overlong_filter_reads_the_rollouts_total_length():
    rows = turn_rows(reward=[1.0, 0.0], policy_mask=[[True, False, True], [True]])
    rows = rows.with_columns(finish_reason=pl.Series(["max_tokens", "done"]), truncated=pl.Series([True, False]))
    frame, _, _ = compute_advantages(rows, advantage_cfg(drop_truncated=True))
    assert frame["filtered_reason"].to_list() == ["truncated", None]


# ---------------------------------------------------------------------------------------------
# score and reference_logprob


def test_score_judges_the_final_turn_and_never_rewards_an_infra_error():
    frame, metrics = score_rows(pl.DataFrame({
        "prompt_id": [0, 1, 2], "sample_idx": pl.Series([0, 0, 0], dtype=pl.Int32), "prompt": ["1+2="] * 3,
        "completion_text": ["add(1,2)33", "add(1,2)add(1,2)", "3"], "answer": ["3"] * 3, "metadata": ["{}"] * 3,
        "completion_length": pl.Series([12, 16, 2], dtype=pl.Int32), "truncated": [False] * 3,
        "turn_texts": [["add(1,2)", "3"], ["add(1,2)", "add(1,2)"], None],
        "finish_reason": ["done", "max_turns", "infra_error"],
        "environment_error": [None, None, "InfrastructureError: sandbox down"],
    }), score_cfg(max_error_fraction=0.5))
    # row 1's transcript ends in "...2)" but its final turn is a call, not an answer: last number 2, wrong
    assert frame["correct"].to_list() == [True, False, None]
    assert frame["reward"].to_list() == [1.5, 0.5 * 0.0, -1.0]  # row 2: the fallback, and an error, not a score
    assert frame["score_error"][2] == ("InfrastructureError: the environment failed, not the model: "
                                       "InfrastructureError: sandbox down")
    assert metrics["errors_by_kind"] == {"InfrastructureError": 1}


def test_reference_statistics_are_over_policy_tokens():
    rollouts = pl.DataFrame({"sampler_logprobs": [[-1.0, 0.0, -2.0], [-0.5]],
                             "policy_mask": [[True, False, True], [True]]})
    ref = pl.DataFrame({"ref_logprobs": [[-1.5, -9.0, -2.0], [-1.5]]})
    m = reference_metrics(ref, rollouts)
    # policy tokens: (-1.0 vs -1.5), (-2.0 vs -2.0), (-0.5 vs -1.5): ref mean -5/3, k1 mean (0.5 + 0 + 1) / 3 = 0.5
    assert m["tokens"] == 4 and m["policy_tokens"] == 3
    assert m["ref_logprob_mean"] == pytest.approx(-5 / 3) and m["kl_sampler_ref_k1"] == pytest.approx(0.5)
