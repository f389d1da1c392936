"""A warm stage server on every node a stage can land on, started as soon as `rlpipe run` joins the cluster.

Why: a stage forked from a process that imported torch & co. once starts in milliseconds instead of
seconds (rlpipe/worker/stage_server.py, docs/fixed-cost.md). Started by the first stage placed on a node
(as it was), the server's warm-up (~9 s on the 2-core CPU box) ran beside that stage and the next, each
importing the same libraries in a fresh process on the same cores. Started when the driver attaches, it
warms while prepare and the driver's own stages run; and a stage placed on a node waits for that node's
server to answer (`server_for_stage`) rather than import everything a second time beside it.

Who owns a server: a `NodeServer`, a Ray actor pinned to its node that asks for no resources (it never
keeps a stage from being placed), named by node and project in the ``rlpipe`` namespace so that every
node task of the run, and a driver sampling ahead, finds it. The server exits with the actor (``--owner``):
a node lost, or the driver gone (Ray ends its job's actors), leaves no server behind. A server killed
after it had served is started again for the next stage (which waits for it); one that dies warming
leaves its node's stages to run in their own processes, as with no server.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from typing import Any

from rlpipe.cluster import placement
from rlpipe.config import ClusterConfig

NAMESPACE = "rlpipe"
READY_TIMEOUT_S = 300.0  # longer than any warm-up (torch from a network filesystem): else the stage runs alone
_POLL_S = 0.05
_ACTOR: Any = None
_PRESTART: Any = None


def server_name(node_id: str, project: str) -> str:
    """The abstract socket name of ``project``'s stage server on node ``node_id``, and its actor's name
    (nodes simulated on one machine share the abstract socket namespace: the node is in the key)."""
    key = hashlib.sha256(f"{os.getuid()}\0{node_id}\0{os.path.realpath(project)}".encode()).hexdigest()[:24]
    return f"rlpipe-node-stage-{key}"


def listener(name: str) -> int | None:
    """The pid of the process listening at ``name`` (it listens only once warm), or None.

    By pid, not by a connection alone: a killed server's socket can still accept for a moment after it died."""
    import socket
    import struct

    from rlpipe.worker import wire

    try:
        sock = wire.connect("\0" + name, timeout=1.0)
    except OSError:
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
    finally:
        sock.close()
    return pid


class NodeServer:
    """The Ray actor that starts its node's stage server at once and tells each stage when it answers."""

    def __init__(self, project: str, env: dict[str, str], node_id: str) -> None:
        self.project, self.env, self.name = project, env, server_name(node_id, project)
        self.log = os.path.join(project, ".rlpipe", "logs", f"node-stage-{node_id[:12]}.log")
        self.lock = threading.Lock()
        self.served_once = False  # it answered once: if it dies later (killed), it is started again
        self.proc = self._launch()

    def _launch(self) -> subprocess.Popen:
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        argv = [sys.executable, "-P", "-m", "rlpipe.worker.stage_server", "--project", self.project,
                "--address", "@" + self.name, "--owner", str(os.getpid()), "--idle-timeout", "3600"]
        with open(self.log, "ab") as log:
            return subprocess.Popen(argv, cwd=self.project, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env=self.env, start_new_session=True)

    def pid(self) -> int:
        """The server's process id (what tests kill)."""
        return self.proc.pid

    def ready(self, timeout: float) -> str | None:
        """``@name`` once the server answers, waiting for it while it warms; None when it died warming or
        did not answer within ``timeout`` (the stage then runs in its own process)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.proc.poll() is not None:
                    if not self.served_once:
                        return None  # died while warming (its log says why): no second try in this run
                    self.served_once = False  # killed after it had served: a new one, this stage waits for it
                    self.proc = self._launch()
                if listener(self.name) == self.proc.pid:
                    self.served_once = True
                    return "@" + self.name
            time.sleep(_POLL_S)
        return None


def _actor_class(ray):
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=16)(NodeServer)
    return _ACTOR


def worker_started() -> None:
    """Nothing: run once on each node as the run attaches, so that Ray has started a worker process there for
    this driver's job (1.4 s on the loaded 2-core box) before the first stage is placed on it; Ray gives the
    stage's task that idle worker."""


def _prestart(ray):
    global _PRESTART
    if _PRESTART is None:
        _PRESTART = ray.remote(num_cpus=0, max_retries=0)(worker_started)
    return _PRESTART


def start_servers(ray, cluster: ClusterConfig, project: str, env: dict[str, str], started: dict[str, Any]) -> None:
    """A `NodeServer` on every alive node that can hold a one-process stage of ``cluster.stages`` (placement's
    own resource check) and has none in ``started`` (node id -> actor handle, kept: a handle keeps its actor).

    Not waited for: the servers warm while the driver goes on; beside each, a no-op task has Ray start a worker
    for the stages to come. Called when the run attaches, and again before each stage, for nodes that joined
    since."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plans = [p for p in (placement.stage_plan(cluster, s) for s in cluster.stages) if p and p.world_size == 1]
    for node in ray.nodes():
        node_id = node.get("NodeID")
        if not node.get("Alive") or node_id in started:
            continue
        if not any(placement.fits(p.per_node, node.get("Resources") or {}) for p in plans):
            continue
        on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
        started[node_id] = _actor_class(ray).options(name=server_name(node_id, project), namespace=NAMESPACE,
                                                     get_if_exists=True, scheduling_strategy=on_node
                                                     ).remote(project, env, node_id)
        _prestart(ray).options(scheduling_strategy=on_node).remote()


def server_for_stage(node_id: str, project: str, timeout: float = READY_TIMEOUT_S) -> tuple[str | None, float]:
    """In a node task: this node's stage server for ``project`` (``@name``) once it answers, and the seconds
    waited for it; (None, seconds) when the node has none (``rlpipe run --no-servers``, a node that joined
    mid-stage) or it cannot serve: the stage then runs in its own process."""
    import ray

    t0 = time.monotonic()
    try:
        keeper = ray.get_actor(server_name(node_id, project), namespace=NAMESPACE)
        address = ray.get(keeper.ready.remote(timeout))
    except (ValueError, ray.exceptions.RayError):  # no such actor, or it died (its node or driver gone)
        address = None
    return address, time.monotonic() - t0
