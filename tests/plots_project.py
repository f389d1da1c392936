"""A DVC project with this repository's dvc.yaml and params.yaml and hand-made plot data, no `dvc repro`.

`dvc plots show` reads only the plot files that dvc.yaml names, so the charts of a real run can be
drawn in a second: ``ITERATIONS`` rows of plots/iterations.csv and, the baseline's first, plots/eval.csv
(written by rlpipe.run.history, as `rlpipe iterate` writes them) and ``STEPS`` rows of plots/train_steps.csv
(rlpipe.training.report's columns). Every chart of dvc.yaml then has data: 13 charts, drawn with the chart
templates of .dvc/plots/ (copied as `rlpipe init` copies them).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from rlpipe.project.init import CHART_TEMPLATES
from rlpipe.run.history import baseline_row, write_history_csv
from rlpipe.training.report import write_steps_csv

REPO = Path(__file__).resolve().parents[1]
ITERATIONS, STEPS = 3, 12  # 3 iterations: DVC's own chart ticked them 0.0, 0.2 ... 2.0
# dvc.yaml's top-level plots (12) plus the train stage's loss plot of plots/train_steps.csv.
CHARTS = 13
QUANTILES = (10, 25, 50, 75, 90)
ITERATION_CHARTS = ["accuracy per iteration (held-out greedy, train samples)", "reward per iteration",
                    "train reward distribution per iteration (median, p25-p75, p10-p90)",
                    "KL per iteration (to the reference, to pi_old)", "clip fraction per iteration",
                    "entropy per iteration (pi_old, nats per token)",
                    "completion length per iteration (median, p25-p75, p10-p90)",
                    "tool-use rate per iteration (multi-turn; share of rollouts with a tool call)",
                    "turns per rollout per iteration (multi-turn; mean)"]  # dvc.yaml's per-iteration charts, in order
STEP_CHARTS = ["train clip fraction per step", "train KL per step (approx KL to pi_old, KL to the reference)",
               "train grad norm per step (before clipping)"]


def history_rows(n: int = ITERATIONS) -> list[dict[str, float]]:
    """``n`` iterations of made-up numbers, a multi-turn run's (tool use, turns) and quantiles included."""
    return [{"iteration": k, "eval_accuracy": 0.40 + 0.08 * k, "train_accuracy": 0.45 + 0.07 * k,
             "eval_reward_mean": 0.8 + 0.1 * k, "train_reward_mean": 0.9 + 0.08 * k, "kl_ref": 0.05 * k,
             "approx_kl_old": 0.03 - 0.004 * k, "clip_fraction": 0.12 - 0.015 * k, "entropy_old": 0.2 - 0.02 * k,
             "length_mean": 3.0 + 0.1 * k, "eval_tool_use_rate": 0.5 + 0.05 * k, "train_tool_use_rate": 0.4 + 0.05 * k,
             "eval_turns_mean": 1.5 + 0.1 * k, "train_turns_mean": 1.4 + 0.1 * k,
             **{f"train_reward_p{q}": 0.2 + 0.01 * q + 0.05 * k for q in QUANTILES},
             **{f"length_p{q}": 1.0 + 0.05 * q + 0.1 * k for q in QUANTILES}} for k in range(n)]


def step_rows(n: int = STEPS) -> list[dict[str, float]]:
    return [{"step": s, "epoch": s * 2 // n, "loss": 0.1 - 0.005 * s, "grad_norm": 2.0 + (s % 3), "lr": 3e-4,
             "sequences": 256, "tokens": 900, "approx_kl": 0.01 * (s % 4), "clip_fraction": 0.1 + 0.01 * (s % 5),
             "dual_clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_min": 0.5, "ratio_max": 2.0,
             "kl_ref": 0.02 * s} for s in range(n)]


def make_plots_project(root: Path, *, iterations: int = ITERATIONS, baseline: bool = False) -> Path:
    """``root`` as a DVC project (no git) whose `dvc plots show` draws every chart of dvc.yaml; ``baseline``: the
    history starts with the baseline stage's row (the starting model's eval, at iteration -1), as a real run's does."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(REPO / name, root / name)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    shutil.copytree(REPO / CHART_TEMPLATES, root / CHART_TEMPLATES)
    history = root / "history" / "iterations.jsonl"
    history.parent.mkdir(parents=True, exist_ok=True)
    start = [baseline_row({"accuracy": 0.32, "reward_mean": 0.7})] if baseline else []
    history.write_text("".join(json.dumps(r) + "\n" for r in [*start, *history_rows(iterations)]))
    write_history_csv(history, root / "plots" / "iterations.csv", root / "plots" / "eval.csv")
    write_steps_csv(str(root / "plots" / "train_steps.csv"), step_rows())
    return root
