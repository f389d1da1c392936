"""The node side: one Ray task per node of a stage runs the stage's command (one process per local rank)
and yields what the driver needs, as it happens.

Items yielded, in order: ``("node", name, node_id, ip)``; for node 0 of a multi-node stage
``("rendezvous", ip, port)`` (where rank 0 listens: every other node's ranks get it as MASTER_ADDR/PORT);
then ``("line", local_rank, "stdout"|"stderr", text)`` for each line the processes print; last
``("exit", [code per local rank])``, or ``("exit", [code], error)`` when the node cannot run the stage.

Why a generator task and not a Ray Job: each line reaches the driver within milliseconds (a Job's log
tail polls), no dashboard is needed, and the exit code is data, not a parsed status. Ray's own retry is
off for these tasks (the driver retries, `rlpipe.cluster.executor`): a retried generator would skip the
items the first attempt had already yielded, the node's name among them.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from rlpipe.cluster.node import ENV_ATTEMPT, ENV_NODE, ENV_NODE_ID, ENV_PLACED

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def this_node() -> tuple[str, str, str]:
    """(name, Ray node id, IP) of the node this Ray task runs on."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node.get("NodeName") or socket.gethostname(), node_id, node.get("NodeManagerAddress", "127.0.0.1")
    return socket.gethostname(), node_id, "127.0.0.1"


def free_port() -> int:
    """A TCP port free on this node now (the OS picks it; rank 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the Ray worker that started it dies (a node killed with
    kill -9, a cancelled task), so that no stage process outlives its task and writes after a retry began."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_on_node(job: dict[str, Any]) -> Iterator[tuple]:
    """Run ``job`` on this node (see the module docstring for what it yields).

    ``job``: ``commands`` (the stage's command lines, run one after another like DVC does), ``cwd``, ``env``
    (the driver's stage environment), ``attempt``, ``rank_envs`` (one dict per local rank: RANK, ... for a
    distributed stage, ``[{}]`` for a plain one), ``rendezvous`` (True on node 0 of a multi-node stage),
    ``data`` (None with a shared filesystem; else what `rlpipe.cluster.remote_data` moves).
    """
    name, node_id, ip = this_node()
    yield ("node", name, node_id, ip)
    env = dict(job["env"])
    env.update({ENV_NODE: name, ENV_NODE_ID: node_id, ENV_PLACED: "ray", ENV_ATTEMPT: str(job["attempt"]),
                "PYTHONUNBUFFERED": "1"})  # each line as it is printed, not a pipe's block at exit
    # Ray sets CUDA_VISIBLE_DEVICES to the task's GPUs; a task without GPUs gets none (not all of the node's)
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "") if job.get("num_gpus") else ""
    if job.get("rendezvous"):
        port = free_port()
        yield ("rendezvous", ip, port)
        job = {**job, "rank_envs": [{**r, "MASTER_ADDR": ip, "MASTER_PORT": str(port)} for r in job["rank_envs"]]}
    workspace = None
    if job.get("data") is not None:
        from rlpipe.cluster import remote_data

        try:
            workspace = remote_data.materialise(job["data"], env)
        except Exception as e:  # noqa: BLE001 - reported to the driver as the stage's error
            yield ("exit", [1], f"could not fetch the stage's inputs from the DVC remote on node {name}: {e}")
            return
    cwd = workspace or job["cwd"]
    if not os.path.isdir(cwd):
        yield ("exit", [1], f"the project directory {cwd} does not exist on node {name}: cluster.data: shared needs "
                            "every node to mount the project at the same path (else use cluster.data: remote)")
        return
    if job.get("warm") and workspace is None and job["rank_envs"] == [{}]:
        from rlpipe.cluster.warm import server_for_stage

        address, waited = server_for_stage(node_id, cwd)  # never a fresh import beside the server's own
        if address is not None:
            env["RLPIPE_STAGE_SERVER"] = address
        if waited >= 1.0:
            yield ("line", 0, "stderr", f"rlpipe: waited {waited:.1f} s for node {name}'s warm stage server"
                                        + ("" if address else "; the stage runs in its own process"))
    codes = yield from _run_ranks(job["commands"], cwd, env, job["rank_envs"])
    if workspace is not None and not any(codes):
        try:
            yield ("outs", remote_data.publish(job["data"], workspace, env))
        except Exception as e:  # noqa: BLE001 - reported to the driver as the stage's error
            yield ("exit", [1], f"could not push the stage's outputs to the DVC remote from node {name}: {e}")
            return
    yield ("exit", codes)


def post_on_node(job: dict[str, Any], mailbox: Any) -> None:
    """`run_on_node` for a driver connected through Ray Client (``ray://``), which cannot consume a streaming
    task: each item goes to ``mailbox`` (an actor the driver polls) as it happens, in order."""
    import ray

    last = None
    for item in run_on_node(job):
        last = mailbox.put.remote(item)
    if last is not None:
        ray.get(last)  # every item delivered before the task counts as finished


def _run_ranks(commands: list[str], cwd: str, env: dict[str, str], rank_envs: list[dict[str, str]]):
    """Start one process per local rank, yield their lines as they come; returns their exit codes."""
    lines: queue.Queue = queue.Queue()
    procs = [_start(commands, cwd, {**env, **rank_env}) for rank_env in rank_envs]
    readers = []
    for local_rank, proc in enumerate(procs):
        for stream_name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            t = threading.Thread(target=_pump, args=(stream, local_rank, stream_name, lines), daemon=True)
            t.start()
            readers.append(t)
    open_streams = len(readers)
    while open_streams:
        item = lines.get()
        if item is None:
            open_streams -= 1
            continue
        yield item
    return [proc.wait() for proc in procs]


def _start(commands: list[str], cwd: str, env: dict[str, str]) -> subprocess.Popen:
    """The stage's commands in bash, which runs a single command in its own process (exec), so that the
    parent-death signal reaches the stage's Python itself."""
    script = "set -e\n" + "\n".join(commands) if len(commands) > 1 else commands[0]
    return subprocess.Popen(["bash", "--noprofile", "--norc", "-c", script], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", bufsize=1, preexec_fn=_die_with_parent)


def _pump(stream, local_rank: int, stream_name: str, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(("line", local_rank, stream_name, line.rstrip("\n")))
    lines.put(None)
