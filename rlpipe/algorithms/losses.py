"""Policy, value and entropy terms, per token (torch, float32).

Every policy loss in `POLICY_LOSSES` shares one signature:

    fn(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
       log_ratio_clamp=LOG_RATIO_CLAMP, **options) -> (loss_BT, stats)

with the loss's own options (`POLICY_LOSS_OPTIONS`: TRL's `ratio_cap` for ppo_clip, SAPO's two
temperatures) as further keywords.

`loss_BT` [B, T] float32 is the per-token *negative* objective (minimise it), exactly 0 at padding;
turn it into one number with `aggregation.aggregate_loss`. `stats` holds detached tensors, 0/False
at padding, with at least `ratio_BT`, `clipped_BT` and `dual_clipped_BT` so that
`policy_health_metrics` works for every loss.

Numerics: inputs are cast to float32; padded positions are replaced by 0 *before* any arithmetic
(torch.where), so NaN or huge values in padding cannot reach an output or a gradient. The log-ratio
is clamped before exp (`log_ratio_clamp`, default 20, the profile's `train.policy_log_ratio_clamp` /
`train.gspo_log_ratio_clamp`): per token to [-c, c] for the token losses, and from above only for
GSPO's sequence log-ratio (a very negative one underflows harmlessly to 0). The clamp is applied to a
tensor that carries the gradient, so beyond it the gradient is 0 and a ratio of e^1000 gives a finite
loss and gradient. `None` turns it off (TRL clamps nothing): a huge ratio then overflows to inf and
the train loop skips the step.
"""
from __future__ import annotations

from typing import Callable

import torch

from rlpipe.algorithms.kl import LOG_RATIO_CLAMP, kl_k3


def _mask(mask_BT: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask_BT.shape != shape:
        raise ValueError(f"mask_BT has shape {tuple(mask_BT.shape)}, expected {tuple(shape)}")
    return mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0


def _valid(x_BT: torch.Tensor, m_BT: torch.Tensor, name: str) -> torch.Tensor:
    """float32 copy with padding set to 0 (no gradient reaches the padded inputs)."""
    if x_BT.shape != m_BT.shape:
        raise ValueError(f"{name} has shape {tuple(x_BT.shape)}, mask_BT has {tuple(m_BT.shape)}")
    return torch.where(m_BT, x_BT.float(), 0.0)


def _check_clip(eps_low: float, eps_high: float, dual_clip_c: float | None, log_ratio_clamp: float | None) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None for off), got {dual_clip_c}")
    _check_log_ratio_clamp(log_ratio_clamp)


def _check_log_ratio_clamp(log_ratio_clamp: float | None) -> None:
    if log_ratio_clamp is not None and not log_ratio_clamp > 0:
        raise ValueError(f"log_ratio_clamp must be > 0 (or None for off), got {log_ratio_clamp}")


def _no_dual_clip(name: str, dual_clip_c: float | None) -> None:
    if dual_clip_c is not None:
        raise ValueError(f"{name} has no dual clip: pass dual_clip_c=None (train.dual_clip_c: null), got {dual_clip_c}")


def _clamp(x: torch.Tensor, bound: float | None, *, lower: bool = True) -> torch.Tensor:
    """x clamped to [-bound, bound] (or to at most bound when not `lower`); None = unchanged."""
    if bound is None:
        return x
    return x.clamp(-bound, bound) if lower else x.clamp(max=bound)


def _clipped_objective(ratio, adv, *, eps_low, eps_high, dual_clip_c, ratio_cap=None):
    """`J = min(min(r, cap) A, clip(r, 1-eps_low, 1+eps_high) A)`, then `max(J, c A)` where A < 0 (dual clip).

    Returns (J, clipped, dual_clipped); `clipped` marks where the clipped branch was strictly
    smaller, i.e. where no gradient flows through the ratio. `ratio_cap` (TRL's `delta`; None = off)
    caps the unclipped branch's ratio.
    """
    unclipped = (ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)) * adv
    clipped_value = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    objective = torch.minimum(unclipped, clipped_value)
    clipped = clipped_value < unclipped
    if dual_clip_c is None:
        return objective, clipped, torch.zeros_like(clipped)
    floor = dual_clip_c * adv
    dual_clipped = (adv < 0) & (floor > objective)
    return torch.where(dual_clipped, floor, objective), clipped, dual_clipped


