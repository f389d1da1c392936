"""The advantage estimators' registry: one keyword-only signature for every estimator, by name.

Why a module of its own: the estimators live in two modules (`advantages`, and `group_advantages`,
which builds on the first one's group statistics); the registry needs both, so it sits above them and
neither imports it. The advantage stage looks estimators up here by the name params.yaml gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from rlpipe.algorithms.advantages import (as_bool_mask, as_rewards, dr_grpo_advantages, gae_advantages, group_metrics,
                                          group_stats, grpo_advantages, reinforce_plus_plus_advantages, rloo_advantages,
                                          whiten)
from rlpipe.algorithms.group_advantages import (gdpo_advantages, grpo_passk_advantages, normalize_then_sum,
                                                reinforce_plus_plus_baseline_advantages, sequence_zscore)


@dataclass(frozen=True)
class AdvantageResult:
    """What every entry of `ADVANTAGE_ESTIMATORS` returns.

    token_advantages_BT: [B, T] float64, 0 at padding (sequence estimators broadcast A_i);
    sequence_advantages_B: [B] for sequence estimators, else None;
    returns_BT: critic targets [B, T] for "gae", else None; metrics: python numbers.
    """

    token_advantages_BT: np.ndarray
    sequence_advantages_B: np.ndarray | None
    returns_BT: np.ndarray | None
    metrics: dict


# which options each registry entry requires (for config validation and docs)
ADVANTAGE_ESTIMATOR_OPTIONS: dict[str, tuple[str, ...]] = {
    "grpo": ("std_mode", "eps", "singleton_groups", "std_scope"),
    "dr_grpo": ("singleton_groups",),
    "rloo": (),
    "reinforce_plus_plus": ("whiten_form", "whiten_eps"),
    "gae": ("gamma", "lam", "whiten", "whiten_form", "whiten_eps"),
    "grpo_passk": ("std_mode", "eps"),
    "reinforce_plus_plus_baseline": ("singleton_groups", "whiten_form", "whiten_eps"),
    "gdpo": ("std_mode", "eps", "singleton_groups", "whiten_form", "whiten_eps", "reward_weights"),
    "grpo_normalize_then_sum": ("std_mode", "eps", "reward_weights"),
}


def _options(name: str, options: dict) -> dict:
    required = ADVANTAGE_ESTIMATOR_OPTIONS[name]
    for key in required:
        if key not in options:
            raise KeyError(f"advantage estimator {name!r} needs option {key!r} (its options: {list(required)})")
    unknown = sorted(set(options) - set(required))
    if unknown:
        raise ValueError(f"advantage estimator {name!r} got unknown options {unknown} (its options: {list(required)})")
    return options


def _need(name: str, **inputs):
    for key, value in inputs.items():
        if value is None:
            raise ValueError(f"advantage estimator {name!r} needs input {key}")


def _broadcast(name, fn, rewards_B, group_index_B, mask_BT, kwargs) -> AdvantageResult:
    _need(name, rewards_B=rewards_B, group_index_B=group_index_B, mask_BT=mask_BT)
    adv_B, metrics = fn(rewards_B, group_index_B, **kwargs)
    m = as_bool_mask(mask_BT)
    if m.shape[0] != adv_B.shape[0]:
        raise ValueError(f"mask_BT has {m.shape[0]} rows, rewards_B has {adv_B.shape[0]}")
    return AdvantageResult(np.where(m, adv_B[:, None], 0.0), adv_B, None, metrics)


def _grpo_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                 component_rewards_BK, options) -> AdvantageResult:
    o = _options("grpo", options)
    return _broadcast("grpo", grpo_advantages, rewards_B, group_index_B, mask_BT, dict(o))


def _dr_grpo_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                 component_rewards_BK, options) -> AdvantageResult:
    o = _options("dr_grpo", options)
    return _broadcast("dr_grpo", dr_grpo_advantages, rewards_B, group_index_B, mask_BT, dict(o))


def _rloo_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                 component_rewards_BK, options) -> AdvantageResult:
    _options("rloo", options)
    return _broadcast("rloo", rloo_advantages, rewards_B, group_index_B, mask_BT, {})


def _reinforce_pp_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                 component_rewards_BK, options) -> AdvantageResult:
    o = _options("reinforce_plus_plus", options)
    _need("reinforce_plus_plus", token_rewards_BT=token_rewards_BT, mask_BT=mask_BT)
    adv_BT = reinforce_plus_plus_advantages(token_rewards_BT, mask_BT, whiten_form=o["whiten_form"],
                                            eps=o["whiten_eps"])
    metrics = {"num_valid_tokens": int(as_bool_mask(mask_BT).sum())}
    return AdvantageResult(adv_BT, None, None, metrics)


def _gae_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                 component_rewards_BK, options) -> AdvantageResult:
    """GAE, then (``whiten``) advantages z-scored over the batch's valid tokens; returns from the raw A."""
    o = _options("gae", options)
    _need("gae", token_rewards_BT=token_rewards_BT, values_BT=values_BT, mask_BT=mask_BT)
    raw_BT, returns_BT = gae_advantages(token_rewards_BT, values_BT, mask_BT, gamma=o["gamma"], lam=o["lam"])
    m = as_bool_mask(mask_BT)
    n = int(m.sum())
    metrics = {
        "num_valid_tokens": n,
        "raw_advantage_mean": float(raw_BT[m].mean()) if n else 0.0,
        "return_mean": float(returns_BT[m].mean()) if n else 0.0,
    }
    adv_BT = whiten(raw_BT, m, form=o["whiten_form"], eps=o["whiten_eps"]) if o["whiten"] else raw_BT
    return AdvantageResult(adv_BT, None, returns_BT, metrics)


