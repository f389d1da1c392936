"""The driver side: run a stage's command as Ray tasks placed by its plan, print their lines as they
come, retry it when a node is lost, and hand DVC the exit code it would have had on one machine.

`rlpipe.run.dvc` calls `ClusterExecutor.cmd_run` in place of DVC's own ``cmd_run`` while `rlpipe run
--cluster` reproduces: DVC on the driver still decides what runs, hashes deps and outs, fills its cache
and run cache and writes dvc.lock, exactly as without a cluster; only where the command's processes run
changes. Why retries here and not Ray's ``max_retries``: a stage's writes are atomic (temp file + rename),
so running it again after its node died is safe, but the retry must be announced, run on a live node
with a fresh rendezvous for multi-node stages (the whole gang at once), and recorded (attempt number).
"""
from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rlpipe.cluster import placement
from rlpipe.cluster.connect import alive_node_resources, import_ray
from rlpipe.cluster.node import ENV_ATTEMPT, ENV_NODE, ENV_NODE_ID, ENV_PLACED, NODE_VARIABLES
from rlpipe.cluster.task import post_on_node, run_on_node
from rlpipe.config import ClusterConfig, Params
from rlpipe.errors import RlpipeError

# Not sent to a node: Ray decides its GPUs; Ray's, Slurm's and MPI's variables describe the driver's own
# process and break MPI-aware libraries elsewhere; the node record is the node's own.
_NOT_SENT_PREFIXES = ("RAY_", "SLURM_", "PMI_", "PMIX_", "OMPI_", "CUDA_VISIBLE_DEVICES", "RLPIPE_STAGE_SERVER")
PLACEMENT_TIMEOUT_S = 600.0
POLL_S = 0.2  # how often a Ray Client driver asks a node task's mailbox for its lines
_REMOTE_FUNCTION: Any = None
_POSTING_FUNCTION: Any = None
_MAILBOX: Any = None


class StageFailed(RlpipeError):
    """A stage's command exited non-zero on its node (``code``), or the stage could not run (code 1)."""

    def __init__(self, stage: str, code: int, message: str) -> None:
        super().__init__(message)
        self.stage, self.code = stage, code


def environment_for_nodes(env: dict[str, str]) -> dict[str, str]:
    """The stage environment the driver would give the command, minus what must not travel (above); the
    stage never hands itself to the driver's warm stage server from a node."""
    sent = {k: v for k, v in env.items() if not k.startswith(_NOT_SENT_PREFIXES) and k not in NODE_VARIABLES}
    sent["RLPIPE_STAGE_SERVER"] = "off"
    return sent


@dataclass
class Attempt:
    """What one attempt of a stage did: exit codes by node, the node names, a lost node, an error line."""

    nodes: int
    names: dict[int, str] = field(default_factory=dict)
    codes: dict[int, list[int]] = field(default_factory=dict)
    lost: str | None = None
    error: str | None = None
    outs: Any = None
    rendezvous: dict[str, str] = field(default_factory=dict)  # MASTER_ADDR/PORT, from node 0 of a multi-node stage
    launched: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)

    def exit_code(self) -> int:
        return next((c for node in sorted(self.codes) for c in self.codes[node] if c), 0)