def _per_sequence_mean(x_BT: torch.Tensor, m_BT: torch.Tensor) -> torch.Tensor:
    """Mean over the valid tokens of each row ([B, T] -> [B]); 0 for a row with none."""
    count_B = m_BT.sum(dim=1).clamp_min(1)
    return torch.where(m_BT, x_BT, 0.0).sum(dim=1) / count_B


def _token_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp):
    """`l_t = log pi_theta - log pi_old` per token, clamped to [-c, c] (padding 0)."""
    log_ratio = _valid(logprobs_BT, m, "logprobs_BT") - _valid(old_logprobs_BT, m, "old_logprobs_BT")
    return _clamp(log_ratio, log_ratio_clamp)


def _stats(ratio, clipped, dual_clipped, m, **extra) -> dict:
    return {"ratio_BT": torch.where(m, ratio, 0.0).detach(), "clipped_BT": clipped & m,
            "dual_clipped_BT": dual_clipped & m, **extra}


def ppo_clip_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
                  log_ratio_clamp=LOG_RATIO_CLAMP, ratio_cap=None):
    """PPO-clip per token, with clip-higher, optional dual clip and TRL's two-sided cap; returns (-J_BT, stats).

    `J_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)`, `r_t = pi_theta / pi_old`.
    eps_high > eps_low is DAPO's clip-higher (keeps low-probability tokens able to grow).
    `dual_clip_c` (> 1, or None = off): for A_t < 0, `J_t = max(J_t, c A_t)` bounds the loss of
    a huge ratio on a negative sample. `ratio_cap` (TRL's `delta`, INTELLECT-2's two-sided clip;
    > 1 or None = off) replaces r by min(r, delta) in the unclipped branch, bounding the same loss
    for every sign of A: with r e^2, A -1, delta 4 the loss is 4 with gradient 0 (7.389 without).
    Worked example: log pi_old -2.1, log pi_theta -1.8, eps 0.2, A 0.2 -> r 1.35 clipped to 1.2 ->
    J 0.24 -> loss -0.24, no gradient.

    Shapes: four [B, T] tensors -> loss_BT [B, T]; stats: ratio_BT, log_ratio_BT, clipped_BT,
    dual_clipped_BT. Reference: Schulman et al. 2017 (arXiv:1707.06347); Yu et al. 2025, DAPO
    (arXiv:2503.14476); Ye et al. 2020, dual-clip PPO (arXiv:1912.09729); Prime Intellect 2025,
    INTELLECT-2 (arXiv:2505.07291).
    """
    _check_clip(eps_low, eps_high, dual_clip_c, log_ratio_clamp)
    if ratio_cap is not None and not ratio_cap > 1.0:
        raise ValueError(f"ratio_cap must be > 1 (or None for off), got {ratio_cap}")
    m = _mask(mask_BT, logprobs_BT.shape)
    log_ratio = _token_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    adv = _valid(advantages_BT, m, "advantages_BT")
    objective, clipped, dual_clipped = _clipped_objective(
        ratio, adv, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c, ratio_cap=ratio_cap
    )
    loss_BT = torch.where(m, -objective, 0.0)
    return loss_BT, _stats(ratio, clipped, dual_clipped, m, log_ratio_BT=log_ratio.detach())


def _sequence_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp):
    """Mean token log-ratio of each sequence, log s_i ([B]), clamped from above at `log_ratio_clamp`."""
    log_ratio = _valid(logprobs_BT, m, "logprobs_BT") - _valid(old_logprobs_BT, m, "old_logprobs_BT")
    return _clamp(_per_sequence_mean(log_ratio, m), log_ratio_clamp, lower=False)


