"""Where each stage runs: the `cluster` section of params.yaml as per-stage plans, checked against the nodes.

Ray-free (plain data in, plain data out) so that the placement rules are tested without a cluster.
A stage named under ``cluster.stages`` runs as Ray work: one task per node, each starting
``processes_per_node`` processes of the stage's unchanged command; a stage not named there runs on the
driver, as without a cluster. A multi-node stage is one torch.distributed job: its node tasks sit in a
placement group of one bundle per node (STRICT_SPREAD: never two on one node), and its processes get the
variables torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT), the address being where rank 0 runs (`rlpipe.cluster.task`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlpipe.config import ClusterConfig, StageResourcesConfig
from rlpipe.errors import ConfigError

OFF = ("off", "none", "")
_HOST_PORT = re.compile(r"[A-Za-z0-9_.\-\[\]:]+:\d{1,5}")


def resolve_address(flag: str | None, setting: str | None, environ: Mapping[str, str]) -> str | None:
    """The Ray address to connect to, or None for no cluster.

    ``flag``: ``rlpipe run --cluster``'s value (wins); ``setting``: params.yaml's ``cluster.address``.
    ``ray`` means RAY_ADDRESS, else ``auto`` (the cluster started on this machine with ``ray start``).
    RAY_ADDRESS alone never turns the cluster on: a variable left in a shell must not move a run.
    """
    value, source = (flag, "--cluster") if flag is not None else (setting, "cluster.address")
    if value is None or value.strip().lower() in OFF:
        return None
    value = value.strip()
    if value == "ray":
        value, source = environ.get("RAY_ADDRESS", "").strip() or "auto", "RAY_ADDRESS"
    if value == "auto":
        return value
    rest = value[len("ray://"):] if value.startswith("ray://") else value
    if not _HOST_PORT.fullmatch(rest) or not 0 < int(rest.rsplit(":", 1)[1]) < 65536:
        raise ConfigError(f"{source}: {value!r} is not a Ray address; write ray (RAY_ADDRESS, else the cluster "
                          "started here), auto, HOST:6379 (the head's GCS port), ray://HOST:10001 (Ray Client), "
                          "or off")
    return value


@dataclass(frozen=True)
class StagePlan:
    """How one stage runs on the cluster: ``nodes`` tasks, each with ``per_node`` resources."""

    stage: str
    nodes: int
    processes_per_node: int
    per_node: dict[str, float] = field(default_factory=dict)  # Ray resources of one node task ("CPU", "GPU", custom)

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def num_gpus(self) -> float:
        return self.per_node.get("GPU", 0.0)

    def rank_envs(self, node_rank: int) -> list[dict[str, str]]:
        """The torchrun variables of each local rank on node ``node_rank`` ([{}] for a one-process stage:
        it then takes its single-process path, exactly as on one machine). MASTER_ADDR/PORT come later."""
        if self.world_size == 1:
            return [{}]
        ppn = self.processes_per_node
        return [{"RANK": str(node_rank * ppn + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(self.world_size),
                 "LOCAL_WORLD_SIZE": str(ppn), "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank)}
                for local in range(ppn)]

    def task_options(self) -> dict[str, Any]:
        """``.options(...)`` of one node task: num_cpus, num_gpus and custom resources."""
        custom = {k: v for k, v in self.per_node.items() if k not in ("CPU", "GPU")}
        return {"num_cpus": self.per_node.get("CPU", 0.0), "num_gpus": self.per_node.get("GPU", 0.0),
                "resources": custom}


def stage_plan(cluster: ClusterConfig, stage: str) -> StagePlan | None:
    """The plan of ``stage``, or None when it runs on the driver (not named under cluster.stages)."""
    wanted: StageResourcesConfig | None = cluster.stages.get(stage)
    if wanted is None:
        return None
    ppn = wanted.processes_per_node
    per_node = {"CPU": wanted.num_cpus * ppn, "GPU": wanted.num_gpus * ppn,
                **{name: amount * ppn for name, amount in wanted.resources.items()}}
    return StagePlan(stage=stage, nodes=wanted.nodes, processes_per_node=ppn,
                     per_node={k: v for k, v in per_node.items() if v > 0})


def check_stages(cluster: ClusterConfig, stages: list[str]) -> None:
    """Every stage ``cluster.stages`` names exists in dvc.yaml (a typo would quietly run it on the driver)."""
    unknown = sorted(set(cluster.stages) - set(stages))
    if unknown:
        raise ConfigError(f"cluster.stages: {unknown} not a stage of dvc.yaml; its stages: {sorted(stages)}")


def check_engines(cluster: ClusterConfig, *, tensor_parallel_size: int, data_parallel_size: int,
                  generation_on_gpu: bool) -> None:
    """What the vLLM stages ask for matches their engines.

    Every process of generate (``nodes`` x ``processes_per_node``) runs one engine on TP x DP GPUs of its
    node and samples a block of the prompts (`rlpipe.stages.generate`); tensor parallelism never crosses a
    node (an all-reduce per layer over the network). ``engines``, where written, must say that same number.
    evaluate runs one engine: its held-out set is small.
    """
    for stage in ("generate", "evaluate"):
        wanted = cluster.stages.get(stage)
        if wanted is None:
            continue
        world = wanted.nodes * wanted.processes_per_node
        if stage == "evaluate" and world > 1:
            raise ConfigError(f"cluster.stages.evaluate: nodes x processes_per_node = {world}, but evaluate runs one "
                              "engine; give it 1 node and 1 process (generate spreads over several)")
        if wanted.engines not in (1, world):
            raise ConfigError(f"cluster.stages.{stage}.engines: {wanted.engines}, but nodes x processes_per_node = "
                              f"{world}: each process of {stage} runs one engine, so set nodes and "
                              "processes_per_node to the engines you want (docs/cluster.md)")
        need = tensor_parallel_size * data_parallel_size
        if generation_on_gpu and wanted.num_gpus < need:
            raise ConfigError(f"cluster.stages.{stage}.num_gpus: {wanted.num_gpus:g} GPU(s) per process, but "
                              f"generate.vllm.tensor_parallel_size x data_parallel_size needs {need} for each "
                              "process's engine")


def check_feasible(plan: StagePlan, nodes: list[dict[str, float]]) -> None:
    """Fail now, naming the stage and what it asks, when no ``plan.nodes`` distinct alive nodes can ever hold
    one node task each; Ray itself would wait forever for resources no node has.

    ``nodes``: the total resources of each alive node (``ray.nodes()[i]["Resources"]``).
    """
    fitting = [n for n in nodes if fits(plan.per_node, n)]
    if len(fitting) < plan.nodes:
        have = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(n.items()) if _shown(k)) for n in nodes) or "none"
        raise ConfigError(
            f"cluster.stages.{plan.stage}: asks for {plan.nodes} node(s) with "
            f"{', '.join(f'{k}={v:g}' for k, v in sorted(plan.per_node.items())) or 'nothing'} each "
            f"({plan.processes_per_node} process(es) per node), but {len(fitting)} alive node(s) have that; "
            f"the nodes have: {have}")


def fits(per_node: Mapping[str, float], node: Mapping[str, float]) -> bool:
    """Whether a node with total resources ``node`` can ever hold one node task asking ``per_node``."""
    return all(node.get(k, 0.0) >= v - 1e-9 for k, v in per_node.items())


def _shown(resource: str) -> bool:
    return not resource.startswith("node:") and resource not in ("memory", "object_store_memory")
