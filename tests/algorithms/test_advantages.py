"""Advantage estimators against hand-computed values (ALGORITHMS.md worked examples)."""
import math
import subprocess
import sys

import numpy as np
import pytest

from rlpipe.algorithms.advantages import (
    adaptive_kl_beta,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    kl_penalized_token_rewards,
    reinforce_plus_plus_advantages,
    reward_to_go,
    rloo_advantages,
    whiten,
)
from rlpipe.algorithms.estimators import (
    ADVANTAGE_ESTIMATOR_OPTIONS,
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    get_advantage_estimator,
)
from rlpipe.algorithms.ragged import Layout
from rlpipe.algorithms.group_advantages import (
    exclude_unscorable,
    gdpo_advantages,
    grpo_passk_advantages,
    normalize_then_sum,
    reinforce_plus_plus_baseline_advantages,
)

REWARDS = [1.0, 0.8, 0.4, 0.2]  # ALGORITHMS.md worked example; mean 0.6, deviations +-0.4, +-0.2
SUM_SQ = 0.4**2 + 0.2**2 + 0.2**2 + 0.4**2  # = 0.4

GROUP = dict(singleton_groups="zero", std_scope="group")  # the rlpipe choices for a group of one and the std


def test_advantages_module_does_not_import_torch():
    code = ("import sys, rlpipe.algorithms.advantages, rlpipe.algorithms.estimators, rlpipe.algorithms; "
            "assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_reexports_every_name_in_all():
    import rlpipe.algorithms as algorithms

    assert len(algorithms.__all__) == len(set(algorithms.__all__))
    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None, name
    assert algorithms.grpo_advantages is grpo_advantages
    with pytest.raises(AttributeError):
        algorithms.no_such_function


# ---------------------------------------------------------------------------- GRPO


def test_grpo_population_std_worked_example():
    std = math.sqrt(SUM_SQ / 4)  # 0.3162
    adv, metrics = grpo_advantages(REWARDS, [0, 0, 0, 0], std_mode="population", eps=1e-6, **GROUP)
    expected = [0.4 / (std + 1e-6), 0.2 / (std + 1e-6), -0.2 / (std + 1e-6), -0.4 / (std + 1e-6)]
    np.testing.assert_allclose(adv, expected, rtol=1e-12)
    np.testing.assert_allclose(adv, [1.2649, 0.6325, -0.6325, -1.2649], atol=1e-4)  # the doc's ~[1.26, 0.63, ...]
    assert metrics == {"num_groups": 1, "zero_variance_groups": 0, "zero_variance_fraction": 0.0, "singleton_groups": 0}


def test_grpo_sample_std_worked_example():
    std = math.sqrt(SUM_SQ / 3)  # 0.3651 (Bessel: divide by G-1)
    adv, _ = grpo_advantages(REWARDS, [7, 7, 7, 7], std_mode="sample", eps=1e-6, **GROUP)
    np.testing.assert_allclose(adv, [0.4 / (std + 1e-6), 0.2 / (std + 1e-6), -0.2 / (std + 1e-6), -0.4 / (std + 1e-6)])
    np.testing.assert_allclose(adv, [1.0954, 0.5477, -0.5477, -1.0954], atol=1e-4)


def test_grpo_eps_enters_the_denominator():
    adv, _ = grpo_advantages([1.0, 0.0], [0, 0], std_mode="population", eps=0.5, **GROUP)
    # mean 0.5, population std 0.5 -> 0.5 / (0.5 + 0.5) = 0.5
    np.testing.assert_allclose(adv, [0.5, -0.5])


def test_grpo_unsorted_noncontiguous_groups_zero_variance_and_singletons():
    rewards = [1.0, 0.3, 0.0, 0.3, 5.0, 0.3, 1.0, 0.0]
    groups = [42, 9, 42, 9, 100, 9, -3, -3]
    adv, metrics = grpo_advantages(rewards, np.array(groups, dtype=np.int64), std_mode="population", eps=0.0,
                                   **GROUP)
    # group 42: [1, 0] -> mean 0.5, std 0.5 -> [+1, -1]; group 9: all 0.3 -> 0;
    # group 100: singleton -> 0; group -3: [1, 0] -> [+1, -1]
    np.testing.assert_array_equal(adv, [1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 1.0, -1.0])
    assert metrics["num_groups"] == 4
    assert metrics["zero_variance_groups"] == 1
    assert metrics["singleton_groups"] == 1
    assert metrics["zero_variance_fraction"] == 0.25
    assert all(type(v) in (int, float) for v in metrics.values())


def test_grpo_all_equal_rewards_are_exactly_zero_even_when_the_float_mean_is_not():
    # three 0.1s: the float mean is 0.10000000000000002, so a tolerance-free std would be tiny, not 0
    for std_mode in ("sample", "population"):
        adv, metrics = grpo_advantages([0.1, 0.1, 0.1], [0, 0, 0], std_mode=std_mode, eps=1e-9,
                                       **GROUP)
        assert np.all(adv == 0.0)
        assert metrics["zero_variance_groups"] == 1


def test_grpo_singleton_with_sample_std_is_zero_not_nan():
    adv, metrics = grpo_advantages([3.0], [0], std_mode="sample", eps=1e-6, **GROUP)
    assert adv.tolist() == [0.0]
    assert metrics["singleton_groups"] == 1 and metrics["zero_variance_groups"] == 0


def test_grpo_rejects_bad_inputs():
    with pytest.raises(ValueError, match="std_mode"):
        grpo_advantages(REWARDS, [0] * 4, std_mode="bessel", eps=1e-6, **GROUP)
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(REWARDS, [0.0] * 4, std_mode="sample", eps=1e-6, **GROUP)
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages([1.0, float("nan")], [0, 0], std_mode="sample", eps=1e-6, **GROUP)
    with pytest.raises(ValueError, match="shape"):
        grpo_advantages(REWARDS, [0] * 3, std_mode="sample", eps=1e-6, **GROUP)


# ---------------------------------------------------------------------------- Dr.GRPO, RLOO


def test_dr_grpo_is_centred_only():
    adv, metrics = dr_grpo_advantages(REWARDS + [2.0, 2.0, 9.0], [0, 0, 0, 0, 1, 1, 2], singleton_groups="zero")
    # group 0: R - 0.6; group 1 all equal -> 0; group 2 singleton -> 0
    np.testing.assert_allclose(adv, [0.4, 0.2, -0.2, -0.4, 0.0, 0.0, 0.0], atol=1e-15)
    assert (metrics["zero_variance_groups"], metrics["singleton_groups"]) == (1, 1)


def test_rloo_by_hand():
    adv, metrics = rloo_advantages([1.0, 0.0, 0.5, 4.0, 2.0, 7.0], [0, 0, 0, 1, 1, 2])
    expected = [
        1.0 - (0.0 + 0.5) / 2,  # 0.75
        0.0 - (1.0 + 0.5) / 2,  # -0.75
        0.5 - (1.0 + 0.0) / 2,  # 0.0
        4.0 - 2.0 / 1,  # 2.0
        2.0 - 4.0 / 1,  # -2.0
        0.0,  # singleton: no leave-one-out baseline
    ]
    np.testing.assert_allclose(adv, expected, atol=1e-15)
    assert metrics["singleton_groups"] == 1


# ---------------------------------------------------------------------------- token rewards


def test_kl_in_reward_worked_example():
    # one-token completion: score 0.8, log pi_old - log pi_ref = 0.05, beta 6 -> 0.8 - 6 * 0.05 = 0.5
    rewards = kl_penalized_token_rewards([0.8], [[-1.00]], [[-1.05]], [[True]], beta=6.0)
    np.testing.assert_allclose(rewards, [[0.5]], atol=1e-12)


def test_kl_in_reward_score_on_last_valid_token_and_padding_zero():
    old = [[-1.0, -2.0, -0.5, np.nan], [-1.0, 123.0, np.nan, np.nan]]
    ref = [[-1.1, -1.8, -0.5, 7.0], [-1.0, 0.0, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 0, 0, 0]]
    rewards = kl_penalized_token_rewards([2.0, -1.0], old, ref, mask, beta=0.5)
    expected = [
        [-0.5 * 0.1, -0.5 * -0.2, -0.5 * 0.0 + 2.0, 0.0],  # score on token 2 (last valid)
        [-0.5 * 0.0 - 1.0, 0.0, 0.0, 0.0],
    ]
    np.testing.assert_allclose(rewards, expected, atol=1e-12)


def test_kl_in_reward_empty_row_stays_zero():
    rewards = kl_penalized_token_rewards([1.0, 1.0], [[0.0, 0.0]] * 2, [[0.0, 0.0]] * 2, [[1, 0], [0, 0]], beta=1.0)
    np.testing.assert_array_equal(rewards, [[1.0, 0.0], [0.0, 0.0]])


def test_whiten_by_hand_and_padding_ignored():
    x = [[1.0, 2.0, 3.0, 1e30], [np.nan, 0.0, 0.0, 0.0]]
    mask = [[True, True, True, False], [False, False, False, False]]
    # valid [1, 2, 3]: mean 2, population std sqrt(2/3) = 0.8165
    std = math.sqrt(2 / 3)
    np.testing.assert_allclose(whiten(x, mask, form="std", eps=0.0), [[-1 / std, 0.0, 1 / std, 0.0], [0.0] * 4])
    np.testing.assert_array_equal(whiten(x, np.zeros((2, 4), bool), form="std", eps=1e-6), np.zeros((2, 4)))


def test_whiten_forms_on_the_issue_16_example():
    # token rewards [[0, 1], [0, 0]], gamma 1 -> returns [[1, 1], [0, 0]]: mean 0.5, deviations +-0.5
    returns = reward_to_go([[0.0, 1.0], [0.0, 0.0]], np.ones((2, 2)))
    np.testing.assert_array_equal(returns, [[1.0, 1.0], [0.0, 0.0]])
    mask = np.ones((2, 2))
    # std: population var 0.25 -> 0.5 / (0.5 + 1e-6) = 0.999998
    np.testing.assert_allclose(whiten(returns, mask, form="std", eps=1e-6), [[0.999998] * 2, [-0.999998] * 2],
                               rtol=1e-6)
    # verl masked_whiten: Bessel var 0.25 * 4/3 = 1/3 -> 0.5 * rsqrt(1/3 + 1e-8) = 0.8660254
    verl = 0.5 / math.sqrt(1 / 3 + 1e-8)
    np.testing.assert_allclose(whiten(returns, mask, form="unbiased_rsqrt", eps=1e-8), [[verl] * 2, [-verl] * 2],
                               rtol=1e-12)
    assert verl == pytest.approx(0.866025, abs=1e-6)
    # OpenRLHF: population var 0.25, max(0.25, 1e-8) -> 0.5 / 0.5 = 1 exactly
    np.testing.assert_allclose(whiten(returns, mask, form="population_rsqrt", eps=1e-8), [[1.0] * 2, [-1.0] * 2])
    # the same numbers through REINFORCE++
    np.testing.assert_allclose(reinforce_plus_plus_advantages([[0.0, 1.0], [0.0, 0.0]], mask,
                                                              whiten_form="unbiased_rsqrt", eps=1e-8),
                               [[verl] * 2, [-verl] * 2], rtol=1e-12)


def test_whiten_edge_cases_of_the_rsqrt_forms():
    one = whiten([[5.0, 0.0]], [[1, 0]], form="unbiased_rsqrt", eps=1e-8)  # N = 1: no Bessel variance (verl raises)
    np.testing.assert_array_equal(one, [[0.0, 0.0]])
    # all equal: the rsqrt forms scale 0 by rsqrt(eps) -> exactly 0
    for form in ("unbiased_rsqrt", "population_rsqrt"):
        np.testing.assert_array_equal(whiten([[2.0, 2.0]], [[1, 1]], form=form, eps=1e-8), [[0.0, 0.0]])
    with pytest.raises(ValueError, match="unknown whitening form 'bessel'"):
        whiten([[1.0, 2.0]], [[1, 1]], form="bessel", eps=1e-8)


def test_reinforce_plus_plus_by_hand():
    rewards = [[0.0, 0.0, 1.0], [0.5, -1.0, 99.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    # reward-to-go: row 0 [1, 1, 1]; row 1 [0.5 - 1, -1] = [-0.5, -1]
    # valid returns [1, 1, 1, -0.5, -1]: mean 0.3, deviations 0.7 x3, -0.8, -1.3
    var = (3 * 0.49 + 0.64 + 1.69) / 5  # 0.76
    std = math.sqrt(var)
    eps = 1e-6
    expected = [[0.7 / (std + eps)] * 3, [-0.8 / (std + eps), -1.3 / (std + eps), 0.0]]
    np.testing.assert_allclose(reinforce_plus_plus_advantages(rewards, mask, whiten_form="std", eps=eps), expected,
                               rtol=1e-12)


def test_gae_three_tokens_by_hand():
    rewards = [[0.0, 0.0, 1.0, 55.0]]
    values = [[0.5, 0.6, 0.7, np.nan]]
    mask = [[1, 1, 1, 0]]
    gamma, lam = 0.9, 0.8
    delta2 = 1.0 + gamma * 0.0 - 0.7  # V after the last valid token is 0 -> 0.3
    delta1 = 0.0 + gamma * 0.7 - 0.6  # 0.03
    delta0 = 0.0 + gamma * 0.6 - 0.5  # 0.04
    a2 = delta2  # 0.3
    a1 = delta1 + gamma * lam * a2  # 0.03 + 0.72 * 0.3 = 0.246
    a0 = delta0 + gamma * lam * a1  # 0.04 + 0.72 * 0.246 = 0.21712
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    np.testing.assert_allclose(adv, [[a0, a1, a2, 0.0]], atol=1e-12)
    np.testing.assert_allclose(adv[0, :3], [0.21712, 0.246, 0.3], atol=1e-12)
    np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0]], atol=1e-12)


