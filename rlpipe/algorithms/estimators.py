"""The advantage estimators' registry: one keyword-only signature for every estimator, by name.

Why a module of its own: the estimators live in two modules (`advantages`, and `group_advantages`,
which builds on the first one's group statistics); the registry needs both, so it sits above them and
neither imports it. The advantage stage looks estimators up here by the name params.yaml gives.

Token inputs and outputs are flat (`rlpipe.algorithms.ragged`): one entry per completion token, rows
one after another as ``layout`` says, so memory follows the tokens, not rows x the longest completion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from rlpipe.algorithms import ragged
from rlpipe.algorithms.advantages import (as_rewards, dr_grpo_advantages, group_metrics, group_stats, grpo_advantages,
                                          rloo_advantages)
from rlpipe.algorithms.group_advantages import (baseline_centred_rewards, gdpo_weighted_sum, grpo_passk_advantages,
                                                normalize_then_sum, sequence_zscore)
from rlpipe.algorithms.ragged import Layout


@dataclass(frozen=True)
class AdvantageResult:
    """What every entry of `ADVANTAGE_ESTIMATORS` returns.

    token_advantages_N: [N] float64, one per token of the layout, 0 outside the mask (sequence
    estimators broadcast A_i); sequence_advantages_B: [B] for sequence estimators, else None;
    returns_N: critic targets [N] for "gae", else None; metrics: python numbers.

    A sequence estimator's token advantages are kept as (A_i, layout, mask) and spread on demand:
    `token_advantages_as(np.float32)` builds the stored column without a float64 copy of every token.
    """

    sequence_advantages_B: np.ndarray | None
    returns_N: np.ndarray | None
    metrics: dict
    tokens_N: np.ndarray | None = None  # a token estimator's advantages
    spread_over: tuple[Layout, np.ndarray] | None = None  # a sequence estimator's (layout, mask)

    @property
    def token_advantages_N(self) -> np.ndarray:
        return self.token_advantages_as(np.float64)

    def token_advantages_as(self, dtype) -> np.ndarray:
        """The token advantages in ``dtype``: the same values as `token_advantages_N` cast, A_i cast first."""
        if self.tokens_N is not None:
            return self.tokens_N.astype(dtype, copy=False)
        layout, mask = self.spread_over
        out = layout.broadcast(self.sequence_advantages_B.astype(dtype))
        out[~mask] = 0
        return out


def _spread_result(adv_B: np.ndarray, m: np.ndarray, layout: Layout, metrics: dict) -> AdvantageResult:
    return AdvantageResult(adv_B, None, metrics, spread_over=(layout, m))


def _tokens_result(adv_N: np.ndarray, seq_B: np.ndarray | None, returns_N: np.ndarray | None,
                   metrics: dict) -> AdvantageResult:
    return AdvantageResult(seq_B, returns_N, metrics, tokens_N=adv_N)


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


def _mask(name: str, layout: Layout | None, mask_N, rows: int) -> np.ndarray:
    _need(name, layout=layout, mask_N=mask_N)
    if layout.num_rows != rows:
        raise ValueError(f"the layout has {layout.num_rows} rows, rewards_B has {rows}")
    return ragged.check_mask(mask_N, layout.num_tokens)


def _spread(adv_B: np.ndarray, m: np.ndarray, layout: Layout) -> np.ndarray:
    """A_i at each of row i's tokens in the mask, 0 elsewhere (in place: one array of N floats)."""
    out = layout.broadcast(np.asarray(adv_B, dtype=np.float64))
    out[~m] = 0.0
    return out


def _broadcast(name, fn, rewards_B, group_index_B, layout, mask_N, kwargs) -> AdvantageResult:
    _need(name, rewards_B=rewards_B, group_index_B=group_index_B)
    adv_B, metrics = fn(rewards_B, group_index_B, **kwargs)
    m = _mask(name, layout, mask_N, adv_B.shape[0])
    return _spread_result(adv_B, m, layout, metrics)


def _grpo_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                options) -> AdvantageResult:
    o = _options("grpo", options)
    return _broadcast("grpo", grpo_advantages, rewards_B, group_index_B, layout, mask_N, dict(o))


def _dr_grpo_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                   options) -> AdvantageResult:
    o = _options("dr_grpo", options)
    return _broadcast("dr_grpo", dr_grpo_advantages, rewards_B, group_index_B, layout, mask_N, dict(o))


def _rloo_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                options) -> AdvantageResult:
    _options("rloo", options)
    return _broadcast("rloo", rloo_advantages, rewards_B, group_index_B, layout, mask_N, {})


def _token_mask(name: str, layout: Layout | None, mask_N) -> np.ndarray:
    _need(name, layout=layout, mask_N=mask_N)
    return ragged.check_mask(mask_N, layout.num_tokens)


def _reinforce_pp_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                        options) -> AdvantageResult:
    o = _options("reinforce_plus_plus", options)
    _need("reinforce_plus_plus", token_rewards_N=token_rewards_N)
    m = _token_mask("reinforce_plus_plus", layout, mask_N)
    returns_N = ragged.reward_to_go(token_rewards_N, m, layout)
    adv_N = ragged.whiten(returns_N, m, form=o["whiten_form"], eps=o["whiten_eps"])
    return _tokens_result(adv_N, None, None, {"num_valid_tokens": int(m.sum())})


