"""Per-token KL estimators between the policy and the reference (torch, float32).

With `log rho = log pi_ref(o_t) - log pi_theta(o_t)` (samples o_t from the policy):
  k1 = -log rho              (unbiased for KL(pi_theta || pi_ref), can be negative)
  k2 = 0.5 * (log rho)^2     (biased, low variance)
  k3 = rho - 1 - log rho     (unbiased, non-negative, low variance; the GRPO default)
k3 is written with pi_ref / pi_theta; the swapped fraction found in some write-ups is a
different (wrong-direction) estimator.

Numerics (ALGORITHMS.md): inputs are cast to float32, `log rho` is clamped to [-20, 20] before
`exp` and the value to [-10, 10], as the open frameworks do, so that an extreme log-prob gives a
finite value and a finite (zero beyond the clamp) gradient. Both clamps are keyword options
(`log_ratio_clamp`, `value_clamp`; None turns one off) because the frameworks differ here: verl
clamps k3 both ways, OpenRLHF only the value, TRL neither (see rlpipe.profiles). With the log-ratio
clamp off, a log-ratio beyond ~88 overflows `exp` in float32: the value clamp still gives a finite
value, but its gradient is NaN, as in the frameworks that do this.

These functions are elementwise and take no mask: a padded position only affects its own output.
Mask the result (e.g. with `aggregate_loss`) before it enters a sum. All return [B, T] float32.
Reference: J. Schulman, "Approximating KL Divergence" (2020); Shao et al. 2024 (arXiv:2402.03300).
"""
from __future__ import annotations

from typing import Protocol

import torch

LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0


def _clamp(x_BT: torch.Tensor, bound: float | None, name: str) -> torch.Tensor:
    """`x` clamped to [-bound, bound]; unchanged when bound is None (that clamp is off)."""
    if bound is None:
        return x_BT
    if not bound > 0:
        raise ValueError(f"{name} must be > 0 or None (off), got {bound!r}")
    return x_BT.clamp(-bound, bound)


def _log_rho(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, log_ratio_clamp: float | None) -> torch.Tensor:
    log_rho_BT = ref_logprobs_BT.float() - logprobs_BT.float()
    return _clamp(log_rho_BT, log_ratio_clamp, "log_ratio_clamp")


def kl_k1(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, *,
          log_ratio_clamp: float | None = LOG_RATIO_CLAMP, value_clamp: float | None = KL_VALUE_CLAMP) -> torch.Tensor:
    """k1 = -log rho = log pi_theta - log pi_ref. Unbiased for the KL value, but its gradient as a
    loss term is zero in expectation on-policy (E[grad log pi] = 0). Shapes: [B, T] -> [B, T]."""
    return _clamp(-_log_rho(logprobs_BT, ref_logprobs_BT, log_ratio_clamp), value_clamp, "value_clamp")


def kl_k2(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, *,
          log_ratio_clamp: float | None = LOG_RATIO_CLAMP, value_clamp: float | None = KL_VALUE_CLAMP) -> torch.Tensor:
    """k2 = 0.5 * (log rho)^2. Biased as a value; as an on-policy loss its gradient equals the
    gradient of KL(pi_theta || pi_ref). Shapes: [B, T] -> [B, T]."""
    return _clamp(0.5 * _log_rho(logprobs_BT, ref_logprobs_BT, log_ratio_clamp) ** 2, value_clamp, "value_clamp")


def kl_k3(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, *,
          log_ratio_clamp: float | None = LOG_RATIO_CLAMP, value_clamp: float | None = KL_VALUE_CLAMP) -> torch.Tensor:
    """k3 = rho - 1 - log rho with rho = pi_ref / pi_theta: unbiased and >= 0 (the GRPO default).
    Shapes: [B, T] -> [B, T]."""
    log_rho_BT = _log_rho(logprobs_BT, ref_logprobs_BT, log_ratio_clamp)
    return _clamp(torch.exp(log_rho_BT) - 1.0 - log_rho_BT, value_clamp, "value_clamp")


class KLEstimator(Protocol):
    """The shared signature of the `KL_ESTIMATORS` entries."""

    def __call__(self, logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, *,
                 log_ratio_clamp: float | None = ..., value_clamp: float | None = ...) -> torch.Tensor: ...

KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


KL_CLAMP_SCOPES: tuple[str, ...] = (
    "every_estimator",  # both clamps on k1, k2 and k3 (rlpipe; OpenRLHF's value clamp)
    "k3",  # the clamps on k3 only, k1 and k2 unclamped (verl's kl_penalty_forward)
)


def kl_clamps(estimator: str, *, scope: str, log_ratio_clamp: float | None,
              value_clamp: float | None) -> dict[str, float | None]:
    """The (log_ratio_clamp, value_clamp) keywords `estimator` gets under `scope`.

    Why: verl clamps only `low_var_kl` (k3) and leaves k1 (`kl`) and k2 (`mse`) raw, so with k1 or
    k2 its KL differs from a clamped one beyond |log rho| 20 or |KL| 10. Worked example: k1 at
    log rho = -30 is 30 under scope "k3" and 10 (the value clamp) under "every_estimator".
    """
    if scope not in KL_CLAMP_SCOPES:
        raise ValueError(f"unknown KL clamp scope {scope!r}; valid: {list(KL_CLAMP_SCOPES)}")
    if scope == "k3" and estimator != "k3":
        return {"log_ratio_clamp": None, "value_clamp": None}
    return {"log_ratio_clamp": log_ratio_clamp, "value_clamp": value_clamp}


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
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
    value_clamp: float | None = KL_VALUE_CLAMP,
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

    Shapes: three [B, T] log-prob tensors -> D_BT [B, T] float32. `log_ratio_clamp` bounds both
    log-ratios (of k and of the weight), `value_clamp` both k and the product, as for the plain
    estimators (defaults [-20, 20] and [-10, 10]; None = off). Elementwise; mask before reducing.
    Reference: DeepSeek-AI 2025, DeepSeek-V3.2 technical report ("unbiased KL estimate").
    """
    k_BT = get_kl_estimator(estimator)(logprobs_BT, ref_logprobs_BT, log_ratio_clamp=log_ratio_clamp,
                                       value_clamp=value_clamp)
    log_w_BT = _clamp(logprobs_BT.float() - old_logprobs_BT.float(), log_ratio_clamp, "log_ratio_clamp")
    return _clamp(torch.exp(log_w_BT) * k_BT, value_clamp, "value_clamp")