def test_gae_gamma_one_lambda_one_is_reward_to_go_minus_value():
    rewards = np.array([[0.2, -0.1, 1.0], [0.0, 0.3, 0.0]])
    values = np.array([[0.4, 0.1, 0.9], [0.2, 0.7, 0.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, [[1.1, 0.9, 1.0], [0.3, 0.3, 0.0]], atol=1e-12)
    np.testing.assert_allclose(adv, ret - np.where(mask, values, 0.0), atol=1e-12)


# ---------------------------------------------------------------------------- adaptive KL


def test_adaptive_kl_beta_by_hand():
    # observed 0.15 / target 0.1 - 1 = 0.5 -> clipped to 0.2; n 64, horizon 10000
    assert adaptive_kl_beta(0.1, observed_kl=0.15, target_kl=0.1, horizon=10000, num_samples=64) == pytest.approx(
        0.1 * (1 + 0.2 * 64 / 10000)
    )
    # 0.09 / 0.1 - 1 = -0.1 (inside the clip)
    assert adaptive_kl_beta(0.1, observed_kl=0.09, target_kl=0.1, horizon=10000, num_samples=64) == pytest.approx(
        0.1 * (1 - 0.1 * 64 / 10000)
    )
    # 0 / 0.1 - 1 = -1 -> clipped to -0.2
    assert adaptive_kl_beta(2.0, observed_kl=0.0, target_kl=0.1, horizon=100, num_samples=50) == pytest.approx(
        2.0 * (1 - 0.2 * 50 / 100)
    )


# ---------------------------------------------------------------------------- registry


def _call(name, options, **inputs):
    """The registry on dense test inputs: [B, T] arrays read row by row as a flat layout of B rows of T."""
    base = dict(rewards_B=None, group_index_B=None, layout=None, mask_N=None, token_rewards_N=None, values_N=None,
                component_rewards_BK=None)
    mask = inputs.pop("mask_BT", None)
    if mask is not None:
        mask = np.asarray(mask)
        inputs["layout"] = Layout.dense(*mask.shape)
        inputs["mask_N"] = mask.reshape(-1)
    for dense, flat in (("token_rewards_BT", "token_rewards_N"), ("values_BT", "values_N")):
        if dense in inputs:
            inputs[flat] = np.asarray(inputs.pop(dense), dtype=np.float64).reshape(-1)
    return get_advantage_estimator(name)(**{**base, **inputs}, options=options)


def _dense(x_N, like):
    return np.asarray(x_N).reshape(np.asarray(like).shape)


def test_registry_names_and_options_table_agree():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae", "grpo_passk",
                                         "reinforce_plus_plus_baseline", "gdpo", "grpo_normalize_then_sum"}
    assert set(ADVANTAGE_ESTIMATOR_OPTIONS) == set(ADVANTAGE_ESTIMATORS)


def test_registry_grpo_broadcasts_to_valid_tokens():
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], bool)
    options = {"std_mode": "population", "eps": 1e-6, "singleton_groups": "zero", "std_scope": "group"}
    result = _call("grpo", options, rewards_B=REWARDS, group_index_B=[0] * 4, mask_BT=mask)
    assert isinstance(result, AdvantageResult) and result.returns_N is None
    a = result.sequence_advantages_B
    np.testing.assert_allclose(a, [1.2649, 0.6325, -0.6325, -1.2649], atol=1e-4)
    np.testing.assert_array_equal(_dense(result.token_advantages_N, mask), np.where(mask, a[:, None], 0.0))
    with pytest.raises(AttributeError):
        result.metrics = {}  # frozen


