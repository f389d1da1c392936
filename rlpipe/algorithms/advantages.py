"""Advantage estimators and per-token rewards (numpy, float64).

Why numpy and not torch: the advantage stage reads a Parquet file of rewards and writes
advantages; importing torch would triple its start-up time for arithmetic on a few thousand
numbers. Everything here is float64 so that the stored advantages do not depend on the device.

Conventions (see ALGORITHMS.md): `B` sequences, `T` padded completion tokens; `mask_BT` (bool or
0/1) marks valid completion tokens. Padded positions never enter a sum, a mean or a statistic, and
are exactly 0 in every output (whatever the input held there, NaN included).

Every estimator is also reachable through `rlpipe.algorithms.estimators.ADVANTAGE_ESTIMATORS`, whose
entries share one keyword-only signature and return an `AdvantageResult`. The group helpers here
(`group_ids`, `group_stats`, `group_metrics`, ...) are public because `group_advantages` builds on them.
"""
from __future__ import annotations

import numpy as np

from rlpipe.algorithms import ragged

GRPO_STD_MODES = ("sample", "population")
STD_DDOF = {"sample": 1, "population": 0}
SINGLETON_GROUPS = (
    "zero",  # a group of one has no baseline: A = 0 (rlpipe, TRL and OpenRLHF, which need G > 1)
    "uncentered",  # verl: mean 0 and std 1 for a group of one, so GRPO gives R / (1 + eps), Dr.GRPO R
)


def check_singleton_groups(singleton_groups: str) -> None:
    if singleton_groups not in SINGLETON_GROUPS:
        raise ValueError(f"singleton_groups must be one of {SINGLETON_GROUPS}, got {singleton_groups!r}")


# --------------------------------------------------------------------------------------------
# input checks


def as_rewards(rewards_B) -> np.ndarray:
    r_B = np.asarray(rewards_B, dtype=np.float64)
    if r_B.ndim != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {r_B.shape}")
    if not np.all(np.isfinite(r_B)):
        raise ValueError("rewards_B contains NaN or inf")
    return r_B


def group_ids(group_index_B, num_sequences: int) -> tuple[np.ndarray, np.ndarray]:
    """Map arbitrary integer group ids to 0..num_groups-1; return (inverse_B, group_size_g)."""
    g_B = np.asarray(group_index_B)
    if g_B.shape != (num_sequences,):
        raise ValueError(f"group_index_B must have shape ({num_sequences},), got {g_B.shape}")
    if num_sequences and not np.issubdtype(g_B.dtype, np.integer):
        raise ValueError(f"group_index_B must hold integer group ids, got dtype {g_B.dtype}")
    _, inverse_B, size_g = np.unique(g_B, return_inverse=True, return_counts=True)
    return inverse_B.reshape(-1), size_g


