"""One local multi-node Ray cluster for the whole session (`ray.cluster_utils.Cluster`: each node a raylet
on this machine) and the one-machine run the cluster runs are compared with.

Nodes: a head with no CPUs (nothing lands on it), and three workers whose custom resources stand in for
the GPUs of a real cluster, so that each stage can only run where its resources name: ``gen-node``
(``gen``), ``score-node`` (``scorer``), ``train-node`` (``trainer``). ``score-node`` and ``train-node`` also
have ``ddp`` (one each): a two-node stage asks for it. Starting it costs ~10 s and ~1.3 GiB on the 2-core box.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import env, make_project, run

# Ray binds the machine's interface address unless told to stay on 127.0.0.1 (Ray 2.60, docs/cluster.md)
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0"}
os.environ.update(RAY_ENV)  # before Ray is imported
pytest.importorskip("ray", reason="the cluster tests need Ray: pip install -e '.[ray]'")

NODES = {"gen-node": {"gen": 1}, "score-node": {"scorer": 1, "ddp": 1}, "train-node": {"trainer": 1, "ddp": 1}}
# generate, score and train on three different nodes; reference_logprob and evaluate wherever a CPU is free
PLACED = {"generate": {"resources": {"gen": 1}}, "score": {"resources": {"scorer": 1}},
          "train": {"resources": {"trainer": 1}}, "reference_logprob": {"num_cpus": 1}, "evaluate": {"num_cpus": 1}}
NODE_OF = {"generate": "gen-node", "score": "score-node", "train": "train-node"}


class LocalCluster:
    """The session's cluster: its address, and its nodes by name (to kill one, or add one)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        os.environ.update(RAY_ENV)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * 2**20})
        self.nodes = {}
        for name, resources in NODES.items():
            self.add(name, resources)
        self.address = self.cluster.address

    def add(self, name: str, resources: dict[str, float]):
        self.nodes[name] = self.cluster.add_node(num_cpus=2, resources=resources, node_name=name,
                                                 object_store_memory=80 * 2**20)
        self.cluster.wait_for_nodes()
        return self.nodes[name]

    def kill(self, name: str) -> None:
        """kill -9 of every Ray process of the node (raylet, workers): a machine lost mid-stage."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


@pytest.fixture(scope="session")
def ray_cluster():
    local = LocalCluster()
    try:
        yield local
    finally:
        import ray

        ray.shutdown()
        local.cluster.shutdown()


@pytest.fixture(scope="session")
def driver(ray_cluster):
    """This test process joined to the cluster as a driver (for the executor, used in-process)."""
    from rlpipe.cluster.connect import connect

    connect(ray_cluster.address)
    return ray_cluster


def cluster_env() -> dict[str, str]:
    return {**env(), **RAY_ENV}


def rlpipe(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["rlpipe", *args], cwd=cwd, env=cluster_env(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlpipe {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def one_machine(tmp_path_factory) -> Path:
    """The tiny default's first two iterations on this machine, without a cluster: what every cluster run
    must reproduce byte for byte."""
    root = make_project(tmp_path_factory.mktemp("one_machine"))
    rlpipe(["run", "-n", "2"], root)
    return root


def restored(root: Path, tag: str, dest: Path) -> Path:
    """A fresh clone of ``root`` at ``tag`` with its DVC outputs checked out (from ``root``'s cache)."""
    run(["git", "clone", "-q", str(root), str(dest)], dest.parent)
    run(["git", "checkout", "-q", tag], dest)
    run(["dvc", "cache", "dir", "--local", str(root / ".dvc" / "cache")], dest)
    run(["dvc", "checkout"], dest)
    return dest


def artifact_bytes(root: Path) -> dict[str, bytes]:
    """Every file under artifacts/ by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "artifacts").rglob("*")) if p.is_file()}


def without_timings(value):
    """A metrics document without what differs from run to run by design: timings and the cluster record."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items()
                if k not in ("seconds", "cluster") and not k.endswith("_seconds")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def copy_project(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


S3_BUCKET = "rlpipe-cluster-test"


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server over HTTP on 127.0.0.1, with the bucket the remote-data runs push to."""
    pytest.importorskip("dvc_s3", reason="cluster.data: remote is tested through dvc-s3: pip install dvc-s3")
    moto_server = pytest.importorskip("moto.server", reason="the S3 server of the test: pip install 'moto[server]'")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=S3_BUCKET)
    yield endpoint
    server.stop()


def use_s3_remote(root: Path, endpoint: str, prefix: str) -> None:
    """Make the bucket's ``prefix`` the project's default DVC remote (keys in .dvc/config.local) and commit it."""
    for args in (["remote", "add", "-d", "store", f"s3://{S3_BUCKET}/{prefix}"],
                 ["remote", "modify", "store", "endpointurl", endpoint],
                 ["remote", "modify", "--local", "store", "access_key_id", "testing"],
                 ["remote", "modify", "--local", "store", "secret_access_key", "testing"]):
        run(["dvc", *args], root)
    run(["git", "commit", "-qam", "DVC remote on S3"], root)