def test_registry_every_entry_runs_with_its_options():
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    inputs = dict(
        rewards_B=[1.0, 0.0],
        group_index_B=[0, 0],
        token_rewards_BT=[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]],
        values_BT=[[0.1, 0.2, 0.3], [0.0, 0.1, 0.0]],
        mask_BT=mask,
        component_rewards_BK=[[1.0, 0.5], [0.0, 0.5]],
    )
    options = {
        "grpo": {"std_mode": "sample", "eps": 1e-6, "singleton_groups": "zero", "std_scope": "group"},
        "dr_grpo": {"singleton_groups": "zero"},
        "rloo": {},
        "reinforce_plus_plus": {"whiten_form": "std", "whiten_eps": 1e-6},
        "gae": {"gamma": 1.0, "lam": 0.95, "whiten": True, "whiten_form": "std", "whiten_eps": 1e-6},
        "grpo_passk": {"std_mode": "sample", "eps": 1e-6},
        "reinforce_plus_plus_baseline": {"singleton_groups": "zero", "whiten_form": "unbiased_rsqrt",
                                         "whiten_eps": 1e-8},
        "gdpo": {"std_mode": "sample", "eps": 1e-6, "singleton_groups": "uncentered",
                 "whiten_form": "unbiased_rsqrt", "whiten_eps": 1e-8, "reward_weights": [1.0, 1.0]},
        "grpo_normalize_then_sum": {"std_mode": "sample", "eps": 1e-4, "reward_weights": [1.0, 2.0]},
    }
    assert set(options) == set(ADVANTAGE_ESTIMATORS)
    for name in ADVANTAGE_ESTIMATORS:
        result = _call(name, options[name], **dict(inputs))
        assert result.token_advantages_N.shape == (6,)
        assert np.all(_dense(result.token_advantages_N, mask)[~mask] == 0.0)
    np.testing.assert_allclose(_call("rloo", {}, **dict(inputs)).sequence_advantages_B, [1.0, -1.0])
    gae = _call("gae", options["gae"], **dict(inputs))
    # GAE through the registry is whitened over valid tokens (ALGORITHMS.md); returns use the raw A
    assert abs(_dense(gae.token_advantages_N, mask)[mask].mean()) < 1e-12
    raw, ret = gae_advantages(inputs["token_rewards_BT"], inputs["values_BT"], mask, gamma=1.0, lam=0.95)
    np.testing.assert_array_equal(_dense(gae.returns_N, mask), ret)
    np.testing.assert_allclose(_dense(gae.token_advantages_N, mask), whiten(raw, mask, form="std", eps=1e-6))