def as_bool_mask(mask_BT, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Return `mask_BT` as a bool array; a numeric mask must hold only 0 and 1.

    Why strict: a mask of 0.5s (a weight passed by mistake) would otherwise silently count as valid.
    """
    m = np.asarray(mask_BT)
    if m.ndim != 2:
        raise ValueError(f"mask_BT must be 2-D [B, T], got shape {m.shape}")
    if shape is not None and m.shape != tuple(shape):
        raise ValueError(f"mask_BT has shape {m.shape}, expected {tuple(shape)}")
    return ragged.check_mask(m.reshape(-1), m.size).reshape(m.shape)


def _tokens(x_BT, name: str, mask_BT: np.ndarray) -> np.ndarray:
    """float64 copy of a token array with padding set to 0 (so NaN padding cannot leak)."""
    x = np.asarray(x_BT, dtype=np.float64)
    if x.shape != mask_BT.shape:
        raise ValueError(f"{name} has shape {x.shape}, mask_BT has {mask_BT.shape}")
    return ragged.valid_tokens(x, name, mask_BT)


# --------------------------------------------------------------------------------------------
# group (sequence-level) estimators


def group_stats(r_B: np.ndarray, group_index_B):
    """Per-sequence group mean, group size, and which groups are zero-variance / singletons."""
    inv_B, size_g = group_ids(group_index_B, r_B.shape[0])
    num_groups = size_g.shape[0]
    mean_g = np.bincount(inv_B, weights=r_B, minlength=num_groups) / np.maximum(size_g, 1)
    # Zero variance decided exactly (max == min), not by std < tol: the float mean of equal
    # numbers need not equal them, which would leave tiny nonzero advantages.
    max_g = np.full(num_groups, -np.inf)
    min_g = np.full(num_groups, np.inf)
    np.maximum.at(max_g, inv_B, r_B)
    np.minimum.at(min_g, inv_B, r_B)
    singleton_g = size_g == 1
    zero_var_g = (max_g == min_g) & ~singleton_g
    return inv_B, size_g, mean_g, singleton_g, zero_var_g


def group_metrics(size_g, singleton_g, zero_var_g) -> dict:
    num_groups = int(size_g.shape[0])
    return {
        "num_groups": num_groups,
        # groups of >= 2 samples whose rewards are all equal (no learning signal; DAPO drops them)
        "zero_variance_groups": int(zero_var_g.sum()),
        "zero_variance_fraction": float(zero_var_g.sum() / num_groups) if num_groups else 0.0,
        # groups of one sample: no baseline exists, so their advantage is 0
        "singleton_groups": int(singleton_g.sum()),
    }


GRPO_STD_SCOPES = (
    "group",  # std over the group's rewards (GRPO)
    "batch",  # std over every reward of the batch, mean still the group's (TRL's scale_rewards: batch, "Lite PPO")
)


def grpo_advantages(rewards_B, group_index_B, *, std_mode: str, eps: float, singleton_groups: str,
                    std_scope: str) -> tuple[np.ndarray, dict]:
    """GRPO group z-score: `A_i = (R_i - mean_g R) / (std_g R + eps)`.

    Why: the group of completions of one prompt is its own baseline (no critic). ALGORITHMS.md
    (choice): `std_mode="sample"` (Bessel, divide by G-1) with eps 1e-6 is the default of the
    common open frameworks; `"population"` (divide by G) is the alternative. Groups whose rewards
    are all equal get exactly 0, and singleton groups (no baseline) get 0; both are counted in
    the metrics rather than papered over. `singleton_groups="uncentered"` gives a group of one
    verl's `R / (1 + eps)` instead (verl sets its mean to 0 and its std to 1).
    `std_scope="batch"` divides by the std of all rewards of the batch (same `std_mode`) instead
    of the group's: TRL's `scale_rewards: batch`, which keeps a near-constant group's small
    differences small instead of blowing them up. Example: rewards [1, 0 | 1, 1], sample std:
    group scope [0.7071, -0.7071 | 0, 0] / ... -> ±0.707; batch std 0.5 -> [1, -1 | 0, 0].

    Shapes: rewards_B [B] float, group_index_B [B] integer ids (any order, need not be
    contiguous) -> (advantages_B [B] float64, metrics dict of python numbers).
    Reference: Shao et al. 2024, DeepSeekMath (arXiv:2402.03300), section 4.1; Liu et al. 2025,
    Tricks or Traps? (arXiv:2508.08221) for the batch std.
    """
    if std_mode not in STD_DDOF:
        raise ValueError(f"std_mode must be one of {GRPO_STD_MODES}, got {std_mode!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    check_singleton_groups(singleton_groups)
    if std_scope not in GRPO_STD_SCOPES:
        raise ValueError(f"std_scope must be one of {GRPO_STD_SCOPES}, got {std_scope!r}")
    r_B = as_rewards(rewards_B)
    inv_B, size_g, mean_g, singleton_g, zero_var_g = group_stats(r_B, group_index_B)
    dev_B = r_B - mean_g[inv_B]
    ddof = STD_DDOF[std_mode]
    if std_scope == "group":
        sq_g = np.bincount(inv_B, weights=dev_B**2, minlength=size_g.shape[0])
        std_B = np.sqrt(sq_g / np.maximum(size_g - ddof, 1))[inv_B]
    else:
        std_B = np.full(r_B.shape, float(np.std(r_B, ddof=ddof)) if r_B.size > ddof else 0.0)
    no_signal_B = (singleton_g | zero_var_g)[inv_B]
    # denominator 1 where the answer is 0 anyway, so eps = 0 never divides 0 by 0
    adv_B = dev_B / np.where(no_signal_B, 1.0, std_B + eps)
    adv_B[no_signal_B] = 0.0
    if singleton_groups == "uncentered":
        alone_B = singleton_g[inv_B]
        adv_B[alone_B] = r_B[alone_B] / (1.0 + eps)
    return adv_B, group_metrics(size_g, singleton_g, zero_var_g)


def dr_grpo_advantages(rewards_B, group_index_B, *, singleton_groups: str) -> tuple[np.ndarray, dict]:
    """Dr.GRPO: `A_i = R_i - mean_g R` (GRPO without the std division).

    Why: dividing by the group std up-weights prompts that are nearly always solved or nearly
    always failed (a difficulty bias); Dr.GRPO drops it. Singleton and zero-variance groups give
    exactly 0 (with `singleton_groups="uncentered"`, verl's: a group of one keeps its R).
    Shapes: rewards_B [B], group_index_B [B] ints -> (advantages_B [B] float64, metrics).
    Reference: Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783).
    """
    check_singleton_groups(singleton_groups)
    r_B = as_rewards(rewards_B)
    inv_B, size_g, mean_g, singleton_g, zero_var_g = group_stats(r_B, group_index_B)
    adv_B = r_B - mean_g[inv_B]
    adv_B[(singleton_g | zero_var_g)[inv_B]] = 0.0
    if singleton_groups == "uncentered":
        adv_B[singleton_g[inv_B]] = r_B[singleton_g[inv_B]]
    return adv_B, group_metrics(size_g, singleton_g, zero_var_g)


def rloo_advantages(rewards_B, group_index_B) -> tuple[np.ndarray, dict]:
    """RLOO: `A_i = R_i - (1/(G-1)) sum_{j != i} R_j` (leave-one-out baseline).

    Why: the baseline of sample i does not depend on R_i, so the policy-gradient estimate stays
    unbiased (unlike the group mean, which includes R_i). A singleton group has no other sample
    and gets 0. Shapes: rewards_B [B], group_index_B [B] ints -> (advantages_B [B] float64, metrics).
    Reference: Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740); Kool et al. 2019.
    """
    r_B = as_rewards(rewards_B)
    inv_B, size_g, _, singleton_g, zero_var_g = group_stats(r_B, group_index_B)
    sum_g = np.bincount(inv_B, weights=r_B, minlength=size_g.shape[0])
    others_B = np.maximum(size_g[inv_B] - 1, 1)
    adv_B = r_B - (sum_g[inv_B] - r_B) / others_B
    adv_B[(singleton_g | zero_var_g)[inv_B]] = 0.0
    return adv_B, group_metrics(size_g, singleton_g, zero_var_g)


# --------------------------------------------------------------------------------------------
# token-level rewards and estimators


def token_kl(old_logprobs_BT, ref_logprobs_BT, mask_BT, *, estimator: str) -> np.ndarray:
    """Per-token KL estimate of pi_old from pi_ref on pi_old's samples (numpy twin of rlpipe.algorithms.kl).

    With `d = log pi_old - log pi_ref`: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (ALGORITHMS.md,
    "KL estimators", with pi_old in the place of pi_theta). The log-ratio is clamped to [-20, 20]
    before `exp` so k3 stays finite. Shapes: [B, T] -> [B, T] float64, 0 at padding.
    """
    m = as_bool_mask(mask_BT)
    old, ref = _tokens(old_logprobs_BT, "old_logprobs_BT", m), _tokens(ref_logprobs_BT, "ref_logprobs_BT", m)
    return ragged.token_kl(old.reshape(-1), ref.reshape(-1), m.reshape(-1), estimator=estimator).reshape(m.shape)


def kl_penalized_token_rewards(scores_B, old_logprobs_BT, ref_logprobs_BT, mask_BT, *, beta: float,
                               estimator: str = "k1") -> np.ndarray:
    """Per-token reward with the KL penalty in the reward (PPO / InstructGPT style).

    `r_t = -beta * (log pi_old(o_t) - log pi_ref(o_t))` at every valid token, plus the sequence
    score `R` on the last valid token. Worked example (ALGORITHMS.md): score 0.8, KL 0.05, beta 6
    -> 0.8 - 6 * 0.05 = 0.5. `beta = 0` turns the penalty off. ``estimator`` swaps the k1 log-ratio
    for k2 or k3 (`token_kl`). A sequence with no valid token has
    nowhere to put its score and stays all 0 (it is outside the loss anyway, e.g. an overlong
    completion masked out).

    Shapes: scores_B [B]; old_logprobs_BT, ref_logprobs_BT, mask_BT [B, T] -> rewards_BT [B, T]
    float64, 0 at padding. Reference: Ouyang et al. 2022 (arXiv:2203.02155); Ziegler et al. 2019.
    """
    s_B = as_rewards(scores_B)
    m = as_bool_mask(mask_BT)
    if m.shape[0] != s_B.shape[0]:
        raise ValueError(f"scores_B has {s_B.shape[0]} rows, mask_BT has {m.shape[0]}")
    old, ref = _tokens(old_logprobs_BT, "old_logprobs_BT", m), _tokens(ref_logprobs_BT, "ref_logprobs_BT", m)
    rewards_N = ragged.kl_penalized_token_rewards(s_B, old.reshape(-1), ref.reshape(-1), m.reshape(-1),
                                                  ragged.Layout.dense(*m.shape), beta=beta, estimator=estimator)
    return rewards_N.reshape(m.shape)


WHITEN_FORMS = (
    "std",  # (x - mean) / (population std + eps): the GRPO z-score's form (rlpipe)
    "unbiased_rsqrt",  # (x - mean) * rsqrt(Bessel-corrected var + eps): verl's masked_whiten, TRL's PPO
    "population_rsqrt",  # (x - mean) * rsqrt(max(population var, eps)): OpenRLHF's advantage normalisation
)


def whiten(x_BT, mask_BT, *, form: str, eps: float) -> np.ndarray:
    """Centre and scale `x` with the mean and spread of the valid tokens of the whole batch.

    Why three forms: the frameworks agree on the mean and disagree on the spread, by about 1/(2N)
    for N valid tokens (ALGORITHMS.md, "Compatibility profiles"), so the form is a profile setting:
      "std":              (x - mean) / (sqrt(var_N) + eps), var_N = sum (x - mean)^2 / N (rlpipe);
      "unbiased_rsqrt":   (x - mean) * (var_{N-1} + eps)^(-1/2), var_{N-1} = sum (x - mean)^2 / (N - 1)
                          (verl 0.9 `masked_whiten`, eps 1e-8 there);
      "population_rsqrt": (x - mean) * max(var_N, eps)^(-1/2) (OpenRLHF, eps 1e-8 there).
    Worked example: x = [1, 1, 0, 0] -> mean 0.5, var_N 0.25, var_{N-1} 1/3: "std" (eps 1e-6) gives
    ±0.999998, "unbiased_rsqrt" (eps 1e-8) ±0.866025. No valid token, or one valid token with
    "unbiased_rsqrt" (var_{N-1} undefined; verl raises), or a zero scale -> all 0.
    Shapes: x_BT, mask_BT [B, T] -> [B, T] float64, 0 at padding.
    """
    if form not in WHITEN_FORMS:
        raise ValueError(f"unknown whitening form {form!r}; valid: {list(WHITEN_FORMS)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    m = as_bool_mask(mask_BT)
    x = _tokens(x_BT, "x_BT", m)
    return ragged.whiten(x.reshape(-1), m.reshape(-1), form=form, eps=eps).reshape(m.shape)


def reward_to_go(token_rewards_BT, mask_BT) -> np.ndarray:
    """Undiscounted return `G_t = sum_{t' >= t} r_t'` over valid tokens. Shapes: [B, T] -> [B, T]."""
    m = as_bool_mask(mask_BT)
    r = _tokens(token_rewards_BT, "token_rewards_BT", m)
    return ragged.reward_to_go(r.reshape(-1), m.reshape(-1), ragged.Layout.dense(*m.shape)).reshape(m.shape)


def reinforce_plus_plus_advantages(token_rewards_BT, mask_BT, *, whiten_form: str, eps: float) -> np.ndarray:
    """REINFORCE++: undiscounted reward-to-go, then whitened over all valid tokens of the batch.

    Why: the token reward already carries the KL penalty (see `kl_penalized_token_rewards`), so
    the return needs no critic; normalising over the whole batch (not per group) is what
    distinguishes it from GRPO. `whiten_form` and `eps` are `whiten`'s. Shapes: token_rewards_BT, mask_BT
    [B, T] -> advantages_BT [B, T] float64, 0 at padding. Reference: Hu 2025, REINFORCE++ (arXiv:2501.03262).
    """
    return whiten(reward_to_go(token_rewards_BT, mask_BT), mask_BT, form=whiten_form, eps=eps)


def gae_advantages(token_rewards_BT, values_BT, mask_BT, *, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation, computed backwards over the valid tokens.

    `delta_t = r_t + gamma * V_{t+1} - V_t`, `A_t = delta_t + gamma * lam * A_{t+1}`, with V and A
    after the last valid token equal to 0; returns `R_t = A_t + V_t` are the critic targets.
    Why "next valid token": masked positions are skipped, not treated as terminal, so the same
    code is right for right-padding and for masked tokens inside a completion (e.g. tool output).
    The advantages are NOT whitened here (the returns must use the raw A); see `whiten`.

    Shapes: token_rewards_BT, values_BT, mask_BT [B, T] -> (advantages_BT, returns_BT) [B, T]
    float64, 0 at padding. Reference: Schulman et al. 2016 (arXiv:1506.02438).
    """
    m = as_bool_mask(mask_BT)
    r = _tokens(token_rewards_BT, "token_rewards_BT", m)
    v = _tokens(values_BT, "values_BT", m)
    adv_N, returns_N = ragged.gae(r.reshape(-1), v.reshape(-1), m.reshape(-1), ragged.Layout.dense(*m.shape),
                                  gamma=gamma, lam=lam)
    return adv_N.reshape(m.shape), returns_N.reshape(m.shape)


def adaptive_kl_beta(beta: float, *, observed_kl: float, target_kl: float, horizon: float, num_samples: int) -> float:
    """One step of the adaptive KL controller: the new beta for the next iteration.

    `e = clip(observed_kl / target_kl - 1, -0.2, 0.2)`, `beta <- beta * (1 + e * n / horizon)`,
    n = samples in the update. The clip bounds how fast beta can move on one noisy KL reading.
    beta is state: the caller must carry the returned value to the next iteration.
    Reference: Ziegler et al. 2019, Fine-Tuning LMs from Human Preferences (arXiv:1909.08593).
    """
    if not target_kl > 0:
        raise ValueError(f"target_kl must be > 0, got {target_kl}")
    if not horizon > 0:
        raise ValueError(f"horizon must be > 0, got {horizon}")
    error = float(np.clip(observed_kl / target_kl - 1.0, -0.2, 0.2))
    return float(beta * (1.0 + error * num_samples / horizon))
