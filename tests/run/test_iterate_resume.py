"""rlpipe.run.iterate: how an interrupted `advance` is recognised (the end-to-end resumes are in tests/e2e/test_long_runs.py)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from rlpipe.config import load_params
from rlpipe.run.iterate import _only_state_changed, handover_started
from rlpipe.run.repo import STATE_POLICY
from tests.shipped import shipped_params

PARAMS = shipped_params()


@pytest.mark.parametrize(("entry", "only_state"), [
    ({"changed deps": {"state/policy": "modified"}}, True),  # generate/train after state/policy was replaced
    ({"changed outs": {"state/policy": "modified"}}, True),  # state/policy.dvc before its `dvc add`
    ({"changed deps": {"state/policy": "modified", "artifacts/generate/rollouts.parquet": "modified"}}, False),
    ({"changed deps": {"params.yaml": {"train.lr": "modified"}}}, False),  # a params edit is never explained
    ({"changed outs": {"artifacts/train/checkpoint": "deleted"}}, False),
    ({"changed deps": {"statement.txt": "modified"}}, False),  # a path that merely starts with "state"
    ("changed command", False),
    ("always changed", False),
])
def test_only_changes_under_state_are_explained_by_a_handover(entry, only_state):
    assert _only_state_changed(entry) is only_state


def write_version(model_dir: Path, version: int) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "rlpipe.json").write_text(json.dumps({"policy_version": version}))


@pytest.mark.parametrize(("checkpoint", "state", "started"), [
    (3, 2, False),     # iteration 2 trained, hand-over not begun
    (3, 3, True),      # state/policy already holds the new policy
    (3, None, False),  # no state yet and no swap in progress
    (2, 2, False),     # the iteration has not been trained (or its train stage was killed)
    (None, 3, False),
])
def test_handover_started(tmp_path, checkpoint, state, started):
    params = dataclasses.replace(load_params(PARAMS), iteration=2)
    if checkpoint is not None:
        write_version(tmp_path / params.paths.checkpoint, checkpoint)
    if state is not None:
        write_version(tmp_path / STATE_POLICY, state)
    assert handover_started(tmp_path, params) is started


def test_handover_started_when_killed_inside_the_directory_swap(tmp_path):
    params = load_params(PARAMS)
    write_version(tmp_path / params.paths.checkpoint, 1)  # iteration 0 trained
    write_version(tmp_path / "state/.policy.tmp-12345", 1)  # the new copy, not yet renamed into place
    assert handover_started(tmp_path, params)


def test_a_stale_git_index_lock_is_removed_and_a_held_one_refused(tmp_path, capsys):
    """kill -9 in a git write (rlpipe iterate's commit, DVC's autostage) leaves .git/index.lock; every later git
    write then fails. A lock no process holds is removed; one a process holds open is refused, naming it."""
    import subprocess

    from rlpipe.errors import RlpipeError
    from rlpipe.run.iterate import release_stale_index_lock

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert release_stale_index_lock(tmp_path) is False  # none: nothing to do
    lock = tmp_path / ".git" / "index.lock"
    lock.write_text("")
    with open(lock) as held:  # this process holds it, as a git command in progress does
        with pytest.raises(RlpipeError, match=rf"index.lock: held by process\(es\) \[{os.getpid()}\]"):
            release_stale_index_lock(tmp_path)
        assert lock.exists() and not held.closed
    assert release_stale_index_lock(tmp_path) is True
    assert not lock.exists() and "left by a git command that was killed" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    subprocess.run(["git", "add", "f"], cwd=tmp_path, check=True)  # git writes again