def test_registry_missing_unknown_option_and_missing_input():
    with pytest.raises(KeyError, match="eps"):
        _call("grpo", {"std_mode": "sample"}, rewards_B=[1.0], group_index_B=[0], mask_BT=[[1]])
    with pytest.raises(KeyError, match="lam"):
        _call("gae", {"gamma": 1.0, "eps": 1e-6}, token_rewards_BT=[[1.0]], values_BT=[[0.0]], mask_BT=[[1]])
    with pytest.raises(ValueError, match="std_mod"):
        options = {"std_mode": "sample", "eps": 1e-6, "singleton_groups": "zero", "std_scope": "group",
                   "std_mod": "x"}
        _call("grpo", options, rewards_B=[1.0], group_index_B=[0], mask_BT=[[1]])
    with pytest.raises(ValueError, match="values_N"):
        _call("gae", {"gamma": 1.0, "lam": 1.0, "whiten": True, "whiten_form": "std", "whiten_eps": 1e-6},
              token_rewards_BT=[[1.0]], mask_BT=[[1]])


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="dr_grpo.*gae.*grpo.*reinforce_plus_plus.*rloo"):
        get_advantage_estimator("ppo")


def test_numeric_mask_must_be_zero_one():
    with pytest.raises(ValueError, match="0 and 1"):
        whiten([[1.0, 2.0]], [[1.0, 0.5]], form="std", eps=1e-6)


