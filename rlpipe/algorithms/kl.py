"""Per-token KL estimators between the policy and the reference (torch, float32).

With `log rho = log pi_ref(o_t) - log pi_theta(o_t)` (samples o_t from the policy):
  k1 = -log rho              (unbiased for KL(pi_theta || pi_ref), can be negative)
  k2 = 0.5 * (log rho)^2     (biased, low variance)
  k3 = rho - 1 - log rho     (unbiased, non-negative, low variance; the GRPO default)
k3 is written with pi_ref / pi_theta; the swapped fraction found in some write-ups is a
different (wrong-direction) estimator.

Numerics (ALGORITHMS.md): inputs are cast to float32, `log rho` is clamped to [-20, 20] before
`exp` and the value to [-10, 10], as the open frameworks do, so that an extreme log-prob gives a
finite value and a finite (zero beyond the clamp) gradient.

These functions are elementwise and take no mask: a padded position only affects its own output.
Mask the result (e.g. with `aggregate_loss`) before it enters a sum. All return [B, T] float32.
Reference: J. Schulman, "Approximating KL Divergence" (2020); Shao et al. 2024 (arXiv:2402.03300).
"""
from __future__ import annotations

from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0


def _log_rho(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    log_rho_BT = ref_logprobs_BT.float() - logprobs_BT.float()
    return log_rho_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_k1(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k1 = -log rho = log pi_theta - log pi_ref. Unbiased for the KL value, but its gradient as a
    loss term is zero in expectation on-policy (E[grad log pi] = 0). Shapes: [B, T] -> [B, T]."""
    return (-_log_rho(logprobs_BT, ref_logprobs_BT)).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def kl_k2(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log rho)^2. Biased as a value; as an on-policy loss its gradient equals the
    gradient of KL(pi_theta || pi_ref). Shapes: [B, T] -> [B, T]."""
    return (0.5 * _log_rho(logprobs_BT, ref_logprobs_BT) ** 2).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def kl_k3(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k3 = rho - 1 - log rho with rho = pi_ref / pi_theta: unbiased and >= 0 (the GRPO default).
    Shapes: [B, T] -> [B, T]."""
    log_rho_BT = _log_rho(logprobs_BT, ref_logprobs_BT)
    return (torch.exp(log_rho_BT) - 1.0 - log_rho_BT).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> KLEstimator:
    """Look up `KL_ESTIMATORS[name]`; an unknown name raises ValueError listing the valid ones."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {sorted(KL_ESTIMATORS)}") from None


def importance_weighted_kl(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    *,
    estimator: str,
) -> torch.Tensor:
    """Unbiased KL with importance weight (DeepSeek-V3.2): `D_t = (pi_theta / pi_old) * k_t`.

    Why a weight: the tokens were sampled by pi_old, not pi_theta, so `mean(k_t)` estimates the
    KL of the wrong policy once pi_theta has moved; `E_old[(pi_theta/pi_old) k] = E_theta[k]`.

    Why the weight CARRIES gradient (it is not detached): the loss we want to minimise is
    `KL(theta) = E_theta[k_theta]`, and `grad E_theta[k] = E_theta[k * grad log pi_theta + grad k]`.
    Differentiating the weighted term gives `w * (k * grad log pi_theta + grad k)` with
    `w = pi_theta / pi_old`, whose expectation under pi_old is exactly that. For k3 it reduces to
    `w * (log pi_theta - log pi_ref) * grad log pi_theta`, an unbiased gradient of
    KL(pi_theta || pi_ref), even at the first step where w = 1 numerically. With the weight
    detached, k3 would instead give `E_theta[(1 - rho) grad log pi_theta] = -E_ref[grad log pi_theta]`,
    the gradient of the *other* KL, KL(pi_ref || pi_theta): the bias this correction removes.
    (With k2, whose mean is not the KL, the value and gradient stay those of E_theta[k2].)

    Shapes: three [B, T] log-prob tensors -> D_BT [B, T] float32. Log-ratio clamp [-20, 20] and
    value clamp [-10, 10] as for the plain estimators. Elementwise; mask before reducing.
    Reference: DeepSeek-AI 2025, DeepSeek-V3.2 technical report ("unbiased KL estimate").
    """
    k_BT = get_kl_estimator(estimator)(logprobs_BT, ref_logprobs_BT)
    log_w_BT = (logprobs_BT.float() - old_logprobs_BT.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_w_BT) * k_BT).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