def gspo_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
              log_ratio_clamp=LOG_RATIO_CLAMP):
    """GSPO: one clipped term per sequence, with the geometric-mean ratio `s_i`.

    `s_i = exp(mean_t l_{i,t})` over valid tokens; `A_i` = mean of advantages_BT over the valid
    tokens (equal to the broadcast sequence advantage of GRPO-style estimators);
    `J_i = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)` (dual clip as in PPO if set).
    `-J_i` is written on every valid token of sequence i, so `aggregate_loss(...,
    mode="seq-mean-token-mean")` gives exactly GSPO's `-(1/G) sum_i J_i`; other modes weight
    sequences by their length. The published clip ranges are tiny (about 3e-4 / 4e-4).
    `log s_i` is clamped from above at `log_ratio_clamp` (gradient 0 beyond).

    Shapes: four [B, T] tensors -> loss_BT [B, T]; stats: ratio_BT (s_i broadcast), seq_ratio_B,
    clipped_BT, seq_clipped_B, dual_clipped_BT. Reference: Zheng et al. 2025, GSPO (arXiv:2507.18071).
    """
    _check_clip(eps_low, eps_high, dual_clip_c, log_ratio_clamp)
    m = _mask(mask_BT, logprobs_BT.shape)
    seq_ratio_B = torch.exp(_sequence_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp))
    seq_adv_B = _per_sequence_mean(_valid(advantages_BT, m, "advantages_BT"), m)
    objective_B, clipped_B, dual_B = _clipped_objective(
        seq_ratio_B, seq_adv_B, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )
    loss_BT = torch.where(m, -objective_B[:, None], 0.0)
    return loss_BT, _stats(seq_ratio_B[:, None].expand_as(m), clipped_B[:, None], dual_B[:, None], m,
                           seq_ratio_B=seq_ratio_B.detach(), seq_clipped_B=clipped_B)


def gspo_token_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
                    log_ratio_clamp=LOG_RATIO_CLAMP):
    """GSPO-token: `s_{i,t} = sg[s_i] * pi_theta(o_t) / sg[pi_theta(o_t)]`, clipped per token.

    Numerically `s_{i,t} = s_i`, so the clip decision is the sequence's, but each token carries its
    own advantage `A_{i,t}` and gradient `s_i * grad log pi_theta(o_t)`. With `A_{i,t} = A_i` and
    mode "seq-mean-token-mean" the gradient is exactly GSPO's:
    `(1/|o_i|) sum_t s_i A_i grad log pi(o_t) = grad (s_i A_i)` (tested with autograd).
    The combined log-ratio `log pi - sg[log pi] + sg[log s_i]` is clamped from above at
    `log_ratio_clamp`, as verl does (at 10): beyond it the value is capped AND the gradient is 0.
    Worked example (issue 16): old [-1, -1], log pi [11, 11], A -1, token-mean: log s 12 -> with a
    clamp of 10 loss e^10 = 22026.5 and gradient 0; with 20, loss e^12 = 162754.8 and gradient
    e^12 / 2 = 81377 per token.

    Shapes: four [B, T] tensors -> loss_BT [B, T]; stats as `gspo_loss`.
    Reference: Zheng et al. 2025, GSPO (arXiv:2507.18071), section 4.3.
    """
    _check_clip(eps_low, eps_high, dual_clip_c, log_ratio_clamp)
    m = _mask(mask_BT, logprobs_BT.shape)
    log_s_B = _sequence_log_ratio(logprobs_BT, old_logprobs_BT, m, None).detach()
    logprobs = _valid(logprobs_BT, m, "logprobs_BT")
    log_token_ratio = _clamp(logprobs - logprobs.detach() + log_s_B[:, None], log_ratio_clamp, lower=False)
    token_ratio = torch.exp(log_token_ratio)
    seq_ratio_B = torch.exp(_clamp(log_s_B, log_ratio_clamp, lower=False))
    adv = _valid(advantages_BT, m, "advantages_BT")
    objective, clipped, dual_clipped = _clipped_objective(
        token_ratio, adv, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )
    loss_BT = torch.where(m, -objective, 0.0)
    return loss_BT, _stats(seq_ratio_B[:, None].expand_as(m), clipped, dual_clipped, m, seq_ratio_B=seq_ratio_B,
                           seq_clipped_B=(clipped & m).any(dim=1))