def test_token_kl_estimators_hand_computed():
    from rlpipe.algorithms.advantages import token_kl
    old = [[-1.0, -2.0, 0.0]]
    ref = [[-1.5, -1.0, 9.0]]  # d = old - ref = [0.5, -1.0, pad]
    mask = [[1, 1, 0]]
    np.testing.assert_allclose(token_kl(old, ref, mask, estimator="k1"), [[0.5, -1.0, 0.0]])
    np.testing.assert_allclose(token_kl(old, ref, mask, estimator="k2"), [[0.125, 0.5, 0.0]])
    # k3 = exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.10653066; exp(1) - 2 = 0.71828183
    np.testing.assert_allclose(token_kl(old, ref, mask, estimator="k3"), [[0.10653066, 0.71828183, 0.0]], rtol=1e-7)
    assert np.isfinite(token_kl([[0.0]], [[-1e6]], [[1]], estimator="k3")).all()
    with pytest.raises(ValueError, match="k4"):
        token_kl(old, ref, mask, estimator="k4")


def test_kl_penalized_token_rewards_with_k2():
    # score 0.8 on the last token; k2 per token = 0.5 * 0.1^2 = 0.005; beta 6 -> -0.03 per token
    r = kl_penalized_token_rewards([0.8], [[-1.0, -1.0]], [[-1.1, -1.1]], [[1, 1]], beta=6.0, estimator="k2")
    np.testing.assert_allclose(r, [[-0.03, 0.8 - 0.03]])


