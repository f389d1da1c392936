"""The executor against the session's cluster, on plain shell commands: placement, streaming, exit codes,
error lines, the environment a stage gets, and resources no node has."""
from __future__ import annotations

import io
import os
import signal
import time

import pytest

from rlpipe.cluster.executor import ClusterExecutor, StageFailed
from rlpipe.config import ClusterConfig, StageResourcesConfig
from rlpipe.errors import ConfigError


def executor(**stages) -> tuple[ClusterExecutor, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    cluster = ClusterConfig(stages={name: StageResourcesConfig(**kw) for name, kw in stages.items()})
    return ClusterExecutor(cluster, out=out, err=err), out, err


def test_lines_stream_back_in_order_with_the_stage_and_node(driver, tmp_path):
    ex, out, err = executor(score={"resources": {"scorer": 1}})
    ex.run("score", ["echo one; echo two >&2; echo three; echo $RLPIPE_CLUSTER_NODE $RLPIPE_STAGE_SERVER"],
           str(tmp_path), dict(os.environ))
    assert out.getvalue().splitlines() == ["[score@score-node] one", "[score@score-node] three",
                                          "[score@score-node] score-node off"]
    assert err.getvalue().splitlines() == ["[score@score-node] two"]
    assert ex.ran == {"score": "score-node"}


def test_a_failing_stage_keeps_its_exit_code_and_its_error_line(driver, tmp_path):
    ex, _, err = executor(train={"resources": {"trainer": 1}})
    with pytest.raises(StageFailed) as failed:
        ex.run("train", ["echo 'rlpipe train: error: train.lr must be > 0' >&2; exit 2"], str(tmp_path),
               dict(os.environ))
    assert failed.value.code == 2
    assert str(failed.value) == "train failed on train-node (exit 2): train.lr must be > 0"
    assert "[train@train-node] rlpipe train: error: train.lr must be > 0" in err.getvalue()


def test_the_stage_runs_in_the_project_directory_with_the_drivers_environment(driver, tmp_path):
    ex, out, _ = executor(generate={"resources": {"gen": 1}})
    (tmp_path / "marker").write_text("here")
    ex.run("generate", ["cat marker; echo \" $MY_SETTING\"; echo \"[$CUDA_VISIBLE_DEVICES]\""], str(tmp_path),
           {**os.environ, "MY_SETTING": "kept", "CUDA_VISIBLE_DEVICES": "0"})
    assert out.getvalue().splitlines() == ["[generate@gen-node] here kept", "[generate@gen-node] []"]


def test_a_missing_project_directory_names_the_node_and_the_setting(driver, tmp_path):
    ex, _, _ = executor(score={"resources": {"scorer": 1}})
    with pytest.raises(StageFailed, match=r"does not exist on node score-node: cluster.data: shared needs"):
        ex.run("score", ["true"], str(tmp_path / "absent"), dict(os.environ))


def test_resources_no_node_has_fail_at_once_naming_the_stage(driver, tmp_path):
    ex, _, _ = executor(train={"num_gpus": 1})
    with pytest.raises(ConfigError, match=r"cluster.stages.train: asks for 1 node\(s\) with CPU=1, GPU=1 each"):
        ex.run("train", ["true"], str(tmp_path), dict(os.environ))


# A stage script as rlpipe's stages start (`rlpipe.stages.runner`): handed to the node's warm stage server when
# one accepts it; says where it ran and, when forked by a server, that server's pid.
PROBE_STAGE = """import time
started = time.perf_counter()
from rlpipe.worker.stage_client import forward_if_served
forward_if_served(started)
import os
print("served by" if os.environ.get("RLPIPE_STAGE_CHILD") else "fresh process", os.getppid())
"""


def wait_until_gone(name: str, timeout: float = 30.0) -> None:
    """Until no process listens at the stage server address ``name``: a killed server with many threads
    (torch's) takes a moment to exit, and a stage that connects meanwhile runs in its own process."""
    from rlpipe.cluster.warm import listener

    deadline = time.monotonic() + timeout
    while listener(name) is not None:
        assert time.monotonic() < deadline, f"a server still listens at {name} {timeout} s after SIGKILL"
        time.sleep(0.05)


def test_a_nodes_server_warms_from_attach_and_its_stages_wait_for_it(driver, tmp_path):
    """The node's stage server starts when the run attaches, not with the first stage placed there; that stage
    is forked from it (waiting while it warms, never importing everything again beside it); a server killed
    after it served is started again for the next stage, which waits for the new one."""
    import ray

    from rlpipe.cluster.warm import server_name

    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "probe.py").write_text(PROBE_STAGE)
    ex, out, err = executor(score={"resources": {"scorer": 1}})
    ex.warm = True
    ex.start_node_servers(tmp_path)
    try:
        assert len(ex.node_servers) == 1  # only score-node has {scorer: 1}
        (node_id, keeper), = ex.node_servers.items()
        server = ray.get(keeper.pid.remote())
        ex.run("score", ["python stages/probe.py"], str(tmp_path), dict(os.environ))
        assert out.getvalue().splitlines() == [f"[score@score-node] served by {server}"], err.getvalue()
        os.kill(server, signal.SIGKILL)
        wait_until_gone(server_name(node_id, str(tmp_path)))
        ex.run("score", ["python stages/probe.py"], str(tmp_path), dict(os.environ))
        again = ray.get(keeper.pid.remote())
        assert again != server
        assert out.getvalue().splitlines()[1:] == [f"[score@score-node] served by {again}"], err.getvalue()
    finally:
        ex.stop_node_servers()
