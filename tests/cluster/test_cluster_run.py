"""`rlpipe run -n 2 --cluster` on the session's three-node cluster: each stage on the node its resources
name, every artifact byte-identical to the run on one machine, both iteration tags restorable."""
from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import (NODE_OF, PLACED, artifact_bytes, restored, rlpipe, without_timings)
from tests.e2e.conftest import make_project

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def on_cluster(ray_cluster, tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("on_cluster"), {"cluster.stages": PLACED})
    proc = rlpipe(["run", "-n", "2", "--cluster", ray_cluster.address], root)
    return root, proc


def test_each_stage_runs_on_the_node_its_resources_name(on_cluster, tmp_path):
    root, _ = on_cluster
    for k in (0, 1):
        clone = restored(root, f"iteration-{k}", tmp_path / f"clone{k}")
        for stage, node in NODE_OF.items():
            record = json.loads((clone / "metrics" / f"{stage}.json").read_text())["cluster"]
            assert (record["node"], record["placed"], record["attempt"]) == (node, "ray", 1), stage
        assert json.loads((clone / "metrics" / "reference_logprob.json").read_text())["cluster"]["placed"] == "ray"
        # a stage the cluster section does not name ran on the driver, and says so
        assert json.loads((clone / "metrics" / "advantage.json").read_text())["cluster"]["placed"] == "driver"


def test_both_iterations_are_byte_identical_to_one_machine(on_cluster, one_machine, tmp_path):
    root, _ = on_cluster
    for k in (0, 1):
        ours = restored(root, f"iteration-{k}", tmp_path / f"cluster{k}")
        theirs = restored(one_machine, f"iteration-{k}", tmp_path / f"one{k}")
        mine, reference = artifact_bytes(ours), artifact_bytes(theirs)
        assert sorted(mine) == sorted(reference) and len(mine) > 10
        assert [rel for rel in reference if mine[rel] != reference[rel]] == []
        for metrics in sorted((theirs / "metrics").glob("*.json")):
            assert without_timings(json.loads((ours / "metrics" / metrics.name).read_text())) == \
                without_timings(json.loads(metrics.read_text())), metrics.name
        # one machine's metrics files never name a node: nothing changes without --cluster
        assert "cluster" not in json.loads((theirs / "metrics" / "train.json").read_text())
    assert (root / "dvc.lock").read_text().count("md5") > 0
    assert rlpipe(["run", "--until", "2", "--cluster", "off"], root).stdout == ""  # nothing left to do


def test_stage_lines_stream_back_prefixed_with_stage_and_node(on_cluster):
    _, proc = on_cluster
    lines = (proc.stdout + proc.stderr).splitlines()
    assert any(line.startswith("[train@train-node] rlpipe train: steps=") for line in lines)
    assert any(line.startswith("[score@score-node] rlpipe score: rows=") for line in lines)
    assert any(line.startswith("[generate@gen-node] rlpipe generate: rows=") for line in lines)
    assert "Running stage 'train' on the Ray cluster:" in proc.stdout


def test_a_bad_address_is_one_clear_line_and_exit_2(tmp_path):
    root = make_project(tmp_path / "p")
    proc = rlpipe(["run", "-n", "1", "--cluster", "127.0.0.1:9"], root, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("rlpipe: error: no Ray cluster answers at 127.0.0.1:9")
    proc = rlpipe(["run", "-n", "1", "--cluster", "ray:/head"], root, check=False)
    assert proc.returncode == 2 and "--cluster: 'ray:/head' is not a Ray address" in proc.stderr
    assert not (root / "dvc.lock").exists()  # nothing ran
