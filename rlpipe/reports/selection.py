"""Which rollouts `rlpipe inspect --show N` shows first: the informative ones, each completion once.

Rows in file order show a prompt's whole group first, and a group where every sample got the same
reward (often G identical completions) carries no GRPO signal: its advantages are 0. So, unless the
user sorts, the rows are ranked:

1. groups with mixed rewards before zero-variance ones; then by the group's largest |signal|;
   then by prompt_id (a stable tie-break);
2. within a group, each distinct completion once (identical token ids collapse onto the lowest
   sample_idx, the others listed as its duplicates), alternating from the top and the bottom of the
   signal: the best sample, the worst, the second best, ...;
3. two samples of each group in rank order, then two more of each, and so on: ``--show 4`` gives
   the best and the worst completion of the two most informative groups.

The signal of a row is its sequence advantage; for token-level estimators (no sequence advantage)
the mean of its token advantages; with no advantages at all, its reward minus its group's mean.
With one sample per prompt (the greedy eval rollouts) there is no group to contrast: the rows go
lowest reward first, so the wrong answers lead.
"""
from __future__ import annotations

from typing import Any

import polars as pl

KEYS = ("prompt_id", "sample_idx")
PER_GROUP = 2  # samples each group contributes per round: the best and the worst


def row_signal(frame: pl.DataFrame) -> pl.Expr:
    """The signed per-row quantity that ranks rows (see the module docstring)."""
    cols = set(frame.columns)
    parts = []
    if "advantage" in cols:
        parts.append(pl.col("advantage").cast(pl.Float64))
    if "token_advantages" in cols:
        parts.append(pl.col("token_advantages").list.mean().cast(pl.Float64))
    if "reward" in cols:
        parts.append(pl.col("reward").cast(pl.Float64) - pl.col("reward").cast(pl.Float64).mean().over("prompt_id"))
    parts.append(pl.lit(0.0, dtype=pl.Float64))
    return pl.coalesce(parts)


def _alternate(items: list[Any]) -> list[Any]:
    """[a, b, c, d, e] -> [a, e, b, d, c]: from both ends towards the middle."""
    out, lo, hi = [], 0, len(items) - 1
    while lo <= hi:
        out.append(items[lo])
        if hi != lo:
            out.append(items[hi])
        lo, hi = lo + 1, hi - 1
    return out


def one_sample_per_prompt(frame: pl.DataFrame) -> bool:
    return "prompt_id" in frame.columns and frame.height > 0 and frame["prompt_id"].n_unique() == frame.height


def informative_order(frame: pl.DataFrame, limit: int | None = None) -> tuple[pl.DataFrame, dict[tuple, list[int]]]:
    """The first ``limit`` distinct rows of ``frame`` in informative order, and each shown row's duplicates.

    Returns the rows (a subset of ``frame``, reordered) and ``{(prompt_id, sample_idx): [sample_idx of
    identical completions of the same prompt]}`` for the rows returned.
    """
    if not set(KEYS) <= set(frame.columns) or frame.height == 0:
        return (frame if limit is None else frame.head(limit)), {}
    identity = "completion_token_ids" if "completion_token_ids" in frame.columns else (
        "completion_text" if "completion_text" in frame.columns else None)
    cols = [*KEYS, "_signal"] + ([identity] if identity else []) + (["reward"] if "reward" in frame.columns else [])
    rows = frame.with_columns(row_signal(frame).alias("_signal")).select(cols).sort(KEYS)

    groups: dict[Any, dict[str, Any]] = {}
    for r in rows.iter_rows(named=True):
        g = groups.setdefault(r["prompt_id"], {"reps": {}, "order": [], "rewards": set()})
        key = tuple(r[identity]) if identity == "completion_token_ids" and r[identity] is not None else (
            r[identity] if identity else r["sample_idx"])
        if r.get("reward") is not None:
            g["rewards"].add(r["reward"])
        if key in g["reps"]:
            g["reps"][key]["dups"].append(r["sample_idx"])
        else:
            g["reps"][key] = {"sample_idx": r["sample_idx"], "signal": r["_signal"], "dups": []}
    single = one_sample_per_prompt(frame)
    ranked = []
    for pid, g in groups.items():
        reps = sorted(g["reps"].values(), key=lambda x: (-x["signal"], x["sample_idx"]))
        if single:  # lowest reward first; a row without a reward last
            reward = min(g["rewards"]) if g["rewards"] else None
            ranked.append(((reward is None, reward if reward is not None else 0.0, pid), pid, reps))
            continue
        mixed = len(g["rewards"]) > 1
        strength = max(abs(x["signal"]) for x in reps)
        ranked.append(((not mixed, -strength, pid), pid, _alternate(reps)))
    ranked.sort(key=lambda t: t[0])

    picks: list[tuple[Any, int]] = []
    dups: dict[tuple, list[int]] = {}
    total = sum(len(reps) for _, _, reps in ranked)
    want = total if limit is None else min(limit, total)
    start = 0
    while len(picks) < want:
        for _, pid, reps in ranked:
            for rep in reps[start:start + PER_GROUP]:
                if len(picks) < want:
                    picks.append((pid, rep["sample_idx"]))
                    dups[(pid, rep["sample_idx"])] = rep["dups"]
        start += PER_GROUP
    order = pl.DataFrame({"prompt_id": [p for p, _ in picks], "sample_idx": [s for _, s in picks],
                          "_order": list(range(len(picks)))},
                         schema={"prompt_id": frame.schema["prompt_id"], "sample_idx": frame.schema["sample_idx"],
                                 "_order": pl.Int64})
    shown = frame.join(order, on=list(KEYS), how="inner").sort("_order").drop("_order")
    return shown, dups
