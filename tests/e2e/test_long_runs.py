"""Long runs: a killed `rlpipe run` resumes where it stopped, an interrupted `rlpipe iterate` is finished by
the next call, and old iterations' checkpoints leave the cache while their metrics and tables stay."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

import rlpipe.run.iterate
from rlpipe.config import load_params
from rlpipe.run.gc import object_path
from tests.e2e.conftest import edit_params, env, metrics_at, run
from tests.e2e.test_pipeline import ARTIFACTS, ran_stages

pytestmark = pytest.mark.slow

CHECKPOINT = "artifacts/train/checkpoint"


def copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def outputs(root: Path) -> dict[str, bytes]:
    files = {rel: (root / rel).read_bytes() for rel in ARTIFACTS}
    for d in (CHECKPOINT, "state/policy"):
        files |= {f"{d}/{p.name}": p.read_bytes() for p in sorted((root / d).iterdir())}
    return files


def git(root: Path, *args: str) -> str:
    return run(["git", *args], root).stdout


def artifact_outs(root: Path) -> dict[str, str]:
    """dvc.lock's hashes of the artifacts (metrics JSON hold wall times, so they differ run to run)."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for s in lock["stages"].values() for o in s.get("outs", []) if o["path"].startswith("artifacts/")}


def assert_same_run(root: Path, reference: Path) -> None:
    for rel in ("params.yaml", "history/iterations.jsonl", "state/policy.dvc"):
        assert (root / rel).read_bytes() == (reference / rel).read_bytes(), rel
    assert git(root, "tag").split() == git(reference, "tag").split()
    assert git(root, "log", "--format=%s").splitlines() == git(reference, "log", "--format=%s").splitlines()
    assert artifact_outs(root) == artifact_outs(reference)
    assert outputs(root) == outputs(reference)


@pytest.fixture(scope="module")
def uninterrupted(reproduced, tmp_path_factory) -> Path:
    """Iterations 0 and 1 by `rlpipe run --until 2` without a crash (read-only)."""
    root = copy(reproduced, tmp_path_factory.mktemp("uninterrupted") / "project")
    run(["rlpipe", "run", "--until", "2"], root)
    return root


def wait_for_stage(proc: subprocess.Popen, stage: str, timeout: float = 300) -> psutil.Process:
    """Poll the process tree under ``proc`` until the script of ``stage`` runs; return that process.

    Only a Python process running the script matches: `rlpipe iterate` commits the stages' code with
    ``git add -- ... stages/train.py ...``, which once matched here and had the kill land in iteration
    1's generate instead of its train.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {stage} started"
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if runs_stage_script(child.cmdline(), stage):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"{stage} did not start within {timeout} s")


def runs_stage_script(cmdline: list[str], stage: str) -> bool:
    """``python [options] stages/<stage>.py ...``: the interpreter, then the stage's script as the program."""
    if not cmdline or not os.path.basename(cmdline[0]).startswith("python"):
        return False
    program = next((arg for arg in cmdline[1:] if not arg.startswith("-")), "")
    return program.endswith(f"stages/{stage}.py")


def test_only_the_stage_script_itself_counts_as_the_stage_running():
    assert runs_stage_script(["/usr/bin/python3", "stages/train.py", "--params", "params.yaml"], "train")
    assert runs_stage_script(["python", "-u", "stages/train.py"], "train")
    assert not runs_stage_script(["git", "add", "--", "dvc.lock", "stages/score.py", "stages/train.py"], "train")
    assert not runs_stage_script(["/bin/sh", "-c", "python stages/train.py --params params.yaml"], "train")
    assert not runs_stage_script(["python", "stages/generate.py", "--policy", "x/stages/train.py"], "train")