def cispo_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
               log_ratio_clamp=LOG_RATIO_CLAMP):
    """CISPO: `-sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi_theta(o_t)` per token.

    Why: PPO's clip zeroes the gradient of every clipped token, and the rare tokens that matter
    for reflection ("wait", "however") are the ones clipped first; CISPO clips the importance
    weight instead and keeps every token's REINFORCE gradient `w_t A_t grad log pi_theta`.
    The loss value is that of the surrogate, not of PPO's objective. Frameworks differ on the
    bounds: verl (and MiniMax-M1) clip to [1 - eps_low, 1 + eps_high]; TRL's `loss_type: cispo`
    caps the weight at an absolute `epsilon_high` with no lower bound, i.e. eps_low 1 here and
    eps_high = TRL's epsilon_high - 1 (TRL's docs suggest epsilon_high 5: eps_high 4).
    Worked example: old -1, new -0.5, eps_high 0.2, A 2 -> r e^0.5 = 1.65 -> w 1.2 ->
    loss -1.2 * 2 * -0.5 = 1.2, gradient -2.4.

    Shapes: four [B, T] tensors -> loss_BT [B, T]; stats: ratio_BT, clipped_BT (w != r),
    dual_clipped_BT (always False). Reference: MiniMax 2025, MiniMax-M1 (arXiv:2506.13585).
    """
    if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
        raise ValueError(f"cispo needs 0 <= eps_low <= 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    _no_dual_clip("cispo", dual_clip_c)
    _check_log_ratio_clamp(log_ratio_clamp)
    m = _mask(mask_BT, logprobs_BT.shape)
    ratio = torch.exp(_token_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp)).detach()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    adv = _valid(advantages_BT, m, "advantages_BT")
    loss_BT = torch.where(m, -weight * adv * _valid(logprobs_BT, m, "logprobs_BT"), 0.0)
    return loss_BT, _stats(ratio, weight != ratio, torch.zeros_like(m), m, weight_BT=torch.where(m, weight, 0.0))


def sapo_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
              log_ratio_clamp=LOG_RATIO_CLAMP, tau_pos, tau_neg):
    """SAPO: a soft gate instead of the hard clip, `-f(r_t) A_t` with `f(r) = sigmoid(tau (r - 1)) * 4 / tau`.

    Why: the hard clip switches a token's gradient off at 1 +- eps; the gate's gradient
    `4 r sigmoid' (tau (r - 1))` is exactly PPO's (r = 1 gives 1) on-policy and fades smoothly as r
    leaves 1, faster for larger tau. `tau = tau_pos` where A > 0, else `tau_neg` (the paper and TRL:
    1.0 / 1.05, so negative tokens fade sooner). eps_low / eps_high are not used (no clip).
    Worked example: r = 1, tau 1, A 1 -> f = 2, loss -2, gradient -1 (PPO's); r = e^0.5 ->
    f = 4 sigmoid(0.6487) = 2.6269.

    Shapes: four [B, T] tensors -> loss_BT [B, T]; stats: ratio_BT, clipped_BT and dual_clipped_BT
    (always False). Reference: Qwen 2025, Soft Adaptive Policy Optimization (arXiv:2511.20347).
    """
    _no_dual_clip("sapo", dual_clip_c)
    _check_log_ratio_clamp(log_ratio_clamp)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    m = _mask(mask_BT, logprobs_BT.shape)
    ratio = torch.exp(_token_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp))
    adv = _valid(advantages_BT, m, "advantages_BT")
    tau = torch.where(adv > 0, float(tau_pos), float(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss_BT = torch.where(m, -gate * adv, 0.0)
    never = torch.zeros_like(m)
    return loss_BT, _stats(ratio, never, never, m)


def gmpo_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, eps_low, eps_high, dual_clip_c,
              log_ratio_clamp=LOG_RATIO_CLAMP, clip_sign="sequence", mean_mask_BT=None):
    """GMPO: the geometric mean of the token ratios, each clipped in log space, times the sequence advantage.

    `J_i = A_i * exp(mean_t s_t min(s_t l_t, s_t clip(l_t, -eps_low, eps_high)))`, `A_i` the mean of
    advantages_BT over the sequence's valid tokens. Why: the arithmetic mean of token ratios (GRPO) is
    pulled by outliers; the geometric mean is not, so GMPO can afford a wide clip (the paper: eps 0.4 in
    log space, i.e. ratios e^-0.4 .. e^0.4). `-J_i` is written on every valid token, so
    "seq-mean-token-mean" gives verl's `geo_mean` (a plain mean over sequences).
    `clip_sign` (the profile's train.gmpo_clip_sign): s_t = sgn(A_i), the side of the advantage that
    multiplies the mean ("sequence", rlpipe, TRL), or sgn(A_{i,t}) of each token ("token", verl's
    geo_mean; a token with A_{i,t} = 0 then adds log-ratio 0). They differ only when advantages vary
    along a row: l [0.5, 0.5], A [1, -0.5], eps 0.4 -> "sequence" J = 0.25 e^0.4 = 0.37296, loss gradient
    [0, 0]; "token" J = 0.25 e^0.45 = 0.39208, loss gradient [0, -0.196].
    `mean_mask_BT` (default mask_BT): the tokens the geometric mean averages over (TRL's 80/20 mask
    drops low-entropy tokens from it); a row with none keeps ratio 1, so J_i = A_i with no gradient.
    Worked example: l = [0.5, -0.1], eps 0.4, A +1 -> clipped l [0.4, -0.1] -> J = e^0.15 = 1.1618;
    A -1 -> [0.5, -0.1] -> J = -e^0.2 = -1.2214.

    Shapes: four [B, T] tensors (and mean_mask_BT [B, T]) -> loss_BT [B, T]; stats: ratio_BT (the
    sequence's clipped geometric mean, broadcast), seq_ratio_B, clipped_BT, dual_clipped_BT (False).
    Reference: Zhao et al. 2025, Geometric-Mean Policy Optimization (arXiv:2507.20673).
    """
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"gmpo needs eps_low, eps_high >= 0 (log-space clip), got {eps_low}, {eps_high}")
    if clip_sign not in ("sequence", "token"):
        raise ValueError(f"gmpo clip_sign must be 'sequence' or 'token', got {clip_sign!r}")
    _no_dual_clip("gmpo", dual_clip_c)
    _check_log_ratio_clamp(log_ratio_clamp)
    m = _mask(mask_BT, logprobs_BT.shape)
    in_mean = m if mean_mask_BT is None else _mask(mean_mask_BT, logprobs_BT.shape) & m
    log_ratio = _token_log_ratio(logprobs_BT, old_logprobs_BT, m, log_ratio_clamp)
    adv = _valid(advantages_BT, m, "advantages_BT")
    seq_adv_B = _per_sequence_mean(adv, m)
    sign = torch.sign(seq_adv_B)[:, None] if clip_sign == "sequence" else torch.sign(adv)
    clipped_log = log_ratio.clamp(-eps_low, eps_high)
    kept_log = sign * torch.minimum(sign * log_ratio, sign * clipped_log)
    seq_ratio_B = torch.exp(_per_sequence_mean(kept_log, in_mean))
    loss_BT = torch.where(m, -(seq_adv_B * seq_ratio_B)[:, None], 0.0)
    clipped = (sign * clipped_log < sign * log_ratio) & in_mean
    return loss_BT, _stats(seq_ratio_B[:, None].expand_as(m), clipped, torch.zeros_like(m), m,
                           seq_ratio_B=seq_ratio_B.detach())


