"""The advantage stage's table: group statistics, broadcast token advantages, DAPO filters (hand-computed)."""
import math

import numpy as np
import polars as pl
import pytest

from rlpipe.config import AdvantageConfig, KLInRewardConfig
from rlpipe.data.io import validate_frame
from rlpipe.data.schema import ADVANTAGES
from rlpipe.errors import ArtifactError
from rlpipe.stages.advantage import check_finite_rewards, compute_advantages


def cfg(**over):
    kl = KLInRewardConfig(**{"beta": 0.5, "estimator": "k1", "adaptive": False, "target": 1.0, "horizon": 8.0,
                             **over.pop("kl", {})})
    base = dict(estimator="grpo", std_mode="sample", eps=1e-6, std_scope="group", nan_rewards="error",
                singleton_groups="zero", whiten_form="std", whiten_eps=1e-6, gamma=1.0, lam=1.0, whiten=False,
                kl_in_reward=kl, drop_zero_variance_groups=False, drop_truncated=False)
    return AdvantageConfig(**{**base, **over})


def rows():
    # group 7: rewards [1.0, 0.8, 0.4, 0.2] (ALGORITHMS.md worked example); group 9: all equal; group 11: singleton
    return pl.DataFrame({
        "prompt_id": [7, 7, 7, 7, 9, 9, 11],
        "sample_idx": pl.Series([0, 1, 2, 3, 0, 1, 0], dtype=pl.Int32),
        "reward": [1.0, 0.8, 0.4, 0.2, 0.5, 0.5, 1.0],
        "completion_length": pl.Series([2, 3, 1, 2, 1, 1, 2], dtype=pl.Int32),
        "truncated": [False, True, False, False, False, False, False],
    })


def test_grpo_sample_std_table():
    frame, metrics, _ = compute_advantages(rows(), cfg())
    validate_frame(frame.cast(dict(ADVANTAGES.polars_schema())), ADVANTAGES)
    # mean 0.6; sample std = sqrt((0.16+0.04+0.04+0.16)/3) = sqrt(0.13333) = 0.36515
    std = math.sqrt(0.4 / 3)
    expected = [(r - 0.6) / (std + 1e-6) for r in (1.0, 0.8, 0.4, 0.2)]
    adv = frame["advantage"].to_list()
    assert adv[:4] == pytest.approx(expected, abs=1e-6)
    assert adv[:4] == pytest.approx([1.0954, 0.5477, -0.5477, -1.0954], abs=1e-4)
    assert adv[4:] == [0.0, 0.0, 0.0]  # zero-variance group and singleton: no signal, no invented baseline
    assert frame["token_advantages"][1].to_list() == pytest.approx([expected[1]] * 3, abs=1e-6)
    assert frame["group_size"].to_list() == [4, 4, 4, 4, 2, 2, 1]
    assert frame["group_reward_mean"][0] == pytest.approx(0.6)
    assert frame["group_reward_std"][0] == pytest.approx(std)
    assert frame["group_reward_std"][6] == 0.0
    assert frame["filtered_reason"].null_count() == 7
    assert metrics["zero_variance_groups"] == 1 and metrics["singleton_groups"] == 1
    assert metrics["num_trained"] == 7


def test_population_std_convention():
    frame, _, _ = compute_advantages(rows(), cfg(std_mode="population"))
    # population std = sqrt(0.4 / 4) = 0.31623 -> [+1.26, +0.63, -0.63, -1.26]
    assert frame["advantage"].to_list()[:4] == pytest.approx([1.2649, 0.6325, -0.6325, -1.2649], abs=1e-4)
    assert frame["group_reward_std"][0] == pytest.approx(math.sqrt(0.1))


def test_dapo_filters_mark_rows_instead_of_dropping_them():
    frame, metrics, _ = compute_advantages(rows(), cfg(drop_zero_variance_groups=True, drop_truncated=True))
    assert frame["filtered_reason"].to_list() == [None, "truncated", None, None, "zero_variance_group",
                                                  "zero_variance_group", "zero_variance_group"]
    assert metrics["num_trained"] == 3
    assert metrics["filtered"] == {"zero_variance_group": 3, "truncated": 1, "infra_error": 0}