class ClusterExecutor:
    """Runs the stages ``cluster.stages`` names on the Ray cluster the driver is connected to."""

    def __init__(self, cluster: ClusterConfig, *, out: TextIO | None = None, err: TextIO | None = None,
                 data: Any = None) -> None:
        self.cluster = cluster
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.data = data  # a `rlpipe.cluster.remote_data.RemoteData` when the nodes share no disk
        self.ran: dict[str, str] = {}  # stage -> node of its last run (what the benchmarks and tests read)
        self.address: str | None = None  # the cluster's address, for processes the driver starts (sampling ahead)
        self.warm = False  # a warm stage server on each node (worker.stage_server, unless `rlpipe run --no-servers`)
        self.client = False  # connected through Ray Client (ray://): node tasks post their items to a mailbox
        self.project: str | None = None  # set by `start_node_servers`: the project whose node servers this run keeps
        self.node_servers: dict[str, Any] = {}  # node id -> its `rlpipe.cluster.warm.NodeServer` actor

    def start_node_servers(self, project: str | Path) -> None:
        """Start a warm stage server on every node a stage of this run can land on, now, without waiting
        (`rlpipe.cluster.warm`): they warm while prepare and the driver's stages run. Only with a shared
        filesystem (a stage in a fetched workspace of mode b runs in its own process) and warm servers on;
        called by the one driver that runs the loop (a driver sampling ahead uses the same servers)."""
        if not self.warm or self.cluster.data != "shared":
            return
        self.project = os.fspath(project)
        self._ensure_node_servers()

    def stop_node_servers(self) -> None:
        """End the node servers this executor started (their actors; each server exits with its actor). A
        driver that exits needs no call: Ray ends its job's actors. For drivers that go on (tests, benchmarks)."""
        ray = import_ray()
        for actor in self.node_servers.values():
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(actor)
        self.node_servers.clear()

    def _ensure_node_servers(self) -> None:
        if self.project is None:
            return
        from rlpipe.cluster.warm import start_servers

        env = {k: v for k, v in environment_for_nodes(dict(os.environ)).items() if k != "RLPIPE_STAGE_SERVER"}
        start_servers(import_ray(), self.cluster, self.project, env, self.node_servers)

    def claims(self, stage: str) -> bool:
        return stage in self.cluster.stages

    def run(self, stage: str, commands: list[str], cwd: str, env: dict[str, str], data_job: Any = None) -> Any:
        """Run ``stage``'s commands on the cluster; returns what the node task reported as its outs (mode b).
        Raises `StageFailed` on a non-zero exit, or when its node was lost more than ``max_retries`` times."""
        plan = placement.stage_plan(self.cluster, stage)
        for attempt_no in range(1, self.cluster.max_retries + 2):
            placement.check_feasible(plan, alive_node_resources())
            self._ensure_node_servers()  # a node that joined since (a spare for a retry) gets one too
            attempt = self._attempt(plan, commands, cwd, environment_for_nodes(env), attempt_no, data_job)
            if attempt.lost is None:
                break
            where = ", ".join(sorted(set(attempt.names.values()))) or "its node"
            if attempt_no > self.cluster.max_retries:
                raise StageFailed(stage, 1, f"{stage}: lost {where} ({attempt.lost}) on attempt {attempt_no}, and "
                                            f"cluster.max_retries is {self.cluster.max_retries}")
            self._say(f"rlpipe run: {stage}: lost {where} ({attempt.lost}); running it again on a live node "
                      f"(attempt {attempt_no + 1} of {self.cluster.max_retries + 1})")
        self.ran[stage] = ",".join(attempt.names[n] for n in sorted(attempt.names))
        code = attempt.exit_code()
        if code:
            raise StageFailed(stage, code, f"{stage} failed on {self.ran[stage]} (exit {code})"
                                           + (f": {attempt.error}" if attempt.error else ""))
        return attempt.outs

    def _attempt(self, plan: placement.StagePlan, commands: list[str], cwd: str, env: dict[str, str],
                 attempt_no: int, data_job: Any) -> Attempt:
        ray = import_ray()
        group = _placement_group(ray, plan)
        events: queue.Queue = queue.Queue()
        attempt, gens = Attempt(plan.nodes), {}

        def launch(node_rank: int) -> None:
            job = {"commands": commands, "cwd": cwd, "env": env, "attempt": attempt_no, "num_gpus": plan.num_gpus,
                   "warm": self.warm,
                   "rank_envs": [{**r, **attempt.rendezvous} for r in plan.rank_envs(node_rank)], "rendezvous": node_rank == 0 and plan.nodes > 1,
                   "data": data_job}
            options = plan.task_options()
            if group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=node_rank)
            if self.client:
                mailbox = _mailbox_class(ray).remote()
                gens[node_rank] = _posting_function(ray).options(**options).remote(job, mailbox)
                drain, args = _drain_mailbox, (ray, gens[node_rank], mailbox, node_rank, events)
            else:
                gens[node_rank] = _remote_function(ray).options(**options).remote(job)
                drain, args = _drain, (ray, gens[node_rank], node_rank, events)
            attempt.launched.add(node_rank)
            threading.Thread(target=drain, args=args, daemon=True).start()

        try:
            launch(0)
            while attempt.finished != attempt.launched:
                node_rank, item = events.get()
                self._handle(plan, attempt, node_rank, item, launch, gens, ray)
        except BaseException:
            _cancel(ray, gens.values())  # Ctrl-C on the driver: nothing keeps running on the nodes
            raise
        finally:
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)
        return attempt

    def _handle(self, plan, attempt: Attempt, node_rank: int, item: tuple, launch, gens: dict, ray) -> None:
        kind = item[0]
        if kind == "node":
            attempt.names[node_rank] = item[1]
        elif kind == "rendezvous":
            attempt.rendezvous = {"MASTER_ADDR": item[1], "MASTER_PORT": str(item[2])}
            for other in range(1, plan.nodes):
                launch(other)
        elif kind == "line":
            _, local_rank, stream, text = item
            if stream == "stderr" and f"rlpipe {plan.stage}: error:" in text:
                attempt.error = text.split("error:", 1)[1].strip()
            self._print(self._prefix(plan, attempt, node_rank, local_rank) + text, stream)
        elif kind == "outs":
            attempt.outs = item[1]
        elif kind == "exit":
            attempt.codes[node_rank] = item[1]
            if len(item) > 2:
                attempt.error = item[2]
                self._print(self._prefix(plan, attempt, node_rank, 0) + f"error: {item[2]}", "stderr")
            if any(item[1]):  # the other nodes' ranks would wait for this one in their collectives forever
                _cancel(ray, [g for n, g in gens.items() if n != node_rank])
        elif kind == "lost":
            attempt.lost = attempt.lost or item[1]
            _cancel(ray, [g for n, g in gens.items() if n != node_rank])
        elif kind == "done":
            attempt.finished.add(node_rank)

    def _prefix(self, plan: placement.StagePlan, attempt: Attempt, node_rank: int, local_rank: int) -> str:
        node = attempt.names.get(node_rank, "?")
        if plan.world_size == 1:
            return f"[{plan.stage}@{node}] "
        return f"[{plan.stage} r{node_rank * plan.processes_per_node + local_rank}@{node}] "

    def _print(self, text: str, stream: str) -> None:
        target = self.err if stream == "stderr" else self.out
        print(text, file=target, flush=True)

    def _say(self, text: str) -> None:
        print(text, file=self.err, flush=True)


