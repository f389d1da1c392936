"""The iteration history as a DVC plot: history/iterations.jsonl -> plots/iterations.csv.

`rlpipe iterate` appends one JSON row per finished iteration to the history file (the record);
DVC's plots read CSV/JSON/YAML but not JSON Lines, so the same rows are also written as a CSV
beside the per-step series (``paths.plots_dir``), which dvc.yaml's top-level ``plots:`` draw
against ``iteration``. The CSV is derived data: it is rewritten whole from the history each time.
"""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

from rlpipe.data.io import atomic_path
from rlpipe.data.quantiles import QUANTILES
from rlpipe.errors import ArtifactError

HISTORY_CSV = "iterations.csv"  # under paths.plots_dir; dvc.yaml's top-level plots name this file
# The eval series under paths.plots_dir: the starting model's eval (the baseline row, at iteration -1) and then each
# iteration's. Apart from iterations.csv because a DVC plot draws a missing value as 0: the baseline row has no
# train numbers, and in one file every train curve would start with a false 0.
EVAL_CSV = "eval.csv"
BASELINE_ITERATION = -1  # the baseline row's place on the iteration axis: before iteration 0's training


def chart_columns(*, generate: dict[str, Any], score: dict[str, Any], evaluate: dict[str, Any]) -> dict[str, Any]:
    """A history row's columns for dvc.yaml's multi-turn and distribution charts, from the stage metrics.

    Every key is always there (None where a stage did not measure it: a single-turn run has no tool
    use, an older run no quantiles), so iterations.csv keeps one set of columns and DVC finds every
    field a chart names; the chart templates leave the empty cells out.
    """
    out = {"eval_tool_use_rate": evaluate.get("tool_use_rate"), "eval_turns_mean": evaluate.get("turns_mean"),
           "train_tool_use_rate": generate.get("tool_use_rate"), "train_turns_mean": generate.get("turns_mean")}
    for prefix, quantiles in (("train_reward", score.get("reward_quantiles")),
                              ("length", generate.get("length_quantiles"))):
        out.update({f"{prefix}_p{q}": (quantiles or {}).get(f"p{q}") for q in QUANTILES})
    return out


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The history rows, sorted by iteration; an unreadable line is an error naming the file and line."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{p}:{n}: not a JSON line ({e})") from None
    return sorted(rows, key=lambda r: r.get("iteration", 0))


BY_VALUE = "eval_accuracy_by."  # the history's per-value eval accuracy keys: eval_accuracy_by.<column>.<value>


def eval_numbers(evaluate: dict[str, Any]) -> dict[str, Any]:
    """An evaluate metrics file's numbers in a history row: accuracy, mean reward and, per value of each
    evaluate.metrics_by column, the accuracy as ``eval_accuracy_by.difficulty.hard``.

    Why that spelling: a name every tracker takes. MLflow refuses brackets and "=" (any other character of a
    value becomes "_"), DVCLive nests on "/" (``eval_accuracy/...`` would collide with ``eval_accuracy``).
    """
    row = {"eval_accuracy": evaluate["accuracy"], "eval_reward_mean": evaluate["reward_mean"]}
    for column, values in sorted((evaluate.get("accuracy_by") or {}).items()):
        row.update({f"{BY_VALUE}{_name_part(column)}.{_name_part(value)}": accuracy
                    for value, accuracy in values.items()})
    return row


def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", str(text))


def is_eval_series(key: str) -> bool:
    """Whether a history key is drawn by the eval curves (plots/eval.csv): accuracy, mean reward, per value."""
    return key in ("eval_accuracy", "eval_reward_mean") or key.startswith(BY_VALUE)


def baseline_row(baseline: dict[str, Any]) -> dict[str, Any]:
    """The history row of the baseline stage's eval (the starting model), at ``BASELINE_ITERATION``."""
    return {"iteration": BASELINE_ITERATION, "baseline": True, "policy_version": 0, **eval_numbers(baseline)}


def write_history_csv(history: str | Path, out: str | Path, eval_out: str | Path | None = None) -> Path:
    """Rewrite ``out`` from the history file: one row per iteration, ``iteration`` first, other keys sorted;
    and ``eval_out`` (when given): the eval numbers of every row, the baseline's first."""
    rows = read_history(history)
    if eval_out is not None:
        write_rows([{k: v for k, v in r.items() if k == "iteration" or is_eval_series(k)} for r in rows], eval_out)
    return write_rows([r for r in rows if not r.get("baseline")], out)


def write_rows(rows: list[dict[str, Any]], out: str | Path) -> Path:
    """``rows`` as a CSV: ``iteration`` first, other keys sorted, a missing value empty."""
    keys = sorted({k for r in rows for k in r if k != "iteration"})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["iteration", *keys], lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in ["iteration", *keys]})
    with atomic_path(out) as tmp:
        tmp.write_text(buf.getvalue())
    return Path(out)
