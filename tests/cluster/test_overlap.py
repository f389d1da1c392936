"""`rlpipe run --max-staleness 1 --cluster`: iteration k+1's sampling runs ahead on the generation node while
the training node trains k, and DVC adopts it from the run cache; the result is the overlapped run on one
machine, byte for byte, with a shared disk and without one (`cluster.data: remote`, an S3 remote)."""
from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import PLACED, artifact_bytes, restored, rlpipe, use_s3_remote
from tests.e2e.conftest import make_project

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def overlapped_one_machine(tmp_path_factory):
    reference = make_project(tmp_path_factory.mktemp("overlap") / "one")
    rlpipe(["run", "-n", "2", "--max-staleness", "1"], reference)
    return reference


@pytest.mark.parametrize("data", ["shared", "remote"])
def test_sampling_ahead_runs_on_the_generation_node(data, ray_cluster, overlapped_one_machine, request, tmp_path):
    root = make_project(tmp_path / "p", {"cluster.stages": PLACED, "cluster.data": data})
    if data == "remote":  # no shared disk: every stage's deps come from S3, its outs go back there
        use_s3_remote(root, request.getfixturevalue("s3_server"), "overlap")
    proc = rlpipe(["run", "-n", "2", "--max-staleness", "1", "--cluster", ray_cluster.address], root)
    assert "sampling iteration 1 ahead" in proc.stdout
    assert "Stage 'generate' is cached - skipping run" in proc.stdout  # adopted from the run ahead
    assert "[generate@gen-node] rlpipe generate: rows=" in (root / ".rlpipe/ahead/prefetch.log").read_text()
    ours = restored(root, "iteration-1", tmp_path / "c1")
    theirs = restored(overlapped_one_machine, "iteration-1", tmp_path / "r1")
    for stage, node in (("generate", "gen-node"), ("score", "score-node"), ("train", "train-node")):
        assert json.loads((ours / "metrics" / f"{stage}.json").read_text())["cluster"]["node"] == node, stage
    assert artifact_bytes(ours) == artifact_bytes(theirs)