def test_gae_entry_without_whitening_returns_raw_advantages():
    inputs = dict(rewards_B=None, group_index_B=None, token_rewards_BT=[[0.0, 1.0]], values_BT=[[0.5, 0.25]],
                  mask_BT=[[1, 1]])
    options = {"gamma": 1.0, "lam": 1.0, "whiten": False, "whiten_form": "std", "whiten_eps": 1e-6}
    result = _call("gae", options, **inputs)
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.75 = 0.5
    np.testing.assert_allclose(result.token_advantages_N, [0.5, 0.75])
    np.testing.assert_allclose(result.returns_N, [1.0, 1.0])


# ---------------------------------------------------------------------------- pass@k, REINFORCE++-baseline,
# multi-reward normalisation, batch std, unscorable rewards


def test_grpo_batch_std_scope_by_hand():
    # groups [1, 0] and [1, 1]: group means 0.5 and 1; batch sample std of [1, 0, 1, 1] = sqrt(0.75 / 3) = 0.5
    adv, metrics = grpo_advantages([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], std_mode="sample", eps=0.0,
                                   singleton_groups="zero", std_scope="batch")
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0])
    group, _ = grpo_advantages([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], std_mode="sample", eps=0.0, **GROUP)
    np.testing.assert_allclose(group, [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0, 0.0])
    assert metrics["zero_variance_groups"] == 1
    with pytest.raises(ValueError, match="std_scope"):
        grpo_advantages([1.0], [0], std_mode="sample", eps=0.0, singleton_groups="zero", std_scope="global")