def test_dr_grpo_and_rloo_by_name():
    dr, _, _ = compute_advantages(rows(), cfg(estimator="dr_grpo"))
    assert dr["advantage"].to_list()[:4] == pytest.approx([0.4, 0.2, -0.2, -0.4])
    rloo, _, _ = compute_advantages(rows(), cfg(estimator="rloo"))
    # A_0 = 1.0 - (0.8 + 0.4 + 0.2) / 3 = 0.5333
    assert rloo["advantage"][0] == pytest.approx(1.0 - 1.4 / 3)
    assert np.isfinite(rloo["advantage"].to_numpy()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_non_finite_rewards_are_refused_naming_the_rows(bad):
    frame = rows().with_columns(pl.Series("reward", [1.0, bad, 0.4, 0.2, 0.5, 0.5, 1.0], dtype=pl.Float64))
    with pytest.raises(ArtifactError, match=r"scores.parquet: column 'reward' has 1 non-finite value\(s\) .*"
                                            r"\(prompt_id=7, sample_idx=1, reward="):
        check_finite_rewards(frame, "scores.parquet")
    check_finite_rewards(rows(), "scores.parquet")  # finite rewards pass


def token_rows():
    # two samples of one prompt; sampler and reference log-probs differ by d = old - ref per token
    return pl.DataFrame({
        "prompt_id": [3, 3],
        "sample_idx": pl.Series([0, 1], dtype=pl.Int32),
        "reward": [1.0, 0.0],
        "completion_length": pl.Series([2, 1], dtype=pl.Int32),
        "truncated": [False, False],
        "sampler_logprobs": [[-1.0, -0.5], [-2.0]],
        "ref_logprobs": [[-1.2, -0.5], [-1.0]],  # d = [0.2, 0.0], [-1.0]
        "values": [[0.25, 0.5], [0.0]],
    })


def test_gae_table_kl_in_reward_and_returns_hand_computed():
    frame, metrics, kl = compute_advantages(token_rows(), cfg(estimator="gae"))
    # token rewards (beta 0.5, k1): row 0: [-0.1, 0.0 + 1.0] ; row 1: [+0.5 + 0.0]
    # gamma = lam = 1, no whitening: A_t = sum of future rewards - V_t
    # row 0: A_1 = 1.0 - 0.5 = 0.5; A_0 = -0.1 + 1.0 - 0.25 = 0.65; row 1: A_0 = 0.5 - 0 = 0.5
    np.testing.assert_allclose(frame["token_advantages"][0].to_list(), [0.65, 0.5], rtol=1e-6)
    np.testing.assert_allclose(frame["token_advantages"][1].to_list(), [0.5], rtol=1e-6)
    # returns R_t = A_t + V_t
    np.testing.assert_allclose(frame["returns"][0].to_list(), [0.9, 1.0], rtol=1e-6)
    np.testing.assert_allclose(frame["returns"][1].to_list(), [0.5], rtol=1e-6)
    assert frame["advantage"].is_null().all()
    validate_frame(frame, ADVANTAGES)
    # observed KL: per-sequence sums 0.2 and -1.0 -> mean -0.4; not adaptive -> beta stays
    assert kl["in_reward"] and kl["observed_kl"] == pytest.approx(-0.4) and kl["next_beta"] == 0.5
    assert metrics["kl_reward_observed"] == pytest.approx(-0.4)


def test_adaptive_kl_controller_moves_beta():
    # k3 per token: exp(-0.2) - 1 + 0.2 = 0.018731, 0, exp(1) - 2 = 0.718282 -> sums 0.018731, 0.718282
    _, _, kl = compute_advantages(token_rows(), cfg(estimator="reinforce_plus_plus",
                                                    kl={"estimator": "k3", "adaptive": True, "target": 0.1}))
    observed = (math.exp(-0.2) - 0.8 + math.exp(1) - 2) / 2
    assert kl["observed_kl"] == pytest.approx(observed)
    # e = clip(observed / 0.1 - 1, -0.2, 0.2) = 0.2; beta <- 0.5 * (1 + 0.2 * 2 / 8) = 0.525
    assert kl["next_beta"] == pytest.approx(0.525)


def test_grpo_writes_a_kl_record_without_reading_log_probs():
    _, _, kl = compute_advantages(rows(), cfg())
    assert kl == {"in_reward": False, "beta": 0.5, "estimator": "k1", "adaptive": False, "target": 1.0,
                  "horizon": 8.0, "observed_kl": None, "num_samples": 0, "next_beta": 0.5}


def test_token_level_whitening_leaves_filtered_rows_out():
    rows = token_rows().with_columns(pl.Series("truncated", [False, True]))
    frame, _, _ = compute_advantages(rows, cfg(estimator="gae", whiten=True, drop_truncated=True))
    # one kept row of 2 tokens: whitened over its own tokens -> [+1, -1] (up to eps); the filtered row gets 0
    np.testing.assert_allclose(frame["token_advantages"][0].to_list(), [1.0, -1.0], atol=1e-4)  # std 0.075 + eps
    assert frame["token_advantages"][1].to_list() == [0.0]
    assert frame["filtered_reason"].to_list() == [None, "truncated"]


def test_nan_rewards_the_trl_way():
    """advantage.nan_rewards: zero_advantage: a NaN row is out of its group's statistics, A = 0, still trained."""
    table = rows().with_columns(pl.Series("reward", [1.0, float("nan"), 0.4, 0.2, 0.5, 0.5, 1.0]))
    check_finite_rewards(table, "scores.parquet", allow_nan=True)
    with pytest.raises(ArtifactError, match="non-finite"):
        check_finite_rewards(table, "scores.parquet")
    frame, metrics, _ = compute_advantages(table, cfg(nan_rewards="zero_advantage"))
    # group 7 over [1.0, 0.4, 0.2]: mean 0.5333, sample std sqrt((0.2178 + 0.0178 + 0.1111) / 2)
    r = [1.0, 0.4, 0.2]
    mean = sum(r) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 2)
    adv = frame["advantage"].to_list()
    assert adv[:4] == pytest.approx([(1.0 - mean) / (std + 1e-6), 0.0, (0.4 - mean) / (std + 1e-6),
                                     (0.2 - mean) / (std + 1e-6)], abs=1e-6)
    assert frame["token_advantages"][1].to_list() == [0.0, 0.0, 0.0]
    assert frame["filtered_reason"].null_count() == 7  # the NaN row still enters the loss (its normalisers)
    assert metrics["unscorable"] == 1 and metrics["num_trained"] == 7
    assert frame["group_reward_mean"][0] == pytest.approx(mean)


def test_multi_reward_estimators_read_the_components():
    table = rows().with_columns(pl.Series("reward_a", [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]),
                                pl.Series("reward_b", [0.1, 0.1, 0.0, 0.0, 0.0, 1.0, 0.0]))
    frame, metrics, _ = compute_advantages(table, cfg(estimator="grpo_normalize_then_sum"),
                                           {"reward_a": 1.0, "reward_b": 2.0})
    assert metrics["reward_components"] == 2
    adv = np.array(frame["advantage"].to_list())
    assert abs(adv.mean()) < 1e-6 and adv.std(ddof=1) == pytest.approx(1.0, rel=1e-3)  # batch z-score (eps 1e-6)
    frame, _, _ = compute_advantages(table, cfg(estimator="gdpo", whiten_form="unbiased_rsqrt", whiten_eps=1e-8),
                                     {"reward_a": 1.0, "reward_b": 2.0})
    tokens = np.concatenate([np.array(t) for t in frame["token_advantages"].to_list()])
    assert abs(tokens.mean()) < 1e-6 and tokens.std(ddof=1) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ArtifactError, match="reward_<name>"):
        compute_advantages(table, cfg(estimator="gdpo"))