def _gae_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
               options) -> AdvantageResult:
    """GAE, then (``whiten``) advantages z-scored over the batch's valid tokens; returns from the raw A."""
    o = _options("gae", options)
    _need("gae", token_rewards_N=token_rewards_N, values_N=values_N)
    m = _token_mask("gae", layout, mask_N)
    raw_N, returns_N = ragged.gae(token_rewards_N, values_N, m, layout, gamma=o["gamma"], lam=o["lam"])
    n = int(m.sum())
    metrics = {
        "num_valid_tokens": n,
        "raw_advantage_mean": float(ragged.valid_mean(raw_N, m, n)) if n else 0.0,
        "return_mean": float(ragged.valid_mean(returns_N, m, n)) if n else 0.0,
    }
    adv_N = ragged.whiten(raw_N, m, form=o["whiten_form"], eps=o["whiten_eps"]) if o["whiten"] else raw_N
    return _tokens_result(adv_N, None, returns_N, metrics)


def _grpo_passk_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                      options) -> AdvantageResult:
    o = _options("grpo_passk", options)
    return _broadcast("grpo_passk", grpo_passk_advantages, rewards_B, group_index_B, layout, mask_N, dict(o))


def _sequence_result(adv_N: np.ndarray, m: np.ndarray, layout: Layout, metrics: dict) -> AdvantageResult:
    """A token result whose tokens share their sequence's value (a whitened sequence advantage): A_i is
    that value (0 for a row without valid tokens), so the off-policy mask can read its sign."""
    first_B = ragged.first_valid_token(m, layout)
    seq_B = np.where(first_B >= 0, adv_N[np.maximum(first_B, 0)] if adv_N.size else 0.0, 0.0)
    return _tokens_result(adv_N, seq_B, None, metrics)


def _reinforce_pp_baseline_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N,
                                 component_rewards_BK, options) -> AdvantageResult:
    o = _options("reinforce_plus_plus_baseline", options)
    _need("reinforce_plus_plus_baseline", rewards_B=rewards_B, group_index_B=group_index_B)
    centred_B, metrics = baseline_centred_rewards(rewards_B, group_index_B, singleton_groups=o["singleton_groups"])
    m = _mask("reinforce_plus_plus_baseline", layout, mask_N, centred_B.shape[0])
    adv_N = ragged.whiten(_spread(centred_B, m, layout), m, form=o["whiten_form"], eps=o["whiten_eps"])
    return _sequence_result(adv_N, m, layout, metrics)


def _components(name, component_rewards_BK, rewards_B, weights) -> tuple[np.ndarray, np.ndarray]:
    _need(name, component_rewards_BK=component_rewards_BK, rewards_B=rewards_B)
    c_BK = np.asarray(component_rewards_BK, dtype=np.float64)
    if c_BK.ndim != 2 or c_BK.shape[0] != np.asarray(rewards_B).shape[0]:
        raise ValueError(f"component_rewards_BK must be [B, K] with B = {np.asarray(rewards_B).shape[0]}, "
                         f"got {c_BK.shape}")
    return c_BK, np.asarray(weights, dtype=np.float64)


def _gdpo_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                options) -> AdvantageResult:
    o = _options("gdpo", options)
    _need("gdpo", group_index_B=group_index_B)
    c_BK, w_K = _components("gdpo", component_rewards_BK, rewards_B, o["reward_weights"])
    m = _mask("gdpo", layout, mask_N, c_BK.shape[0])
    total_B = gdpo_weighted_sum(c_BK, group_index_B, weights_K=w_K, std_mode=o["std_mode"], eps=o["eps"],
                                singleton_groups=o["singleton_groups"])
    adv_N = ragged.whiten(_spread(total_B, m, layout), m, form=o["whiten_form"], eps=o["whiten_eps"])
    _, size_g, _, singleton_g, zero_var_g = group_stats(as_rewards(rewards_B), group_index_B)
    return _sequence_result(adv_N, m, layout, {**group_metrics(size_g, singleton_g, zero_var_g),
                                               "reward_components": int(c_BK.shape[1])})


def _grpo_nts_entry(*, rewards_B, group_index_B, layout, mask_N, token_rewards_N, values_N, component_rewards_BK,
                    options) -> AdvantageResult:
    o = _options("grpo_normalize_then_sum", options)
    _need("grpo_normalize_then_sum", group_index_B=group_index_B)
    c_BK, w_K = _components("grpo_normalize_then_sum", component_rewards_BK, rewards_B, o["reward_weights"])
    summed_B = normalize_then_sum(c_BK, group_index_B, weights_K=w_K, std_mode=o["std_mode"], eps=o["eps"])
    adv_B = np.nan_to_num(sequence_zscore(summed_B, std_mode=o["std_mode"], eps=o["eps"]), nan=0.0)
    m = _mask("grpo_normalize_then_sum", layout, mask_N, adv_B.shape[0])
    _, size_g, _, singleton_g, zero_var_g = group_stats(as_rewards(rewards_B), group_index_B)
    metrics = {**group_metrics(size_g, singleton_g, zero_var_g), "reward_components": int(c_BK.shape[1])}
    return _spread_result(adv_B, m, layout, metrics)


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
