"""Faults on the cluster: the node running train killed with kill -9 (all its Ray processes) -> train runs
again on another node and the run completes, byte-identical; the driver killed -> `rlpipe run` again
resumes and completes, byte-identical.

train runs longer here (train.epochs: 160, ~16 s) so that the kill lands while it computes: forked from the
node's warm stage server, 40 epochs (~4 s) ended before the spare node had joined. The reference is the same
project run on one machine. Only train is placed on the cluster: the other stages run on the driver
(in its warm stage server), which keeps these runs short.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import artifact_bytes, cluster_env, rlpipe
from tests.e2e.conftest import make_project

pytestmark = pytest.mark.slow
LONG_TRAIN = {"train.epochs": 160}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = make_project(tmp_path_factory.mktemp("fault_reference"), LONG_TRAIN)
    rlpipe(["run", "-n", "1"], root)
    return root


def stage_processes(script: str, node: str | None = None) -> list[int]:
    """pids of stage processes running ``script`` (on ``node``: their RLPIPE_CLUSTER_NODE)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.decode(errors="replace").endswith(script) for arg in argv) and (
                node is None or f"RLPIPE_CLUSTER_NODE={node}".encode() in environ):
            pids.append(int(entry.name))
    return pids


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_run(root: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(["rlpipe", "run", "-n", "1", "--cluster", address], cwd=root, env=cluster_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_killed_train_node_means_train_runs_again_elsewhere(ray_cluster, reference, tmp_path):
    root = make_project(tmp_path / "p", {**LONG_TRAIN, "cluster.stages": {"train": {"resources": {"trainer": 1}}}})
    proc = start_run(root, ray_cluster.address)
    try:
        victims = wait_for(lambda: stage_processes("stages/train.py", "train-node"), 300, "train on train-node")
        time.sleep(1.0)  # into its imports and training
        ray_cluster.add("train-spare", {"trainer": 1})  # the only other node train's resources fit
        ray_cluster.kill("train-node")
        # the stage process died with its Ray worker: nothing of attempt 1 writes after attempt 2 began
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in victims), 10, "train-node's train to die")
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
        ray_cluster.add("train-node", {"trainer": 1, "ddp": 1})  # the session's layout for the tests after
        ray_cluster.kill("train-spare")
    assert proc.returncode == 0, out
    assert "rlpipe run: train: lost train-node (" in out and "(attempt 2 of 3)" in out
    record = json.loads((root / "metrics" / "train.json").read_text())["cluster"]
    assert (record["node"], record["attempt"]) == ("train-spare", 2)
    assert artifact_bytes(root) == artifact_bytes(reference)


def test_a_killed_driver_resumes_with_the_same_bytes(ray_cluster, reference, tmp_path):
    root = make_project(tmp_path / "p", {**LONG_TRAIN, "cluster.stages": {"train": {"resources": {"trainer": 1}}}})
    proc = start_run(root, ray_cluster.address)
    victims = wait_for(lambda: stage_processes("stages/train.py", "train-node"), 300, "train on train-node")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    # the driver's Ray job ended with it: Ray stops its task, and the stage process dies with its worker
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in victims), 30, "the orphaned train to die")
    again = rlpipe(["run", "--until", "1", "--cluster", ray_cluster.address], root)
    assert "Stage 'score' didn't change, skipping" in again.stdout  # resumed: what finished is not run again
    assert "[train@train-node] rlpipe train: steps=" in again.stderr
    assert artifact_bytes(root) == artifact_bytes(reference)
