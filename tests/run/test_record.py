"""What `rlpipe iterate` commits with an iteration (`rlpipe.run.record`), on a hand-made git repo and dvc.lock."""
from __future__ import annotations

import subprocess

import yaml

from rlpipe.run.record import EXEC_APPLY, applied_experiment, iteration_files


def git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def repo(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    git(root, "init", "-q")
    git(root, "config", "user.email", "t@rlpipe.invalid")
    git(root, "config", "user.name", "t")
    return root


def lock(root, deps, outs):
    stage = {"cmd": "x", "deps": [{"path": d} for d in deps], "outs": [{"path": o} for o in outs]}
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"s": stage}}))


def test_stage_inputs_pointers_and_dvc_gitignores_are_committed(tmp_path):
    root = repo(tmp_path)
    for f in ("dvc.yaml", "params.yaml", "rewards.py", "stages/s.py", "models/base.dvc", "out/.gitignore"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("x")
    (root / "models/base").mkdir()
    (root / ".gitignore").write_text("/models/base\n")
    lock(root, ["stages/s.py", "rewards.py", "models/base/config.json", "out/a.parquet", "/abs/model"],
         ["out/a.parquet"])
    files, lost = iteration_files(root)
    assert lost == []
    assert files == sorted({".gitignore", "dvc.lock", "dvc.yaml", "params.yaml", "models/base.dvc", "out/.gitignore",
                            "rewards.py", "stages/s.py"})


def test_a_git_ignored_input_that_dvc_does_not_track_is_named(tmp_path):
    root = repo(tmp_path)
    (root / ".gitignore").write_text("secret.jsonl\n")
    (root / "secret.jsonl").write_text("{}")
    lock(root, ["secret.jsonl"], [])
    assert iteration_files(root)[1] == ["secret.jsonl"]


def test_an_applied_experiment_is_recognised_until_committed(tmp_path):
    root = repo(tmp_path)
    (root / "params.yaml").write_text("lr: 1\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "baseline")
    assert applied_experiment(root) is None
    (root / "params.yaml").write_text("lr: 3\n")
    git(root, "commit", "-qam", "experiment")
    exp = git(root, "rev-parse", "HEAD").strip()
    git(root, "reset", "-q", "--soft", "HEAD~1")  # what `dvc exp apply` leaves: HEAD at the baseline, exp files
    git(root, "update-ref", "refs/exps/ab/cd/lr-3", exp)
    git(root, "update-ref", EXEC_APPLY, exp)
    assert applied_experiment(root) == "lr-3"
    (root / "params.yaml").write_text("lr: 1\n")  # back to the baseline's params
    assert applied_experiment(root) is None
    (root / "params.yaml").write_text("lr: 3\n")
    git(root, "commit", "-qam", "chosen on purpose")
    assert applied_experiment(root) is None


def test_an_experiment_run_from_head_is_recognised(tmp_path):
    root = repo(tmp_path)
    (root / "params.yaml").write_text("lr: 1\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "baseline")
    head = git(root, "rev-parse", "HEAD").strip()
    for name, lr in (("it0-baseline", 1), ("lr-5", 5)):  # `dvc exp save` of the baseline, then `dvc exp run`
        (root / "params.yaml").write_text(f"lr: {lr}\n")
        git(root, "commit", "-q", "--allow-empty", "-am", name)
        git(root, "update-ref", f"refs/exps/{head[:2]}/{head[2:]}/{name}", "HEAD")
        git(root, "reset", "-q", "--soft", head)
    assert applied_experiment(root) == "lr-5"  # the workspace as `dvc exp run` leaves it
    (root / "params.yaml").write_text("lr: 1\n")
    assert applied_experiment(root) is None  # the baseline's params are the iteration's own
