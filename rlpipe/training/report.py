"""What the train stage writes besides the checkpoint: token statistics, the step series, reward stats."""
from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np
import polars as pl

from rlpipe.data.io import atomic_path
from rlpipe.data.lists import flat_values
from rlpipe.errors import TrainingError
from rlpipe.training.loop import TrainResult
from rlpipe.training.share import Gather, sums_over_ranks

STEP_COLUMNS = ("step", "epoch", "loss", "grad_norm", "lr", "sequences", "tokens", "approx_kl", "clip_fraction",
                "dual_clip_fraction", "ratio_mean", "ratio_min", "ratio_max", "kl_ref", "entropy")


def token_stats_frame(frame: pl.DataFrame, result: TrainResult) -> pl.DataFrame:
    as_lists = lambda rows: pl.Series([np.asarray(r, dtype=np.float32) for r in rows], dtype=pl.List(pl.Float32))  # noqa: E731
    return frame.select("prompt_id", "sample_idx").with_columns(
        as_lists(result.old_logprobs).alias("old_logprobs"),
        as_lists(result.old_entropy).alias("entropy"),
        as_lists(result.new_logprobs).alias("new_logprobs"),
    )


def write_steps_csv(path: str, steps: list[dict[str, float]]) -> None:
    """One row per optimizer step, fixed columns (empty where a value was not computed), for `dvc plots`."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=STEP_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for s in steps:
        writer.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in s.items()})
    with atomic_path(path) as tmp:
        tmp.write_text(buf.getvalue())


def reward_stats(scores: pl.DataFrame) -> dict[str, Any]:
    scored = scores["reward"].fill_nan(None).drop_nulls()  # NaN: unscorable (advantage.nan_rewards)
    return {
        "reward_mean": float(scored.mean()) if scored.len() else 0.0,
        "reward_std": float(scored.std()) if scored.len() > 1 else 0.0,
        "train_accuracy": float(scores["correct"].mean()) if scores["correct"].null_count() < scores.height else None,
    }


def _at_policy_tokens(frame: pl.DataFrame, old_logprobs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sampler, trainer) log-probs of every policy token, flat float64: observation tokens have no sampler's."""
    mask = flat_values(frame["policy_mask"], bool)
    sampler = flat_values(frame["sampler_logprobs"], np.float64)[mask]
    old = np.concatenate([np.asarray(x, dtype=np.float64) for x in old_logprobs] or [np.zeros(0)])[mask]
    return sampler, old