def _remote_function(ray):
    """`run_on_node` as a streaming Ray task without Ray's retries (the executor retries), made once."""
    global _REMOTE_FUNCTION
    if _REMOTE_FUNCTION is None:
        _REMOTE_FUNCTION = ray.remote(num_returns="streaming", max_retries=0)(run_on_node)
    return _REMOTE_FUNCTION


def _posting_function(ray):
    """`post_on_node` as a Ray task without Ray's retries: a Ray Client driver's way to run a stage."""
    global _POSTING_FUNCTION
    if _POSTING_FUNCTION is None:
        _POSTING_FUNCTION = ray.remote(max_retries=0)(post_on_node)
    return _POSTING_FUNCTION


class Mailbox:
    """Where a node task posts its items for a Ray Client driver, which takes them in order."""

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def put(self, item: tuple) -> None:
        self.items.append(item)

    def take(self) -> list[tuple]:
        items, self.items = self.items, []
        return items


def _mailbox_class(ray):
    global _MAILBOX
    if _MAILBOX is None:
        _MAILBOX = ray.remote(num_cpus=0, max_restarts=0)(Mailbox)
    return _MAILBOX


def _placement_group(ray, plan: placement.StagePlan):
    """One bundle per node, never two on one node, for a multi-node stage; None for a one-node stage."""
    if plan.nodes == 1:
        return None
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([dict(plan.per_node) for _ in range(plan.nodes)], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise StageFailed(plan.stage, 1, f"{plan.stage}: {plan.nodes} nodes with {plan.per_node} each were not "
                                         f"free within {PLACEMENT_TIMEOUT_S:.0f} s")
    return group


def _forward(ray, items, node_rank: int, events: queue.Queue, cleanup=None) -> None:
    """Put one node task's items on the driver's queue; a lost node or worker becomes ("lost", why), the task's
    own error ("exit", [1], why); ("done",) last, whatever happened."""
    try:
        for item in items:
            events.put((node_rank, item))
    except ray.exceptions.TaskCancelledError:
        pass  # cancelled by the executor because another node of the stage failed
    except ray.exceptions.RayTaskError as e:  # the task's own code raised: a bug, not a lost node
        events.put((node_rank, ("exit", [1], f"the cluster task failed: {str(e).strip().splitlines()[-1]}")))
    except ray.exceptions.RayError as e:
        events.put((node_rank, ("lost", type(e).__name__)))
    finally:
        if cleanup is not None:
            cleanup()
        events.put((node_rank, ("done",)))


def _drain(ray, gen, node_rank: int, events: queue.Queue) -> None:
    """Forward a streaming node task's items to the driver's loop."""
    _forward(ray, (ray.get(ref) for ref in gen), node_rank, events)


def _mailbox_items(ray, task, mailbox):
    """A posting node task's items, polled from its mailbox until the task ends; then the task's outcome."""
    while True:
        done, _ = ray.wait([task], timeout=POLL_S)
        yield from ray.get(mailbox.take.remote())
        if done:
            ray.get(task)  # raises the task's error, or its node lost
            return


def _drain_mailbox(ray, task, mailbox, node_rank: int, events: queue.Queue) -> None:
    """`_drain` for a Ray Client driver, which polls the task's mailbox; the mailbox goes with the task."""
    def kill_mailbox() -> None:
        try:
            ray.kill(mailbox)
        except Exception:  # noqa: BLE001 - gone with its node
            pass

    _forward(ray, _mailbox_items(ray, task, mailbox), node_rank, events, cleanup=kill_mailbox)


def _cancel(ray, gens) -> None:
    for gen in gens:
        try:
            ray.cancel(gen, force=True)
        except Exception:  # noqa: BLE001 - already finished or gone with its node
            pass


def driver_environment() -> dict[str, str]:
    """The node record of a stage that runs on the driver in a cluster run."""
    import ray

    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    name = next((n.get("NodeName") for n in ray.nodes() if n.get("NodeID") == node_id), None) if node_id else None
    return {ENV_NODE: name or socket.gethostname(), ENV_NODE_ID: node_id or "", ENV_PLACED: "driver",
            ENV_ATTEMPT: "1"}


def stage_commands(stage: Any) -> tuple[list[str], str]:
    """A DVC stage's command lines and working directory, as DVC's cmd_run would run them."""
    cmd = stage.cmd
    commands = cmd if isinstance(cmd, list) else cmd.splitlines()
    return [c for c in commands if c.strip()], os.fspath(Path(stage.wdir))


def dvc_cmd_run(executor: ClusterExecutor, original, stage: Any, dry: bool = False, run_env=None) -> None:
    """DVC's ``cmd_run(stage, dry, run_env)`` for a cluster run: the stage's command on the nodes its plan
    names, or, for a stage the cluster section does not name, DVC's own on the driver (with the driver as
    its recorded node). A failure raises DVC's own StageCmdFailedError, with the node and the stage's
    one-line error in it."""
    if dry:
        return original(stage, dry=dry, run_env=run_env)
    if not executor.claims(stage.name):
        return original(stage, dry=dry, run_env={**(run_env or {}), **driver_environment()})
    from dvc.stage.exceptions import StageCmdFailedError
    from dvc.stage.run import prepare_kwargs

    env = prepare_kwargs(stage, run_env=run_env)["env"]
    commands, cwd = stage_commands(stage)
    print(f"Running stage '{stage.addressing}' on the Ray cluster:", file=executor.out, flush=True)
    for cmd in commands:
        print(f"> {cmd}", file=executor.out, flush=True)
    data_job = executor.data.job_for(stage) if executor.data is not None else None
    try:
        outs = executor.run(stage.name, commands, cwd, env, data_job)
    except StageFailed as e:
        raise StageCmdFailedError(" && ".join(commands), f"{e.code}: {e}") from None
    if executor.data is not None:
        executor.data.adopt(stage, outs)


def open_executor(root: Path, params: Params, flag: str | None) -> ClusterExecutor | None:
    """Connect to the cluster that ``flag`` (``--cluster``) or ``cluster.address`` names and return the
    executor for `rlpipe.run.dvc.repro`; None for a run on this machine (Ray is then never imported)."""
    cluster, vllm = params.cluster, params.generate.vllm
    address = placement.resolve_address(flag, cluster.address, os.environ)
    if address is None:
        return None
    placement.check_engines(cluster, tensor_parallel_size=vllm.tensor_parallel_size,
                            data_parallel_size=vllm.data_parallel_size,
                            generation_on_gpu=params.generate.device.startswith("cuda"))
    import yaml

    from rlpipe.cluster.connect import connect

    dvc_yaml = root / "dvc.yaml"
    stages = list((yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}) if dvc_yaml.is_file() else []
    placement.check_stages(cluster, stages)
    connect(address)
    data = None
    if cluster.data == "remote":
        from rlpipe.cluster.remote_data import RemoteData

        data = RemoteData(root, cluster.remote)
    executor = ClusterExecutor(cluster, data=data)
    executor.address, executor.warm = address, params.worker.stage_server
    executor.client = address.startswith("ray://")
    return executor