def test_grpo_passk_by_hand():
    # group 0 [1, 0, 0.5, 0]: best 1, runner-up 0.5; sample std: mean 0.375, squares 0.6875 / 3
    # group 1 [0.2, 0.2] zero variance -> 0; group 2 a group of one -> 0
    adv, metrics = grpo_passk_advantages([1.0, 0.0, 0.5, 0.0, 0.2, 0.2, 3.0], [0, 0, 0, 0, 1, 1, 2],
                                         std_mode="sample", eps=1e-6)
    std = math.sqrt(0.6875 / 3)
    np.testing.assert_allclose(adv, [0.5 / (std + 1e-6), 0, 0, 0, 0, 0, 0])
    assert adv[0] == pytest.approx(1.0445, abs=1e-4)
    assert (metrics["zero_variance_groups"], metrics["singleton_groups"]) == (1, 1)
    # a tie for the best: margin 0 -> every advantage 0
    tied, _ = grpo_passk_advantages([1.0, 1.0, 0.0], [0, 0, 0], std_mode="sample", eps=1e-6)
    np.testing.assert_array_equal(tied, [0.0, 0.0, 0.0])


def test_reinforce_plus_plus_baseline_by_hand():
    # rewards [1, 0 | 1] (groups of 2 and 1), lengths [2, 1, 1]: centred [0.5, -0.5, 0]
    # tokens [0.5, 0.5, -0.5, 0]: mean 0.125, Bessel var 0.6875 / 3, verl's rsqrt(var + 1e-8)
    mask = [[1, 1], [1, 0], [1, 0]]
    adv, metrics = reinforce_plus_plus_baseline_advantages([1.0, 0.0, 1.0], [0, 0, 1], mask, singleton_groups="zero",
                                                           whiten_form="unbiased_rsqrt", eps=1e-8)
    scale = 1 / math.sqrt(0.6875 / 3 + 1e-8)
    expected = [[0.375 * scale] * 2, [-0.625 * scale, 0.0], [-0.125 * scale, 0.0]]
    np.testing.assert_allclose(adv, expected, rtol=1e-12)
    assert adv[0, 0] == pytest.approx(0.7833, abs=1e-4)
    assert metrics["singleton_groups"] == 1
    # verl's group of one keeps R = 1 before whitening: tokens [0.5, 0.5, -0.5, 1]
    uncentred, _ = reinforce_plus_plus_baseline_advantages([1.0, 0.0, 1.0], [0, 0, 1], mask,
                                                           singleton_groups="uncentered", whiten_form="std", eps=0.0)
    x = np.array([0.5, 0.5, -0.5, 1.0])
    np.testing.assert_allclose(uncentred[np.array(mask, bool)], (x - x.mean()) / x.std())
    result = _call("reinforce_plus_plus_baseline", {"singleton_groups": "zero", "whiten_form": "unbiased_rsqrt",
                                                    "whiten_eps": 1e-8},
                   rewards_B=[1.0, 0.0, 1.0], group_index_B=[0, 0, 1], mask_BT=mask)
    np.testing.assert_allclose(result.sequence_advantages_B, [0.375 * scale, -0.625 * scale, -0.125 * scale])


