"""The advantage stage's logic: group statistics, advantages per sample and per token, DAPO filters.

numpy/polars only (no torch, no model), so this stage starts and finishes in about a second and a
reward change re-runs it cheaply.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from rlpipe.algorithms.advantages import get_advantage_estimator
from rlpipe.config import AdvantageConfig
from rlpipe.errors import ArtifactError

FILTER_ZERO_VARIANCE = "zero_variance_group"
FILTER_TRUNCATED = "truncated"


def padded_mask(lengths: np.ndarray) -> np.ndarray:
    """[B, T] float mask of valid completion tokens for ragged lengths (T = max length)."""
    width = int(lengths.max()) if lengths.size else 0
    return (np.arange(width)[None, :] < lengths[:, None]).astype(np.float64)


def estimator_options(cfg: AdvantageConfig) -> dict[str, Any]:
    """The hyperparameters each estimator reads, from one config section."""
    return {"grpo": {"std_mode": cfg.std_mode, "eps": cfg.eps}}.get(cfg.estimator, {})


def check_finite_rewards(rows: pl.DataFrame, source: str) -> None:
    """Refuse NaN/inf rewards, naming the rows.

    Why refuse rather than treat: one NaN reward makes its whole group's mean and std NaN, so every
    advantage of the group, and any loss it enters, is NaN. Dropping or zeroing such rows would
    train quietly on a reward that is broken; the score stage never writes one (a reward returning
    NaN is a row error with the fallback reward), so a NaN here means the table was produced or
    edited elsewhere, and the user must look at it.
    """
    bad = rows.filter(~pl.col("reward").is_finite() | pl.col("reward").is_null())
    if bad.height:
        shown = ", ".join(f"(prompt_id={r['prompt_id']}, sample_idx={r['sample_idx']}, reward={r['reward']})"
                          for r in bad.head(5).iter_rows(named=True))
        raise ArtifactError(f"{source}: column 'reward' has {bad.height} non-finite value(s) (NaN/inf/null): {shown}"
                            + (" ..." if bad.height > 5 else ""))


def compute_advantages(rows: pl.DataFrame, cfg: AdvantageConfig) -> tuple[pl.DataFrame, dict[str, Any]]:
    """``rows``: keys, reward, completion_length, truncated (rollouts joined with scores), sorted by keys."""
    rewards = rows["reward"].to_numpy().astype(np.float64)
    groups = rows["prompt_id"].to_numpy()
    lengths = rows["completion_length"].to_numpy().astype(np.int64)
    mask = padded_mask(lengths)
    estimator = get_advantage_estimator(cfg.estimator)
    result = estimator(rewards_B=rewards, group_index_B=groups, token_rewards_BT=None, values_BT=None,
                       mask_BT=mask, options=estimator_options(cfg))
    token_adv = [result.token_advantages_BT[i, :n].astype(np.float32).tolist() for i, n in enumerate(lengths)]
    ddof = 1 if cfg.std_mode == "sample" else 0
    stats = rows.select(
        "prompt_id", "sample_idx", "truncated",
        pl.len().over("prompt_id").cast(pl.Int32).alias("group_size"),
        pl.col("reward").mean().over("prompt_id").alias("group_reward_mean"),
        pl.col("reward").std(ddof=ddof).over("prompt_id").fill_null(0.0).fill_nan(0.0).alias("group_reward_std"),
    )
    zero_var = stats["group_reward_std"].to_numpy() == 0.0
    reason = np.full(rows.height, None, dtype=object)
    if cfg.drop_truncated:
        reason[stats["truncated"].to_numpy()] = FILTER_TRUNCATED
    if cfg.drop_zero_variance_groups:
        reason[zero_var] = FILTER_ZERO_VARIANCE
    seq_adv = result.sequence_advantages_B
    frame = stats.drop("truncated").with_columns(
        pl.Series("advantage", None if seq_adv is None else seq_adv.astype(np.float32), dtype=pl.Float32),
        pl.Series("token_advantages", token_adv, dtype=pl.List(pl.Float32)),
        pl.lit(None, dtype=pl.List(pl.Float32)).alias("returns"),
        pl.Series("filtered_reason", reason.tolist(), dtype=pl.String),
    )
    kept = frame["filtered_reason"].is_null()
    metrics = {
        "estimator": cfg.estimator,
        "num_samples": frame.height,
        "num_trained": int(kept.sum()),
        "filtered": {k: int((frame["filtered_reason"] == k).sum()) for k in (FILTER_ZERO_VARIANCE, FILTER_TRUNCATED)},
        "advantage_mean": float(np.mean(seq_adv)) if seq_adv is not None else None,
        "advantage_abs_mean": float(np.mean(np.abs(seq_adv))) if seq_adv is not None else None,
        **{k: v for k, v in result.metrics.items()},
    }
    return frame, metrics
