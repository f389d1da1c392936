"""Which tokens a policy loss trains on, decided from per-token statistics (numpy, no torch).

`high_entropy_token_mask`: the "80/20" rule. Only the minority of tokens where the policy is
uncertain (forks in the reasoning) carry most of the useful policy gradient, so training on the
top-rho fraction by entropy and masking the rest does as well or better with rho = 0.2.
"""
from __future__ import annotations

import numpy as np


def high_entropy_threshold(entropy_N, *, top_quantile: float) -> float:
    """The entropy at or above which a token is in the top `top_quantile` fraction: quantile(H, 1 - rho).

    Linear interpolation between order statistics (numpy's and torch.quantile's default, as TRL uses).
    `top_quantile` is rho in (0, 1]; 1 keeps every token (the threshold is the minimum). No tokens -> +inf.
    Worked example: H = [0.1, 0.4, 0.2, 0.9, 0.5], rho 0.4 -> quantile 0.6 of the sorted
    [0.1, 0.2, 0.4, 0.5, 0.9] at position 2.4 -> 0.4 + 0.4 * (0.5 - 0.4) = 0.44: tokens 0.5 and 0.9 are kept.
    """
    if not 0.0 < top_quantile <= 1.0:
        raise ValueError(f"top_quantile must be in (0, 1], got {top_quantile}")
    h = np.asarray(entropy_N, dtype=np.float64).reshape(-1)
    if h.size == 0:
        return float("inf")
    return float(np.quantile(h, 1.0 - top_quantile))


def high_entropy_token_mask(entropy_BT, mask_BT, *, top_quantile: float) -> np.ndarray:
    """Valid tokens whose entropy is at least the `high_entropy_threshold` of all valid tokens (bool [B, T]).

    Why over the whole batch, once: the threshold is then a property of the data, not of how a step
    was cut into micro-batches. rlpipe takes the entropies of pi_old (computed once per iteration
    with the old log-probs); TRL takes the current policy's, per micro-batch gathered over processes.
    Shapes: entropy_BT, mask_BT [B, T] -> keep_BT [B, T] bool, False at padding.
    Reference: Wang et al. 2025, Beyond the 80/20 Rule (arXiv:2506.01939).
    """
    h = np.asarray(entropy_BT, dtype=np.float64)
    m = np.asarray(mask_BT, dtype=bool)
    if h.shape != m.shape:
        raise ValueError(f"entropy_BT has shape {h.shape}, mask_BT has {m.shape}")
    threshold = high_entropy_threshold(h[m], top_quantile=top_quantile)
    return m & (np.where(m, h, -np.inf) >= threshold)
