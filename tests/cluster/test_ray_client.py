"""`rlpipe run --cluster ray://HOST:PORT`: a driver connected through Ray Client, as from a laptop or a login
node outside the cluster. Ray Client cannot consume streaming tasks, so node tasks post their lines to a
mailbox actor the driver polls (`rlpipe.cluster.executor`); the run must still stream each stage's lines
and write what one machine writes."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import RAY_ENV, artifact_bytes, cluster_env, restored, rlpipe
from tests.e2e.conftest import make_project

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client_address():
    """A one-node cluster started as `ray start --head --block` does it (Ray's test helper cannot start a
    working client server): its Ray Client address. Stopping the blocking process stops the node."""
    gcs, client = free_port(), free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray, "start", "--head", "--block", "--num-cpus", "2", "--resources", '{"trainer": 1}',
                             "--port", str(gcs), "--ray-client-server-port", str(client), "--include-dashboard",
                             "false", "--object-store-memory", str(80 * 2**20), "--node-ip-address", "127.0.0.1"],
                            env={**cluster_env(), **RAY_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # ready once a Ray Client driver sees the node's resources (the client port opens before the node registers)
    probe = [sys.executable, "-c", f"import ray; ray.init('ray://127.0.0.1:{client}'); "
                                   "assert ray.cluster_resources().get('trainer') == 1"]
    try:
        deadline = time.monotonic() + 180
        while subprocess.run(probe, env=cluster_env(), capture_output=True).returncode != 0:
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError("the Ray head with a client server did not start")
            time.sleep(1)
        yield f"ray://127.0.0.1:{client}"
    finally:
        head.terminate()
        head.wait(timeout=60)


def test_a_ray_client_driver_runs_an_iteration_as_one_machine_does(client_address, one_machine, tmp_path):
    root = make_project(tmp_path / "client", {"cluster.stages": {"train": {"resources": {"trainer": 1}},
                                                                 "generate": {"num_cpus": 1}}})
    proc = rlpipe(["run", "-n", "1", "--cluster", client_address], root)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert any(line.startswith("[train@") and "rlpipe train: steps=" in line for line in lines)
    assert any(line.startswith("[generate@") and "rlpipe generate: rows=" in line for line in lines)
    ours = restored(root, "iteration-0", tmp_path / "ours")
    theirs = restored(one_machine, "iteration-0", tmp_path / "theirs")
    mine, reference = artifact_bytes(ours), artifact_bytes(theirs)
    assert sorted(mine) == sorted(reference)
    assert [rel for rel in reference if mine[rel] != reference[rel]] == []