def sampler_mismatch(frame: pl.DataFrame, old_logprobs: list[np.ndarray], gather: Gather | None = None
                     ) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's recomputed log pi_old (same weights).

    ALGORITHMS.md asks for this every iteration: numerics (bf16, kernels) and top-k/top-p
    renormalisation make them differ; a jump means the engines disagree.
    Only the policy's tokens count: an observation token of a multi-turn rollout has no sampler log-prob.
    ``gather``: under torchrun, each rank passes its rows; every rank gets the figures of all of them.
    """
    sampler, old = _at_policy_tokens(frame, old_logprobs)
    diff = np.abs(old - sampler)
    if gather is not None:
        total = sums_over_ranks({"count": int(diff.size), "sum": float(diff.sum()),
                                 "diff_max": float(diff.max(initial=0.0))}, gather)
        mean = total["sum"] / total["count"] if total["count"] else 0.0
        return {"sampler_mismatch_mean_abs": mean, "sampler_mismatch_max_abs": total["diff_max"]}
    if sampler.size == 0:
        return {"sampler_mismatch_mean_abs": 0.0, "sampler_mismatch_max_abs": 0.0}
    return {"sampler_mismatch_mean_abs": float(diff.mean()), "sampler_mismatch_max_abs": float(diff.max())}


def sampler_check_applies(*, staleness: int, sampling: dict[str, Any] | None, tolerance: float | None,
                          keep_sampling_mask: bool) -> str | None:
    """Why train's sampler check is skipped for these rollouts, or None when it applies.

    It applies when the sampler was the very policy train starts from (staleness 0: an overlapped
    run samples with an older one, and the gap is the importance weight) and train's log pi_old is
    over the sampler's distribution: the full softmax, or with top-k/top-p the truncated one that
    the keep sampling mask recomputes (without it, the renormalised sampler log-probs differ by
    construction; ALGORITHMS.md).
    """
    if tolerance is None:
        return "train.max_sampler_mismatch is null"
    if staleness:
        return f"sampled {staleness} version(s) behind the trainer (overlapped)"
    truncated = sampling and (int(sampling.get("top_k", 0)) > 0 or float(sampling.get("top_p", 1.0)) < 1.0)
    if truncated and not keep_sampling_mask:
        return "top-k/top-p sampling renormalises the sampler's log-probs (train.keep_sampling_mask is off)"
    return None


def check_sampler(frame: pl.DataFrame, old_logprobs: list[np.ndarray], *, tolerance: float, policy: str,
                  gather: Gather | None = None) -> None:
    """Fail when the sampler's log-probs are not the trainer's: the rollouts came from other weights.

    Why: a sampler that never received the trained weights (a LoRA adapter left out of the request,
    a stale engine) samples from an old policy while everything downstream looks normal; verl users
    ran whole LoRA trainings like that. The mean over policy tokens is robust to a few tokens where
    bf16 kernels disagree (vLLM bf16: ~4e-3; HF float32: ~1e-7).
    """
    m = sampler_mismatch(frame, old_logprobs, gather)
    if m["sampler_mismatch_mean_abs"] > tolerance:
        raise TrainingError(
            f"train.max_sampler_mismatch: the rollouts' sampler log-probs differ from the trainer's log pi_old by "
            f"{m['sampler_mismatch_mean_abs']:.4g} on average (max {m['sampler_mismatch_max_abs']:.4g}), above "
            f"{tolerance}: the sampler did not run the weights train starts from ({policy}), e.g. a LoRA adapter "
            "that never reached the engine or a stale engine server. Nothing was trained or written; re-run "
            "generate (for a lower-precision sampler, raise train.max_sampler_mismatch)")


def importance_weights(frame: pl.DataFrame, old_logprobs: list[np.ndarray], *, tis_cap: float | None,
                       gather: Gather | None = None) -> dict[str, float]:
    """The per-token importance weights pi_old / pi_sampler before truncation: the correction an
    overlapped (stale) or mismatched sampler needs (docs/overlap.md says how to read them).

    With a synchronous sampler they are ~1 up to numerics; with staleness S they measure how far the
    policy moved in S versions. ``capped_fraction``: the share of tokens above ``train.tis_cap``.
    """
    sampler, old = _at_policy_tokens(frame, old_logprobs)
    weights = np.exp(np.clip(old - sampler, -20.0, 20.0))
    if gather is not None:
        total = sums_over_ranks({"count": int(weights.size), "sum": float(weights.sum()),
                                 "capped": int((weights > tis_cap).sum()) if tis_cap is not None else 0,
                                 "weight_min": float(weights.min(initial=np.inf)),
                                 "weight_max": float(weights.max(initial=-np.inf))}, gather)
        if not total["count"]:
            return {"is_weight_mean": 1.0, "is_weight_min": 1.0, "is_weight_max": 1.0, "is_weight_capped_fraction": 0.0}
        return {"is_weight_mean": total["sum"] / total["count"], "is_weight_min": total["weight_min"],
                "is_weight_max": total["weight_max"], "is_weight_capped_fraction": total["capped"] / total["count"]}
    if sampler.size == 0:
        return {"is_weight_mean": 1.0, "is_weight_min": 1.0, "is_weight_max": 1.0, "is_weight_capped_fraction": 0.0}
    return {"is_weight_mean": float(weights.mean()), "is_weight_min": float(weights.min()),
            "is_weight_max": float(weights.max()),
            "is_weight_capped_fraction": float((weights > tis_cap).mean()) if tis_cap is not None else 0.0}
