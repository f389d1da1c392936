"""The score stage's logic: run the configured reward functions on every rollout row.

A reward function that raises on one row marks that row (``score_error``, fallback reward) rather
than killing a stage that may have scored a million rows; only when more than
``max_error_fraction`` of rows failed does the stage stop, since then the reward itself is broken.
"""
from __future__ import annotations

import json
from typing import Any

import polars as pl

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.errors import ConfigError, ScoringError
from rlpipe.rewards.functions import Sample
from rlpipe.rewards.registry import RewardSpec, component_columns, prepare_rewards, score_sample


def reward_specs(entries: tuple[RewardEntry, ...]) -> list[RewardSpec]:
    return [RewardSpec(name=e.name, weight=e.weight, options=dict(e.options)) for e in entries]


def load_reward_functions(cfg: ScoreConfig) -> tuple[list[RewardSpec], list[Any], dict[str, str]]:
    """Resolve and check every reward before scoring a row; config mistakes become ConfigError."""
    specs = reward_specs(cfg.rewards)
    try:
        fns = prepare_rewards(specs)
        columns = component_columns(specs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"score.rewards: {e}") from None
    if cfg.accuracy_reward not in columns:
        raise ConfigError(f"score.accuracy_reward: {cfg.accuracy_reward!r} is not one of the configured rewards "
                          f"{list(columns)}")
    return specs, fns, columns


def score_rows(rows: pl.DataFrame, cfg: ScoreConfig) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Score rows holding prompt, completion_text, answer, metadata, completion_length, truncated.

    Returns the key columns plus reward, correct, score_error and one ``reward_<name>`` column per
    component, and metrics (means per component, error counts by exception type).
    """
    specs, fns, columns = load_reward_functions(cfg)
    out: dict[str, list] = {"reward": [], "correct": [], "score_error": []}
    out.update({col: [] for col in columns.values()})
    errors_by_kind: dict[str, int] = {}
    for row in rows.iter_rows(named=True):
        sample = Sample(prompt=row["prompt"], completion=row["completion_text"], answer=row["answer"],
                        metadata=json.loads(row["metadata"]) if row["metadata"] else {},
                        completion_tokens=row["completion_length"], truncated=row["truncated"])
        try:
            components, total = score_sample(sample, specs, fns)
        except Exception as e:  # noqa: BLE001 - any failure of user code is a per-row error
            kind = type(e).__name__
            errors_by_kind[kind] = errors_by_kind.get(kind, 0) + 1
            out["reward"].append(cfg.fallback_reward)
            out["correct"].append(None)
            out["score_error"].append(f"{kind}: {e}"[:500])
            for col in columns.values():
                out[col].append(None)
            continue
        out["reward"].append(float(total))
        out["correct"].append(bool(components[cfg.accuracy_reward] >= 1.0))
        out["score_error"].append(None)
        for name, col in columns.items():
            out[col].append(float(components[name]))
    frame = rows.select("prompt_id", "sample_idx").with_columns(
        pl.Series("reward", out.pop("reward"), dtype=pl.Float64),
        pl.Series("correct", out.pop("correct"), dtype=pl.Boolean),
        pl.Series("score_error", out.pop("score_error"), dtype=pl.String),
        *[pl.Series(col, vals, dtype=pl.Float64) for col, vals in out.items()],
    )
    num_errors = sum(errors_by_kind.values())
    error_fraction = num_errors / max(rows.height, 1)
    if error_fraction > cfg.max_error_fraction:
        example = frame.filter(pl.col("score_error").is_not_null()).row(0, named=True)
        raise ScoringError(
            f"{num_errors} of {rows.height} rows ({error_fraction:.1%}) failed in a reward function, more than "
            f"score.max_error_fraction={cfg.max_error_fraction}; first error at prompt_id={example['prompt_id']} "
            f"sample_idx={example['sample_idx']}: {example['score_error']}")
    return frame, score_metrics(frame, columns, errors_by_kind)


def score_metrics(frame: pl.DataFrame, columns: dict[str, str], errors_by_kind: dict[str, int]) -> dict[str, Any]:
    return {
        "num_samples": frame.height,
        "reward_mean": float(frame["reward"].mean()),
        "reward_std": float(frame["reward"].std()) if frame.height > 1 else 0.0,
        "accuracy": float(frame["correct"].mean()) if frame["correct"].null_count() < frame.height else None,
        "components": {name: float(frame[col].mean()) if frame[col].null_count() < frame.height else None
                       for name, col in columns.items()},
        "errors": sum(errors_by_kind.values()),
        "errors_by_kind": dict(sorted(errors_by_kind.items())),
    }