def still_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def killed_run_report(root: Path, log: Path) -> str:
    """What to look at when a killed run left a checkpoint behind."""
    files = sorted(f"{p.relative_to(root)} {p.stat().st_size} {p.stat().st_mtime:.3f}"
                   for p in (root / CHECKPOINT).rglob("*"))
    return f"the checkpoint after the kill: {files}\nthe run's log:\n{log.read_text()[-4000:]}"


def test_killed_run_resumes_from_the_last_finished_stage(reproduced, uninterrupted, tmp_path):
    root = copy(reproduced, tmp_path / "project")
    with open(tmp_path / "run.log", "w") as log:
        # Without the warm stage server, train is a cold process that imports torch for seconds: the kill lands
        # inside it. (A warm server trains the tiny default in 0.4 s; its kill path is in test_warm_servers.)
        proc = subprocess.Popen(["rlpipe", "run", "--until", "2", "--no-servers"], cwd=root, env=env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        train = None
        try:
            train = wait_for_stage(proc, "train")  # iteration 0 is reproduced already: this is iteration 1's train
            time.sleep(0.5)
        finally:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            train_ran_at_kill = train is not None and still_running(train)
            os.killpg(proc.pid, signal.SIGKILL)  # the loop, dvc and the stage, like a lost machine
            proc.wait()
            psutil.wait_procs(tree, timeout=30)  # dvc ignores its lock only once the owner's pid is gone
    assert load_params(root / "params.yaml").iteration == 1
    assert git(root, "tag").split() == ["iteration-0"]
    if train_ran_at_kill:  # DVC removes a stage's outputs before running it, and train renames its output into place
        assert not (root / CHECKPOINT).exists(), killed_run_report(root, tmp_path / "run.log")
    # else train had finished before the kill landed (a loaded machine): its checkpoint is whole, and dvc.lock
    # does not record it, so the resume below trains again all the same
    stale = json.loads(run(["dvc", "status", "--json"], root).stdout)
    assert "train" in stale and not {"generate", "score", "reference_logprob", "advantage"} & set(stale)

    resumed = run(["rlpipe", "run", "--until", "2"], root).stdout
    assert ran_stages(resumed) == ["train", "evaluate"]
    assert "iteration 1:" in resumed and "iteration 0:" not in resumed
    assert_same_run(root, uninterrupted)
    assert run(["rlpipe", "run", "--until", "2"], root).stdout == ""  # done: nothing to do


@pytest.fixture(scope="module")
def third_reproduced(uninterrupted, tmp_path_factory) -> Path:
    """Iteration 2 reproduced but not advanced, with ``iterate.keep_checkpoints: 1`` (read-only)."""
    root = copy(uninterrupted, tmp_path_factory.mktemp("third") / "project")
    edit_params(root / "params.yaml", {"iterate.keep_checkpoints": 1})  # no stage reads it: nothing re-runs
    assert ran_stages(run(["dvc", "repro"], root).stdout) == ["generate", "score", "reference_logprob", "values",
                                                               "advantage", "train", "evaluate"]
    return root


@pytest.fixture(scope="module")
def third_advanced(third_reproduced, tmp_path_factory) -> Path:
    """... then `rlpipe iterate` without a crash: iterations 0-2 tagged, the cache pruned to K=1 (read-only)."""
    root = copy(third_reproduced, tmp_path_factory.mktemp("third_advanced") / "project")
    run(["rlpipe", "iterate"], root)
    return root


class Crash(Exception):
    pass


def crash_at(monkeypatch, point: str) -> None:
    """Make `advance` die at ``point``, as a kill between two of its steps would."""
    def boom(*args, **kwargs):
        raise Crash(point)

    if point == "after the iteration is tagged":
        monkeypatch.setattr(rlpipe.run.iterate, "_replace_dir", boom)
    elif point == "before `dvc add state/policy`":
        monkeypatch.setattr(rlpipe.run.iterate.dvc, "add", lambda root, path, **kw: boom())
    elif point == "after the policy is handed over":
        monkeypatch.setattr(rlpipe.run.iterate, "set_params", boom)
    elif point == "after params.yaml is rewritten":
        real_commit = rlpipe.run.iterate._commit
        monkeypatch.setattr(rlpipe.run.iterate, "_commit", lambda root, message, params, **kw: boom()
                            if message.startswith("rlpipe: start") else real_commit(root, message, params, **kw))


@pytest.mark.parametrize("point", ["after the iteration is tagged", "before `dvc add state/policy`",
                                   "after the policy is handed over", "after params.yaml is rewritten"])
def test_interrupted_iterate_is_finished_by_the_next_run(third_reproduced, third_advanced, tmp_path, monkeypatch,
                                                         point):
    root = copy(third_reproduced, tmp_path / "project")
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        rlpipe.run.iterate.advance(root)
    monkeypatch.undo()
    assert git(root, "rev-parse", "iteration-2^{commit}") == git(root, "rev-parse", "HEAD")

    resumed = run(["rlpipe", "run", "--until", "3"], root).stdout
    assert ran_stages(resumed) == []  # no stage re-runs; generate would refuse the new policy anyway
    assert_same_run(root, third_advanced)
    assert run(["git", "status", "--porcelain", "--", "params.yaml", "state", "dvc.lock"], root).stdout == ""
    cache = sorted(p.relative_to(root) for p in (root / ".dvc/cache/files").rglob("*") if p.is_file())
    assert cache == sorted(p.relative_to(third_advanced) for p in (third_advanced / ".dvc/cache/files").rglob("*")
                           if p.is_file())


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_old_checkpoints_leave_the_cache_metrics_and_tables_stay(reproduced, uninterrupted, third_advanced, tmp_path):
    root = copy(third_advanced, tmp_path / "project")
    cache = root / ".dvc/cache"
    weights = {0: md5(reproduced / CHECKPOINT / "model.safetensors"),
               1: md5(uninterrupted / CHECKPOINT / "model.safetensors"),
               2: md5(root / CHECKPOINT / "model.safetensors")}
    assert len(set(weights.values())) == 3
    assert not object_path(cache, weights[0]).exists()
    # The last K=1 iteration stays whole: its checkpoint (the current policy) and the policy it started from.
    assert object_path(cache, weights[1]).exists() and object_path(cache, weights[2]).exists()
    assert object_path(cache, md5(root / "artifacts/prepare/model/model.safetensors")).exists()
    assert "would remove 0 cache objects" in run(["rlpipe", "gc", "--dry-run"], root).stdout  # already pruned
    run(["dvc", "gc", "--all-tags", "--all-branches", "--force"], root)  # the documented dvc gc: keeps every tag's

    history = [json.loads(x) for x in (root / "history/iterations.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [-1, 0, 1, 2]  # the baseline row first
    assert metrics_at(root, "iteration-0", "evaluate") == json.loads((reproduced / "metrics/evaluate.json").read_text())

    run(["git", "checkout", "-q", "iteration-0"], root)
    restore = run(["dvc", "checkout"], root, check=False)
    assert restore.returncode != 0 and CHECKPOINT in restore.stderr  # the one thing it cannot restore
    for rel in ARTIFACTS:
        assert (root / rel).read_bytes() == (reproduced / rel).read_bytes(), rel

    run(["git", "checkout", "-q", "iteration-1"], root)  # pruned, but its checkpoint lives on as iteration 2's input
    restore = run(["dvc", "checkout"], root, check=False)
    assert restore.returncode != 0 and "state/policy" in restore.stderr and CHECKPOINT not in restore.stderr
    assert md5(root / CHECKPOINT / "model.safetensors") == weights[1]
    run(["git", "checkout", "-q", "iteration-2"], root)  # kept: everything comes back
    run(["dvc", "checkout"], root)
    assert md5(root / CHECKPOINT / "model.safetensors") == weights[2]
    assert md5(root / "state/policy/model.safetensors") == weights[1]
