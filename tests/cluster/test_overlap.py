"""`rlpipe run --max-staleness 1 --cluster`: iteration k+1's sampling runs ahead on the generation node while
the training node trains k, and DVC adopts it from the run cache; the result is the overlapped run on one
machine, byte for byte."""
from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import PLACED, artifact_bytes, restored, rlpipe
from tests.e2e.conftest import make_project

pytestmark = pytest.mark.slow


def test_sampling_ahead_runs_on_the_generation_node(ray_cluster, tmp_path):
    reference = make_project(tmp_path / "one")
    rlpipe(["run", "-n", "2", "--max-staleness", "1"], reference)
    root = make_project(tmp_path / "p", {"cluster.stages": PLACED})
    proc = rlpipe(["run", "-n", "2", "--max-staleness", "1", "--cluster", ray_cluster.address], root)
    assert "sampling iteration 1 ahead" in proc.stdout
    assert "Stage 'generate' is cached - skipping run" in proc.stdout  # adopted from the run ahead
    assert "[generate@gen-node] rlpipe generate: rows=" in (root / ".rlpipe/ahead/prefetch.log").read_text()
    ours, theirs = restored(root, "iteration-1", tmp_path / "c1"), restored(reference, "iteration-1", tmp_path / "r1")
    for stage, node in (("generate", "gen-node"), ("score", "score-node"), ("train", "train-node")):
        assert json.loads((ours / "metrics" / f"{stage}.json").read_text())["cluster"]["node"] == node, stage
    assert artifact_bytes(ours) == artifact_bytes(theirs)
