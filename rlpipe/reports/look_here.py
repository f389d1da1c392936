"""The rows of an iteration worth a look first, as a first step against reward hacking and broken samples.

Each list ranks the selected rows by one signal and keeps the top few: wrong answers that still got a
high reward (a reward that can be gamed), the longest completions (runaway generation), the largest
per-token |log pi_new - log pi_old| (where training moved most), the largest sampler/trainer
mismatch (numerics that make the rollouts off-policy) and the truncated completions (cut off, so a
reward on them reads a partial answer). Plain data for rlpipe.reports.html and the JSON output.
"""
from __future__ import annotations

from typing import Any

import polars as pl

LOOK_HERE_ROWS = 5  # rows per list
EXCERPT_CHARS = 80

# key: (title, the ranked column, what it means, rows to rank (None: all), descending)
LISTS = {
    "high_reward_wrong": ("highest-reward wrong answers", "reward", "correct is false, highest reward first",
                          pl.col("correct").not_(), True),
    "longest": ("longest completions", "completion_length", "most tokens first", None, True),
    "log_ratio": ("largest |log-ratio| (what training changed most)", "seq_log_ratio_max",
                  "largest per-token |log pi_new - log pi_old| of the row", None, True),
    "sampler_mismatch": ("largest sampler mismatch", "seq_mismatch_max",
                         "largest per-token |old - sampler log-prob| of the row", None, True),
    "truncated": ("truncated completions", "reward", "cut off at the token budget, highest reward first",
                  pl.col("truncated"), True),
}


def _excerpt(text: str | None) -> str:
    text = (text or "").replace("\n", "⏎")
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS - 1] + "…"


def look_here(frame: pl.DataFrame, *, command: str, limit: int = LOOK_HERE_ROWS) -> dict[str, dict[str, Any]]:
    """Every list of LISTS whose columns ``frame`` has: title, note, the ranked value's name, total and top rows.

    ``command``: the `rlpipe inspect ...` that read ``frame``; a row's own command adds its --prompt-id.
    """
    out: dict[str, dict[str, Any]] = {}
    for key, (title, column, note, keep, descending) in LISTS.items():
        needed = {column, "prompt_id", "sample_idx"} | ({"correct"} if key == "high_reward_wrong" else set()) | (
            {"truncated"} if key == "truncated" else set())
        if not needed <= set(frame.columns):
            continue
        rows = frame if keep is None else frame.filter(keep)
        # NaN and null rank nowhere (a NaN would sort first, and --json prints no NaN)
        rows = rows.filter(pl.col(column).cast(pl.Float64).is_finite())
        total = rows.height
        top = rows.sort([column, "prompt_id", "sample_idx"], descending=[descending, False, False]).head(limit)
        out[key] = {"title": title, "value": column, "note": note, "total": total,
                    "rows": [_row(r, column, command) for r in top.iter_rows(named=True)]}
    return out


def _row(r: dict[str, Any], column: str, command: str) -> dict[str, Any]:
    return {"prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"], "value": r[column],
            "reward": r.get("reward"), "length": r.get("completion_length"),
            "excerpt": _excerpt(r.get("completion_text")), "command": f"{command} --prompt-id {r['prompt_id']}"}
