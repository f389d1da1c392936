"""`cluster.data: remote`: no shared disk. Each stage's task fetches its deps by hash from an S3 remote
(dvc-s3, the plugin users use, against moto's standalone S3 server over HTTP on 127.0.0.1) into a working
directory and DVC cache of its node's own, runs, and pushes its outs; the driver pulls them by hash and
DVC records them. The result is byte-identical to the run on one machine."""
from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import NODE_OF, PLACED, artifact_bytes, restored, rlpipe, use_s3_remote, without_timings
from tests.e2e.conftest import make_project, run

pytestmark = pytest.mark.slow


def test_two_nodes_without_a_shared_disk_match_one_machine(ray_cluster, s3_server, one_machine, tmp_path):
    root = make_project(tmp_path / "p", {"cluster.stages": PLACED, "cluster.data": "remote"})
    use_s3_remote(root, s3_server, "dvc")
    proc = rlpipe(["run", "-n", "1", "--cluster", ray_cluster.address], root)
    assert "[train@train-node] rlpipe train: steps=" in proc.stderr
    for stage, node in NODE_OF.items():
        assert json.loads((root / "metrics" / f"{stage}.json").read_text())["cluster"]["node"] == node
    theirs = restored(one_machine, "iteration-0", tmp_path / "one")
    ours = restored(root, "iteration-0", tmp_path / "ours")
    assert artifact_bytes(ours) == artifact_bytes(theirs)
    for metrics in sorted((theirs / "metrics").glob("*.json")):
        assert without_timings(json.loads((ours / "metrics" / metrics.name).read_text())) == \
            without_timings(json.loads(metrics.read_text())), metrics.name
    # the outputs went through the remote: a fresh clone gets iteration 0 from S3 alone
    fresh = tmp_path / "fresh"
    run(["git", "clone", "-q", str(root), str(fresh)], tmp_path)
    run(["git", "checkout", "-q", "iteration-0"], fresh)
    for args in (["remote", "modify", "--local", "store", "access_key_id", "testing"],
                 ["remote", "modify", "--local", "store", "secret_access_key", "testing"]):
        run(["dvc", *args], fresh)
    run(["dvc", "pull", "artifacts/train/checkpoint", "artifacts/generate/rollouts.parquet"], fresh)
    assert (fresh / "artifacts/generate/rollouts.parquet").read_bytes() == \
        (theirs / "artifacts/generate/rollouts.parquet").read_bytes()