PolicyLoss = Callable[..., tuple[torch.Tensor, dict]]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "gmpo": gmpo_loss,
}

# the options each loss takes beyond the shared keywords (keys of TrainConfig.policy_loss_options); gmpo's
# mean_mask_BT is a tensor the objective passes itself (train.entropy_mask_form token_set)
POLICY_LOSS_OPTIONS: dict[str, tuple[str, ...]] = {
    "ppo_clip": ("ratio_cap",),
    "gspo": (),
    "gspo_token": (),
    "cispo": (),
    "sapo": ("tau_pos", "tau_neg"),
    "gmpo": ("clip_sign",),
}


def get_policy_loss(name: str) -> PolicyLoss:
    """Look up `POLICY_LOSSES[name]`; an unknown name raises ValueError listing the valid ones."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}") from None


def entropy_from_logits(logits_NV: torch.Tensor) -> torch.Tensor:
    """Entropy `H = -sum_a pi(a) log pi(a)` of softmax(logits) at each position, float32.

    Why this form: `log_softmax` is stable for large logits, and terms with pi(a) = 0 (logits of
    -inf after top-k/top-p masking) are dropped *before* the product, so neither the value nor
    the gradient sees `0 * -inf`. Pass logits already divided by the sampling temperature.
    Shapes: [N, V] (or [..., V]) -> [N] (or [...]). The entropy bonus is `+ c_H * mean H`.
    """
    logp = torch.log_softmax(logits_NV.float(), dim=-1)
    p = torch.exp(logp)
    return -(p * torch.where(p > 0, logp, 0.0)).sum(dim=-1)


ENTROPY_MASK_FORMS: tuple[str, ...] = (
    "policy_term",  # the 80/20 mask multiplies the policy term; the entropy bonus covers every token (rlpipe)
    "token_set",  # low-entropy tokens leave the entropy bonus too, and GMPO's geometric mean (TRL)
)


def entropy_bonus_terms(entropy_BT: torch.Tensor, keep_BT: torch.Tensor | None, *, form: str) -> torch.Tensor:
    """The per-token entropy `H_t` that the bonus `- c_H * agg(H)` aggregates, under the 80/20 mask `keep_BT`.

    Why a choice: the 80/20 rule (train.top_entropy_quantile) is about which tokens carry the policy
    gradient; rlpipe keeps the bonus on every token ("policy_term"), TRL multiplies it by the same mask
    ("token_set", grpo_trainer's `effective_mask = mask * entropy_mask`). Both are then divided by the
    aggregation's normaliser of all valid tokens (TRL's default loss_type dapo divides by the batch's
    tokens too). Example: H [2, 1], keep [1, 0], token-mean, c_H 0.01 -> policy_term -0.01 * 3 / 2 =
    -0.015; token_set -0.01 * 2 / 2 = -0.010. `keep_BT` None (no mask) returns H unchanged.
    Shapes: [B, T] (keep 0/1 or bool) -> [B, T] float32.
    """
    if form not in ENTROPY_MASK_FORMS:
        raise ValueError(f"unknown entropy mask form {form!r}; valid: {list(ENTROPY_MASK_FORMS)}")
    entropy = entropy_BT.float()
    if keep_BT is None or form == "policy_term":
        return entropy
    return entropy * keep_BT.float()


def value_loss(values_BT, old_values_BT, returns_BT, mask_BT, *, clip_eps):
    """Clipped critic loss `0.5 * max((V - R)^2, (V_clip - R)^2)`, `V_clip = V_old + clip(V - V_old, +-eps)`.

    Why the max: like the policy clip, it stops one update from moving V far from the values that
    produced the advantages. `clip_eps=None` turns clipping off (plain `0.5 (V - R)^2`).
    Shapes: four [B, T] tensors -> loss_BT [B, T] float32, 0 at padding. Reference: the PPO
    implementation of Schulman et al. 2017; Ouyang et al. 2022.
    """
    m = _mask(mask_BT, values_BT.shape)
    v = _valid(values_BT, m, "values_BT")
    ret = _valid(returns_BT, m, "returns_BT")
    loss = (v - ret) ** 2
    if clip_eps is not None:
        if not clip_eps >= 0:
            raise ValueError(f"clip_eps must be >= 0 (or None for off), got {clip_eps}")
        old = _valid(old_values_BT, m, "old_values_BT")
        v_clip = old + (v - old).clamp(-clip_eps, clip_eps)
        loss = torch.maximum(loss, (v_clip - ret) ** 2)
    return torch.where(m, 0.5 * loss, 0.0)


@torch.no_grad()
def off_policy_sequence_mask(sampler_logprobs_BT, logprobs_BT, sequence_advantages_B, mask_BT, *, delta):
    """Which sequences to keep under DeepSeek-V3.2's off-policy sequence masking (keep_B bool).

    Drop sequence i when `A_i < 0` and `mean_t (log pi_sampler - log pi_theta) > delta`: negative
    samples that have drifted too far off-policy hurt more than they teach. Positive samples and
    sequences without valid tokens are always kept. No gradient.
    Shapes: [B, T], [B, T], [B], [B, T] -> [B] bool. Reference: DeepSeek-V3.2 technical report (2025).
    """
    m = _mask(mask_BT, logprobs_BT.shape)
    drift = _valid(sampler_logprobs_BT, m, "sampler_logprobs_BT") - _valid(logprobs_BT, m, "logprobs_BT")
    drift_B = _per_sequence_mean(drift, m)
    return ~((sequence_advantages_B.float() < 0) & (drift_B > delta))


@torch.no_grad()
def truncated_importance_weights(old_logprobs_BT, sampler_logprobs_BT, mask_BT, *, cap):
    """Token weights `min(pi_old / pi_sampler, C)` correcting the sampler/trainer mismatch (detached).

    Why: the sampler (vLLM) and the trainer give different numbers for the same weights; the
    rollouts come from pi_sampler, so the loss is re-weighted towards pi_old, truncated at C
    (~2) to bound the variance. Multiply the per-token loss by these weights.
    Shapes: [B, T] x3 -> weights_BT [B, T] float32, 0 at padding.
    Reference: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training".
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    m = _mask(mask_BT, old_logprobs_BT.shape)
    log_w = _valid(old_logprobs_BT, m, "old_logprobs_BT") - _valid(sampler_logprobs_BT, m, "sampler_logprobs_BT")
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp_max(cap)
    return torch.where(m, w, 0.0)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of x over the True positions of the bool mask, 0 for an empty mask; a 0-dim float32 tensor.

    Why not `x[mask].mean()`: boolean indexing has to read the count back to the host (a GPU sync);
    this stays on the device.
    """
    return torch.where(mask_BT, x_BT.float(), 0.0).sum() / mask_BT.sum().clamp_min(1)


@torch.no_grad()
def policy_health_tensors(logprobs_BT, old_logprobs_BT, mask_BT, stats) -> dict[str, torch.Tensor]:
    """`policy_health_metrics` as 0-dim tensors on the inputs' device: no host sync.

    Why: a training loop computes these for every micro-batch; reading each number back would stall
    the GPU that often. It keeps the tensors and reads them all at once with `health_to_host`.
    """
    m = _mask(mask_BT, logprobs_BT.shape)
    n = m.sum()
    k3 = kl_k3(_valid(old_logprobs_BT, m, "old_logprobs_BT"), _valid(logprobs_BT, m, "logprobs_BT"))
    ratio = stats["ratio_BT"].float()
    extreme = lambda fill, reduce: torch.where(n > 0, reduce(torch.where(m, ratio, fill)), 0.0)  # noqa: E731
    return {
        "approx_kl": masked_mean(k3, m),
        "clip_fraction": masked_mean(stats["clipped_BT"], m),
        "dual_clip_fraction": masked_mean(stats["dual_clipped_BT"], m),
        "ratio_mean": masked_mean(ratio, m),
        "ratio_min": extreme(float("inf"), torch.amin),
        "ratio_max": extreme(float("-inf"), torch.amax),
        "num_valid_tokens": n,
    }


def policy_health_metrics(logprobs_BT, old_logprobs_BT, mask_BT, stats) -> dict[str, float]:
    """Health signals over the valid tokens of one (micro-)batch, as python floats.

    approx_kl: mean of `r - 1 - log r` with `r = pi_theta / pi_old`, i.e. k3 estimating
    KL(pi_old || pi_theta) from pi_old's samples; clip_fraction (healthy ~0.1-0.3),
    dual_clip_fraction, ratio_mean/min/max (from `stats["ratio_BT"]`), num_valid_tokens (to
    combine micro-batches as a token-weighted mean). An empty mask gives 0s, not NaN.
    """
    return health_to_host([policy_health_tensors(logprobs_BT, old_logprobs_BT, mask_BT, stats)])[0]


def health_to_host(parts: list[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """Every 0-dim tensor in `parts` as a python number, read back in one device-to-host transfer.

    Values are exact: float32 and integer counts pass through float64 unchanged; an integer tensor
    (a count such as `num_valid_tokens`) comes back as an int.
    """
    where = [(i, key) for i, part in enumerate(parts) for key, v in part.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([parts[i][key].detach().to(torch.float64) for i, key in where]).tolist() if where else []
    out = [dict(part) for part in parts]
    for (i, key), value in zip(where, values):
        out[i][key] = value if parts[i][key].is_floating_point() else int(value)
    return out


def bradley_terry_loss(chosen_scores_B: torch.Tensor, rejected_scores_B: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry reward-model loss: mean over pairs of `-log sigmoid(r_chosen - r_rejected)`, a scalar.

    Why logsigmoid rather than log(sigmoid(.)): it stays finite for any margin (a margin of -100
    gives a loss of 100, not inf). Shapes: both [B], B >= 1. Reference: Bradley & Terry 1952;
    Ouyang et al. 2022 (arXiv:2203.02155), eq. 1.
    """
    return -torch.nn.functional.logsigmoid(chosen_scores_B - rejected_scores_B).mean()
