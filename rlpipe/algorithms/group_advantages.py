"""More group-baseline estimators (numpy, float64): pass@k, REINFORCE++-baseline, multi-reward normalisation,
and unscorable (NaN) rewards.

They build on the group statistics of `rlpipe.algorithms.advantages` (same conventions: `B` sequences,
integer group ids in any order, `mask_BT` of valid completion tokens, padding exactly 0 in every
output). The registry (`rlpipe.algorithms.estimators.ADVANTAGE_ESTIMATORS`) reaches them under "grpo_passk",
"reinforce_plus_plus_baseline", "gdpo" and "grpo_normalize_then_sum".
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rlpipe.algorithms.advantages import (GRPO_STD_MODES, STD_DDOF, as_bool_mask, as_rewards, check_singleton_groups,
                                          group_ids, group_metrics, group_stats, grpo_advantages, whiten)


def grpo_passk_advantages(rewards_B, group_index_B, *, std_mode: str, eps: float) -> tuple[np.ndarray, dict]:
    """GRPO for pass@k: only the best sample of each group learns, `A_best = (R_max - R_2nd) / (std_g + eps)`.

    Why: pass@k rewards a group for its best answer, so the policy gradient of the pass@k objective
    credits the best sample with its margin over the runner-up and leaves the others at 0 (verl's
    `grpo_passk`). Ties for the best give a margin of 0, so which of them is "best" does not matter.
    A group of one (verl raises) and a zero-variance group get 0 and are counted in the metrics.
    Worked example: group [1, 0, 0.5, 0], sample std 0.4787 -> [0.5 / 0.4787, 0, 0, 0] = [1.0445, 0, 0, 0].

    Shapes: rewards_B [B], group_index_B [B] ints -> (advantages_B [B] float64, metrics).
    Reference: Chen et al. 2025, Pass@k Training (arXiv:2503.19595); verl `compute_grpo_passk_outcome_advantage`.
    """
    if std_mode not in STD_DDOF:
        raise ValueError(f"std_mode must be one of {GRPO_STD_MODES}, got {std_mode!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r_B = as_rewards(rewards_B)
    inv_B, size_g, mean_g, singleton_g, zero_var_g = group_stats(r_B, group_index_B)
    adv_B = np.zeros_like(r_B)
    learns_g = ~(singleton_g | zero_var_g)
    if learns_g.any():
        order = np.lexsort((-r_B, inv_B))  # by group, then reward descending; stable: tied best -> the first row
        start_g = np.searchsorted(inv_B[order], np.arange(size_g.shape[0]))
        best_g, second_g = order[start_g[learns_g]], order[start_g[learns_g] + 1]
        dev_B = r_B - mean_g[inv_B]
        sq_g = np.bincount(inv_B, weights=dev_B**2, minlength=size_g.shape[0])
        std_g = np.sqrt(sq_g / np.maximum(size_g - STD_DDOF[std_mode], 1))
        adv_B[best_g] = (r_B[best_g] - r_B[second_g]) / (std_g[learns_g] + eps)
    return adv_B, group_metrics(size_g, singleton_g, zero_var_g)


def reinforce_plus_plus_baseline_advantages(rewards_B, group_index_B, mask_BT, *, singleton_groups: str,
                                            whiten_form: str, eps: float) -> tuple[np.ndarray, dict]:
    """REINFORCE++-baseline: subtract the group mean, broadcast to the tokens, whiten over the batch's tokens.

    Why: the group mean removes each prompt's difficulty (as in GRPO), and whitening over all valid
    tokens of the batch (instead of dividing by each group's std) keeps prompts on one scale, which
    is more stable for small groups. Singleton groups follow `singleton_groups` ("zero": A = 0;
    "uncentered": verl's mean 0, so A = R) before whitening; `whiten_form` and `eps` are `whiten`'s.
    The KL penalty is not in the reward here: put it in the loss (`train.kl_beta`).
    Worked example: rewards [1, 0 | 1], groups of 2 and 1, lengths [2, 1, 1] -> centred [0.5, -0.5, 0]
    -> tokens [0.5, 0.5, -0.5, 0]: mean 0.125, Bessel var 0.6875 / 3 -> "unbiased_rsqrt" (eps 1e-8)
    gives (0.5 - 0.125) / 0.4787 = 0.7833 on row 0's tokens.

    Shapes: rewards_B [B], group_index_B [B], mask_BT [B, T] -> (token_advantages_BT [B, T] float64,
    0 at padding; metrics). Reference: Hu 2025, REINFORCE++ (arXiv:2501.03262).
    """
    m = as_bool_mask(mask_BT)
    centred_B, metrics = baseline_centred_rewards(rewards_B, group_index_B, singleton_groups=singleton_groups)
    if m.shape[0] != centred_B.shape[0]:
        raise ValueError(f"mask_BT has {m.shape[0]} rows, rewards_B has {centred_B.shape[0]}")
    return whiten(np.where(m, centred_B[:, None], 0.0), m, form=whiten_form, eps=eps), metrics


def baseline_centred_rewards(rewards_B, group_index_B, *, singleton_groups: str) -> tuple[np.ndarray, dict]:
    """REINFORCE++-baseline's sequence part: `R - mean_g R` (singletons per `singleton_groups`, zero-variance
    groups exactly 0), before it is broadcast to the tokens and whitened. Shapes: [B] -> ([B], metrics)."""
    check_singleton_groups(singleton_groups)
    r_B = as_rewards(rewards_B)
    inv_B, size_g, mean_g, singleton_g, zero_var_g = group_stats(r_B, group_index_B)
    centred_B = r_B - mean_g[inv_B]
    alone_B = singleton_g[inv_B]
    centred_B[alone_B] = r_B[alone_B] if singleton_groups == "uncentered" else 0.0
    centred_B[zero_var_g[inv_B]] = 0.0  # exactly 0, not the float residue of mean - R
    return centred_B, group_metrics(size_g, singleton_g, zero_var_g)


def _nan_group_zscore(x_B, inv_B, num_groups, *, ddof: int, eps: float) -> np.ndarray:
    """(x - nanmean_g) / (nanstd_g + eps) per group, NaN rows -> NaN; a group with fewer than ddof + 1
    finite values gets std 0 (so a single finite value gives 0, as TRL's 0 / 1e-4)."""
    finite_B = np.isfinite(x_B)
    x0_B = np.where(finite_B, x_B, 0.0)
    n_g = np.bincount(inv_B, weights=finite_B.astype(float), minlength=num_groups)
    mean_g = np.bincount(inv_B, weights=x0_B, minlength=num_groups) / np.maximum(n_g, 1)
    dev_B = np.where(finite_B, x_B - mean_g[inv_B], 0.0)
    sq_g = np.bincount(inv_B, weights=dev_B**2, minlength=num_groups)
    std_g = np.where(n_g > ddof, np.sqrt(sq_g / np.maximum(n_g - ddof, 1)), 0.0)
    scale_B = std_g[inv_B] + eps
    # a zero scale (all equal, eps 0) has deviations of 0: the z-score is 0, not 0 / 0
    return np.where(finite_B, dev_B / np.where(scale_B > 0, scale_B, 1.0), np.nan)


def normalize_then_sum(component_rewards_BK, group_index_B, *, weights_K, std_mode: str,
                       eps: float) -> np.ndarray:
    """`s_i = sum_k w_k (R_ik - mean_g R_k) / (std_g R_k + eps)`: each reward component z-scored in its group.

    Why: summing first lets the component with the widest spread drown the others (a format reward of
    0/1 next to a length reward of 0..0.1); normalising each one first gives every component its own
    say (GDPO; TRL's `multi_objective_aggregation: normalize_then_sum`). NaN components (a reward
    that could not be scored) are left out of their group's statistics and contribute 0, as TRL's
    `nanmean`/`nanstd` and `nansum` do; a row whose components are all NaN gets NaN.
    Worked example: components [[1, 0], [0, 0]] in one group, weights [1, 1], sample std, eps 0 ->
    [[+0.7071, 0], [-0.7071, 0]] -> s = [0.7071, -0.7071] (the all-equal component adds 0).

    Shapes: component_rewards_BK [B, K], group_index_B [B], weights_K [K] -> s_B [B] float64.
    Reference: Liu et al. 2026, GDPO (arXiv:2601.05242).
    """
    if std_mode not in STD_DDOF:
        raise ValueError(f"std_mode must be one of {GRPO_STD_MODES}, got {std_mode!r}")
    c_BK = np.asarray(component_rewards_BK, dtype=np.float64)
    w_K = np.asarray(weights_K, dtype=np.float64)
    if c_BK.ndim != 2 or w_K.shape != (c_BK.shape[1],):
        raise ValueError(f"component_rewards_BK must be [B, K] and weights_K [K], got {c_BK.shape}, {w_K.shape}")
    if np.isinf(c_BK).any():
        raise ValueError("component_rewards_BK contains inf")
    inv_B, size_g = group_ids(group_index_B, c_BK.shape[0])
    z_BK = np.stack([_nan_group_zscore(c_BK[:, k], inv_B, size_g.shape[0], ddof=STD_DDOF[std_mode], eps=eps)
                     for k in range(c_BK.shape[1])], axis=1) if c_BK.shape[0] else c_BK
    s_B = np.nansum(z_BK * w_K[None, :], axis=1)
    s_B[np.isnan(c_BK).all(axis=1)] = np.nan
    return s_B


def sequence_zscore(x_B, *, std_mode: str, eps: float) -> np.ndarray:
    """`(x - mean) / (std + eps)` over the finite entries of `x` (NaN stays NaN): TRL's batch normalisation
    of the summed components. Shapes: [B] -> [B] float64."""
    x = np.asarray(x_B, dtype=np.float64)
    finite = np.isfinite(x)
    n = int(finite.sum())
    if n <= STD_DDOF[std_mode]:
        return np.where(finite, 0.0, np.nan)
    mean = x[finite].mean()
    std = float(np.std(x[finite], ddof=STD_DDOF[std_mode]))
    return np.where(finite, (x - mean) / (std + eps), np.nan) if std + eps > 0 else np.where(finite, 0.0, np.nan)


def exclude_unscorable(estimator: Callable[..., tuple[np.ndarray, dict]], rewards_B, group_index_B,
                       **options) -> tuple[np.ndarray, dict]:
    """Run a group estimator on the rows whose reward is a number; a NaN row gets advantage 0.

    Why (TRL's handling of a completion no reward function could score): a NaN reward must neither
    move its group's mean and std (it is left out of them) nor push the policy (its advantage is 0),
    while the row stays in the loss's normalisers like any other. Metrics gain `unscorable`, the
    number of NaN rows. Worked example: GRPO on [1, NaN, 0] in one group -> [+0.7071, 0, -0.7071]
    (sample std of [1, 0], eps 0), not NaN everywhere.

    Shapes: rewards_B [B] (NaN allowed, inf not), group_index_B [B] -> (advantages_B [B], metrics).
    """
    r_B = np.asarray(rewards_B, dtype=np.float64)
    g_B = np.asarray(group_index_B)
    if np.isinf(r_B).any():
        raise ValueError("rewards_B contains inf")
    keep_B = ~np.isnan(r_B)
    adv_B = np.zeros(r_B.shape, dtype=np.float64)
    adv_kept, metrics = estimator(r_B[keep_B], g_B[keep_B], **options)
    adv_B[keep_B] = adv_kept
    return adv_B, {**metrics, "unscorable": int((~keep_B).sum())}


def gdpo_advantages(component_rewards_BK, group_index_B, mask_BT, *, weights_K, std_mode: str, eps: float,
                    singleton_groups: str, whiten_form: str, whiten_eps: float) -> np.ndarray:
    """verl's GDPO: per-component GRPO advantages, weighted sum, then whitened over the batch's tokens.

    Each component is one `grpo_advantages` (with `std_mode`, `eps`, `singleton_groups`); the weighted
    sum is broadcast to the tokens and whitened (`whiten_form`, `whiten_eps`; verl: "unbiased_rsqrt",
    1e-8). Components must be finite here (verl has no NaN handling).
    Shapes: component_rewards_BK [B, K], group_index_B [B], mask_BT [B, T] -> token_advantages_BT [B, T].
    Reference: Liu et al. 2026, GDPO (arXiv:2601.05242); verl `compute_gdpo_outcome_advantage`.
    """
    m = as_bool_mask(mask_BT)
    total_B = gdpo_weighted_sum(component_rewards_BK, group_index_B, weights_K=weights_K, std_mode=std_mode, eps=eps,
                                singleton_groups=singleton_groups)
    return whiten(np.where(m, total_B[:, None], 0.0), m, form=whiten_form, eps=whiten_eps)


def gdpo_weighted_sum(component_rewards_BK, group_index_B, *, weights_K, std_mode: str, eps: float,
                      singleton_groups: str) -> np.ndarray:
    """GDPO's sequence part: `sum_k w_k GRPO_k(R_k)`, before it is broadcast to the tokens and whitened.
    Shapes: component_rewards_BK [B, K], group_index_B [B], weights_K [K] -> [B] float64."""
    c_BK = np.asarray(component_rewards_BK, dtype=np.float64)
    w_K = np.asarray(weights_K, dtype=np.float64)
    if c_BK.ndim != 2 or w_K.shape != (c_BK.shape[1],):
        raise ValueError(f"component_rewards_BK must be [B, K] and weights_K [K], got {c_BK.shape}, {w_K.shape}")
    total_B = np.zeros(c_BK.shape[0])
    for k in range(c_BK.shape[1]):
        adv_B, _ = grpo_advantages(c_BK[:, k], group_index_B, std_mode=std_mode, eps=eps,
                                   singleton_groups=singleton_groups, std_scope="group")
        total_B += w_K[k] * adv_B
    return total_B
