"""Send one finished iteration to the configured trackers (see the package docstring).

Why from the files rlpipe already writes: the numbers DVC tracks (the history row, the step
series) stay the one source; a tracker is a view of them, so it can be added, removed or re-run
without touching a stage. Optimizer steps count on across iterations (a global step), kept with the
iterations already sent in ``.rlpipe/tracking.json``, so a repeated `rlpipe iterate` never sends an
iteration twice.
"""
from __future__ import annotations

import csv
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlpipe.data.io import atomic_path
from rlpipe.errors import ConfigError

STATE_FILE = ".rlpipe/tracking.json"
DVCLIVE_DIR = "dvclive"  # dvclive/iterations (step = iteration) and dvclive/steps (step = global optimizer step)
TENSORBOARD_DIR = "runs/rlpipe"
STEP_KEYS_SKIPPED = ("step", "epoch", "minibatch")


@dataclass(frozen=True)
class IterationRecord:
    """What a tracker receives: the iteration's numbers and its optimizer steps on the global step axis."""
    iteration: int
    numbers: dict[str, float]  # the history row's numeric values (eval_accuracy, kl_ref, ...)
    steps: list[tuple[int, dict[str, float]]]  # (global step, that step's numbers) in order
    state: dict[str, Any]  # per-tracker run ids, kept across iterations


def _numbers(row: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, float]:
    out = {}
    for key, value in row.items():
        if key in skip or value is None or isinstance(value, bool):
            continue
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue  # a label (estimator name), not a number
    return out


def _dvclive(root: Path, rec: IterationRecord) -> None:
    from dvclive import Live

    # dvcyaml=None: DVCLive must not rewrite the pipeline's dvc.yaml; save_dvc_exp=False: no experiment refs.
    with Live(str(root / DVCLIVE_DIR / "iterations"), resume=True, save_dvc_exp=False, dvcyaml=None) as live:
        live.step = rec.iteration
        for key, value in rec.numbers.items():
            live.log_metric(key, value)
        live.next_step()  # writes the step's row and the summary (metrics.json)
    if rec.steps:
        with Live(str(root / DVCLIVE_DIR / "steps"), resume=True, save_dvc_exp=False, dvcyaml=None) as live:
            for step, numbers in rec.steps:
                live.step = step
                for key, value in numbers.items():
                    live.log_metric(f"train/{key}", value)
                live.next_step()


def _tensorboard(root: Path, rec: IterationRecord) -> None:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    writer = SummaryWriter(log_dir=str(root / TENSORBOARD_DIR))
    try:
        for key, value in rec.numbers.items():
            writer.add_scalar(f"iteration/{key}", value, rec.iteration)
        for step, numbers in rec.steps:
            for key, value in numbers.items():
                writer.add_scalar(f"train/{key}", value, step)
    finally:
        writer.close()


def _wandb(root: Path, rec: IterationRecord) -> None:
    import wandb

    run_id = rec.state.setdefault("wandb_run_id", secrets.token_hex(4))  # one W&B run for the whole project
    os.environ.setdefault("WANDB_MODE", "offline")  # online only when the user says so (WANDB_MODE=online)
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlpipe"), id=run_id, resume="allow",
                     dir=str(root / ".rlpipe"), name=root.resolve().name)
    try:
        for step, numbers in rec.steps:
            run.log({f"train/{k}": v for k, v in numbers.items()}, step=step)
        last = rec.steps[-1][0] if rec.steps else rec.state.get("global_step", 0)
        run.log({"iteration": rec.iteration, **{f"iteration/{k}": v for k, v in rec.numbers.items()}}, step=last)
    finally:
        run.finish()


def _mlflow(root: Path, rec: IterationRecord) -> None:
    import mlflow

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:  # a local store under the project, readable by `mlflow ui --backend-store-uri mlruns`
        uri = (root / "mlruns").resolve().as_uri()
        # MLflow 3 keeps the file store but refuses it unless asked; a database store (MLFLOW_TRACKING_URI=
        # sqlite:///mlflow.db) needs the full mlflow package, which mlflow-skinny users do not have.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=rec.state.get("mlflow_run_id"), run_name=root.resolve().name) as run:
        rec.state["mlflow_run_id"] = run.info.run_id
        for key, value in rec.numbers.items():
            mlflow.log_metric(f"iteration/{key}", value, step=rec.iteration)
        for step, numbers in rec.steps:
            mlflow.log_metrics({f"train/{k}": v for k, v in numbers.items()}, step=step)


TRACKERS: dict[str, Callable[[Path, IterationRecord], None]] = {
    "dvclive": _dvclive,
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
}
PACKAGES = {"dvclive": "dvclive", "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_installed(names: tuple[str, ...]) -> None:
    """Fail before anything is committed when a configured tracker's package is missing."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        raise ConfigError(f"iterate.trackers names {missing}, not installed here: pip install "
                          f"{' '.join(PACKAGES[n] for n in missing)} (or remove them from iterate.trackers)")


def forward(root: Path, names: tuple[str, ...], row: dict[str, Any], steps_csv: Path) -> list[str]:
    """Send iteration ``row['iteration']`` to the trackers ``names``; returns those it was sent to ([] if sent before)."""
    if not names:
        return []
    state_path = root / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {"sent": [], "global_step": 0}
    k = int(row["iteration"])
    if k in state["sent"]:
        return []
    offset = int(state["global_step"])
    steps = []
    if steps_csv.is_file():
        with steps_csv.open() as f:
            steps = [(offset + int(r["step"]), _numbers(r, STEP_KEYS_SKIPPED)) for r in csv.DictReader(f)]
    rec = IterationRecord(iteration=k, numbers=_numbers(row, ("iteration",)), steps=steps, state=state)
    for name in names:
        TRACKERS[name](root, rec)
    state["sent"].append(k)
    state["global_step"] = max([offset, *(s + 1 for s, _ in steps)])
    state_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(state_path) as tmp:
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    return list(names)