def _grpo_passk_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                      component_rewards_BK, options) -> AdvantageResult:
    o = _options("grpo_passk", options)
    return _broadcast("grpo_passk", grpo_passk_advantages, rewards_B, group_index_B, mask_BT, dict(o))


def _sequence_result(adv_BT: np.ndarray, m: np.ndarray, metrics: dict) -> AdvantageResult:
    """A token result whose tokens share their sequence's value (a whitened sequence advantage): A_i is
    that value (0 for a row without valid tokens), so the off-policy mask can read its sign."""
    first_B = np.argmax(m, axis=1)
    seq_B = np.where(m.any(axis=1), adv_BT[np.arange(m.shape[0]), first_B], 0.0)
    return AdvantageResult(adv_BT, seq_B, None, metrics)


def _reinforce_pp_baseline_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                                 component_rewards_BK, options) -> AdvantageResult:
    o = _options("reinforce_plus_plus_baseline", options)
    _need("reinforce_plus_plus_baseline", rewards_B=rewards_B, group_index_B=group_index_B, mask_BT=mask_BT)
    adv_BT, metrics = reinforce_plus_plus_baseline_advantages(
        rewards_B, group_index_B, mask_BT, singleton_groups=o["singleton_groups"], whiten_form=o["whiten_form"],
        eps=o["whiten_eps"])
    return _sequence_result(adv_BT, as_bool_mask(mask_BT), metrics)


def _components(name, component_rewards_BK, rewards_B, weights) -> tuple[np.ndarray, np.ndarray]:
    _need(name, component_rewards_BK=component_rewards_BK, rewards_B=rewards_B)
    c_BK = np.asarray(component_rewards_BK, dtype=np.float64)
    if c_BK.ndim != 2 or c_BK.shape[0] != np.asarray(rewards_B).shape[0]:
        raise ValueError(f"component_rewards_BK must be [B, K] with B = {np.asarray(rewards_B).shape[0]}, "
                         f"got {c_BK.shape}")
    return c_BK, np.asarray(weights, dtype=np.float64)


def _gdpo_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                component_rewards_BK, options) -> AdvantageResult:
    o = _options("gdpo", options)
    _need("gdpo", group_index_B=group_index_B, mask_BT=mask_BT)
    c_BK, w_K = _components("gdpo", component_rewards_BK, rewards_B, o["reward_weights"])
    m = as_bool_mask(mask_BT)
    adv_BT = gdpo_advantages(c_BK, group_index_B, m, weights_K=w_K, std_mode=o["std_mode"], eps=o["eps"],
                             singleton_groups=o["singleton_groups"], whiten_form=o["whiten_form"],
                             whiten_eps=o["whiten_eps"])
    _, size_g, _, singleton_g, zero_var_g = group_stats(as_rewards(rewards_B), group_index_B)
    return _sequence_result(adv_BT, m, {**group_metrics(size_g, singleton_g, zero_var_g),
                                        "reward_components": int(c_BK.shape[1])})


def _grpo_nts_entry(*, rewards_B, group_index_B, token_rewards_BT, values_BT, mask_BT,
                    component_rewards_BK, options) -> AdvantageResult:
    o = _options("grpo_normalize_then_sum", options)
    _need("grpo_normalize_then_sum", group_index_B=group_index_B, mask_BT=mask_BT)
    c_BK, w_K = _components("grpo_normalize_then_sum", component_rewards_BK, rewards_B, o["reward_weights"])
    summed_B = normalize_then_sum(c_BK, group_index_B, weights_K=w_K, std_mode=o["std_mode"], eps=o["eps"])
    adv_B = np.nan_to_num(sequence_zscore(summed_B, std_mode=o["std_mode"], eps=o["eps"]), nan=0.0)
    m = as_bool_mask(mask_BT)
    _, size_g, _, singleton_g, zero_var_g = group_stats(as_rewards(rewards_B), group_index_B)
    metrics = {**group_metrics(size_g, singleton_g, zero_var_g), "reward_components": int(c_BK.shape[1])}
    return AdvantageResult(np.where(m, adv_B[:, None], 0.0), adv_B, None, metrics)


AdvantageEstimator = Callable[..., AdvantageResult]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": _grpo_entry,
    "dr_grpo": _dr_grpo_entry,
    "rloo": _rloo_entry,
    "reinforce_plus_plus": _reinforce_pp_entry,
    "gae": _gae_entry,
    "grpo_passk": _grpo_passk_entry,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline_entry,
    "gdpo": _gdpo_entry,
    "grpo_normalize_then_sum": _grpo_nts_entry,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look up `ADVANTAGE_ESTIMATORS[name]`; an unknown name raises ValueError listing the valid ones."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}") from None
