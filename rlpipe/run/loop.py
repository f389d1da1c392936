"""`rlpipe run`: ``dvc repro`` + `rlpipe.run.iterate.advance`, iteration after iteration, until a target.

The target is absolute (params.yaml's ``iteration`` to reach), so the same call after a crash does
only what is left: ``dvc repro`` skips every stage that finished (their results are in dvc.lock
and the cache), and an advance that was cut short is finished before anything else runs.
With ``servers``, stages run in the warm stage server and generation in the engine server
(`rlpipe.run.servers`): the same outputs, without paying imports and engine start in every stage.

With ``policy.max_staleness`` S > 0 (overlapped iterations, docs/overlap.md), each iteration runs in
two steps: its sampling stages (`sampling_targets`: restored from the run cache when they ran
ahead), then the rest (train, evaluate...), during which the next iteration's sampling runs ahead
(`rlpipe.run.ahead`). With generation on GPUs of its own, the first step is only generate and
score, and the reference pass is in the second, on the training GPUs, so the generation GPUs never
wait for it.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable

from rlpipe.cluster.executor import open_executor
from rlpipe.config import Params, load_params
from rlpipe.errors import RlpipeError
from rlpipe.run import dvc, policies
from rlpipe.run.iterate import advance, finish_interrupted_start, handover_started
from rlpipe.run.params_file import set_params

def run_iterations(root: str | Path = ".", *, until: int, params_file: str = "params.yaml", commit: bool = True,
                   servers: bool = True, max_staleness: int | None = None,
                   on_iteration: Callable[[dict[str, Any]], None] | None = None,
                   push: bool | None = None, cluster: str | None = None) -> list[dict[str, Any]]:
    """Run iterations until params.yaml says iteration ``until``; returns their history rows.

    ``max_staleness``: sets ``policy.max_staleness`` in params.yaml first (None: keep what it says).
    ``push``: `dvc push` each recorded iteration (None: ``iterate.push`` decides).
    ``cluster``: ``--cluster``'s value (a Ray address, ``ray`` or ``off``); None: params.yaml's
    ``cluster.address`` decides. On a cluster, the stages ``cluster.stages`` names run as Ray tasks
    (`rlpipe.cluster`) while DVC records them here.
    """
    from rlpipe.run.ahead import Prefetch
    from rlpipe.run.servers import RunServers, environment

    root = Path(root).resolve()
    rows: list[dict[str, Any]] = []
    if commit:
        finish_interrupted_start(root, params_file=params_file)
    params = load_params(root / params_file)
    if max_staleness is not None and max_staleness != params.policy.max_staleness:
        set_params(root / params_file, {"policy.max_staleness": max_staleness})
        params = load_params(root / params_file)
    if params.iteration >= until:
        return rows
    executor = open_executor(root, params, cluster)
    if executor is not None:
        executor.warm = executor.warm and servers  # --no-servers: no warm stage server on the nodes either
        executor.start_node_servers(root)  # warming on the nodes while prepare runs here
    # the main pipeline's stages (train above all) on their GPUs
    with environment("CUDA_VISIBLE_DEVICES", params.worker.train_devices):
        with RunServers(root, params) if servers else _NoServers() as running:
            ahead = (Prefetch(root, log=sys.stdout, cluster=executor.address if executor is not None else None)
                     if params.policy.max_staleness else None)
            try:
                while (params := load_params(root / params_file)).iteration < until:
                    if executor is not None:
                        executor.cluster = params.cluster  # its stages' resources as params.yaml says now
                    clock = _Clock()
                    with clock("servers"):
                        running.refresh(params)
                    reproduced = False
                    if not handover_started(root, params):
                        if not (root / params.policy.path).exists():  # the tiny default: prepare makes the model
                            dvc.repro(root, ["prepare"], executor=executor)
                            running.refresh(params)
                        if ahead is not None:
                            with clock("wait_ahead"):
                                ahead.wait()  # iteration k's own prefetch, started during k-1: never sample twice
                            with clock("repro"):  # restores what ran ahead (runs it in iteration 0)
                                _repro(root, params.iteration, until, sampling_targets(params), clock.dvc, executor)
                            if params.iteration + 1 < until:
                                with clock("start_ahead"):
                                    _start_ahead(ahead, root, params, params_file, running.env_for_sampling())
                        with clock("repro"), running.for_training(params):
                            _repro(root, params.iteration, until, None, clock.dvc, executor)
                        reproduced = True
                    with clock("advance"):
                        row = advance(root, params_file=params_file, commit=commit, just_reproduced=reproduced,
                                      push=push)
                    # for on_iteration (benchmarks); not in the history
                    row = {**row, "run_seconds": clock.seconds, "dvc_seconds": clock.dvc_seconds()}
                    rows.append(row)
                    if on_iteration is not None:
                        on_iteration(row)
            finally:
                if ahead is not None:
                    ahead.close()
                if executor is not None:
                    executor.stop_node_servers()
    return rows


def sampling_targets(params: Params) -> list[str]:
    """What the loop reproduces before it starts the next iteration's sampling ahead.

    With generation on GPUs of its own, only the stages that ran ahead (restored from the run cache):
    the next sampling then starts before this iteration's reference pass, which runs on the training
    GPUs. With shared devices, every stage train reads (``dvc repro advantage``), as both sides compete
    for the same devices anyway.
    """
    from rlpipe.run.ahead import generation_has_own_devices, sampled_ahead

    return sampled_ahead(params, params.iteration) if generation_has_own_devices(params) else ["advantage"]


def _repro(root: Path, iteration: int, until: int, targets: list[str] | None, phases: dict[str, float],
           executor=None) -> None:
    try:
        dvc.repro(root, targets, phases=phases, executor=executor)
    except RlpipeError as e:
        raise RlpipeError(f"{e} (iteration {iteration}); fix the cause and run `rlpipe run --until {until}` to "
                          "resume") from None


def _start_ahead(ahead, root: Path, params, params_file: str, env: dict[str, str]) -> None:
    """Sample iteration k+1 ahead, from the version the schedule names (kept in the policy store)."""
    policies.keep(root, params.iteration, root / params.policy.latest_path)
    try:
        ahead.start(params, params_file, env=env)
    except RlpipeError as e:  # e.g. a version the store lacks after S was raised mid-run: no overlap this time
        print(f"rlpipe run: not sampling iteration {params.iteration + 1} ahead: {e}", flush=True)


class _Clock:
    """Seconds of each part of an iteration of the loop (DVC's repro, advance, waiting for the prefetch)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.dvc: dict[str, float] = {}  # DVC's phases within "repro" (rlpipe.run.dvc.DVC_PHASES)

    def dvc_seconds(self) -> dict[str, float]:
        return {name: round(s, 3) for name, s in sorted(self.dvc.items())}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t0, 3)


class _NoServers:
    def __enter__(self) -> "_NoServers":
        return self

    def for_training(self, params) -> AbstractContextManager:
        return nullcontext()

    def __exit__(self, *exc) -> None:
        pass

    def refresh(self, params) -> None:
        pass

    def env_for_sampling(self) -> dict[str, str]:
        return dict(os.environ)
