"""`rlpipe iterate`'s forwarding to trackers, offline, from hand-written history rows and step series."""
from __future__ import annotations

import json

import pytest

from rlpipe.errors import ConfigError
from rlpipe.tracking.forward import STATE_FILE, check_installed, forward

ROW = {"iteration": 0, "eval_accuracy": 0.5, "kl_ref": 0.01, "estimator": "grpo", "value_loss": None}


def steps_csv(path, n):
    path.write_text("step,epoch,loss,clip_fraction,entropy\n" + "".join(f"{i},0,{0.1 * i},0.0,\n" for i in range(n)))
    return path


def test_dvclive_gets_iterations_and_global_steps_once(tmp_path):
    pytest.importorskip("dvclive")
    assert forward(tmp_path, ("dvclive",), ROW, steps_csv(tmp_path / "steps.csv", 2)) == ["dvclive"]
    assert forward(tmp_path, ("dvclive",), ROW, tmp_path / "steps.csv") == []  # sent already: never twice
    forward(tmp_path, ("dvclive",), {**ROW, "iteration": 1, "eval_accuracy": 0.75}, steps_csv(tmp_path / "s.csv", 3))
    iterations = json.loads((tmp_path / "dvclive/iterations/metrics.json").read_text())
    assert iterations["eval_accuracy"] == 0.75 and iterations["step"] == 1 and "estimator" not in iterations
    tsv = (tmp_path / "dvclive/iterations/plots/metrics/eval_accuracy.tsv").read_text().splitlines()
    assert [line.split("\t") for line in tsv[1:]] == [["0", "0.5"], ["1", "0.75"]]  # step, value
    steps = (tmp_path / "dvclive/steps/plots/metrics/train/loss.tsv").read_text().splitlines()
    assert [line.split("\t")[0] for line in steps[1:]] == ["0", "1", "2", "3", "4"]  # 2 + 3 steps, one axis
    assert json.loads((tmp_path / STATE_FILE).read_text())["global_step"] == 5


def test_tensorboard_offline(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    forward(tmp_path, ("tensorboard",), ROW, steps_csv(tmp_path / "steps.csv", 2))
    events = EventAccumulator(str(tmp_path / "runs/rlpipe"))
    events.Reload()
    assert [e.value for e in events.Scalars("iteration/eval_accuracy")] == [0.5]
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1]


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    forward(tmp_path, ("wandb",), ROW, steps_csv(tmp_path / "steps.csv", 2))
    runs = list((tmp_path / ".rlpipe/wandb").glob("offline-run-*"))
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert len(runs) == 1 and state["wandb_run_id"] in runs[0].name


def test_mlflow_local_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    forward(tmp_path, ("mlflow",), ROW, steps_csv(tmp_path / "steps.csv", 2))
    run_id = json.loads((tmp_path / STATE_FILE).read_text())["mlflow_run_id"]
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    assert [m.value for m in client.get_metric_history(run_id, "iteration/eval_accuracy")] == [0.5]


def test_a_missing_tracker_package_is_named(monkeypatch):
    from rlpipe.tracking import forward as module

    monkeypatch.setitem(module.PACKAGES, "mlflow", "no_such_package_rlpipe")
    with pytest.raises(ConfigError, match=r"pip install (dvclive )?no_such_package_rlpipe \(or remove"):
        check_installed(("dvclive", "mlflow"))