def test_normalize_then_sum_by_hand():
    # one group of 2; component 0 [1, 0] -> +-0.7071 (sample std 0.7071, eps 0); component 1 all equal -> 0
    s = normalize_then_sum([[1.0, 0.3], [0.0, 0.3]], [0, 0], weights_K=[1.0, 1.0], std_mode="sample", eps=0.0)
    np.testing.assert_allclose(s, [1 / math.sqrt(2), -1 / math.sqrt(2)])
    # a NaN component is left out of its group's statistics and adds 0; an all-NaN row stays NaN
    c = [[1.0, np.nan], [0.0, 2.0], [np.nan, 0.0], [np.nan, np.nan]]
    s = normalize_then_sum(c, [0, 0, 0, 0], weights_K=[1.0, 2.0], std_mode="sample", eps=0.0)
    # component 0 over [1, 0]: +-0.7071; component 1 over [2, 0]: +-0.7071, weight 2
    r = 1 / math.sqrt(2)
    np.testing.assert_allclose(s[:3], [r, -r + 2 * r, -2 * r])
    assert np.isnan(s[3])
    # TRL's whole estimator: then z-scored over the batch's sequences (sample std, eps 1e-4)
    result = _call("grpo_normalize_then_sum", {"std_mode": "sample", "eps": 1e-4, "reward_weights": [1.0, 1.0]},
                   rewards_B=[1.0, 0.0, 0.0, 0.0], group_index_B=[0, 0, 1, 1], mask_BT=np.ones((4, 1)),
                   component_rewards_BK=[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    z = 0.5 / (math.sqrt(0.5) + 1e-4)  # each group: +-z from one component
    summed = np.array([z, -z, z, -z])
    expected = (summed - summed.mean()) / (summed.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(result.sequence_advantages_B, expected)


def test_gdpo_is_the_weighted_sum_of_grpo_advantages_whitened():
    c = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    mask = np.array([[1, 1], [1, 0], [1, 1], [1, 0]], bool)
    adv = gdpo_advantages(c, [0, 0, 1, 1], mask, weights_K=[1.0, 0.5], std_mode="sample", eps=1e-6,
                          singleton_groups="zero", whiten_form="unbiased_rsqrt", whiten_eps=1e-8)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # every group's +-0.5 over sample std sqrt(0.5)
    summed = np.array([a - 0.5 * a, -a + 0.5 * a, 0.0, 0.0])  # group 0: [a, -a] + 0.5 [-a, a]; group 1 the same
    summed[2:] = [a + 0.5 * a, -a - 0.5 * a]
    tokens = np.concatenate([[summed[0]] * 2, [summed[1]], [summed[2]] * 2, [summed[3]]])
    expected = (tokens - tokens.mean()) / math.sqrt(tokens.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv[mask], expected, rtol=1e-12)
    assert np.all(adv[~mask] == 0.0)


def test_exclude_unscorable_leaves_nan_rows_out_of_the_group():
    # GRPO on [1, NaN, 0]: group statistics over [1, 0] only, the NaN row gets 0
    adv, metrics = exclude_unscorable(grpo_advantages, [1.0, np.nan, 0.0], [0, 0, 0], std_mode="sample", eps=0.0,
                                      **GROUP)
    np.testing.assert_allclose(adv, [1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)])
    assert metrics["unscorable"] == 1 and metrics["num_groups"] == 1
    with pytest.raises(ValueError, match="inf"):
        exclude_unscorable(grpo_advantages, [1.0, np.inf], [0, 0], std_mode="sample", eps=0.0, **GROUP)
