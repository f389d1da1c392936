"""`rlpipe run`: ``dvc repro`` + `rlpipe.iterate.advance`, iteration after iteration, until a target.

The target is absolute (params.yaml's ``iteration`` to reach), so the same call after a crash does
only what is left: ``dvc repro`` skips every stage that finished (their results are in dvc.lock
and the cache), and an advance that was cut short is finished before anything else runs.
With ``servers``, stages run in the warm stage server and generation in the engine server
(`rlpipe.run.servers`): the same outputs, without paying imports and engine start in every stage.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rlpipe.config import load_params
from rlpipe.errors import RlpipeError
from rlpipe.iterate import advance, finish_interrupted_start, handover_started
from rlpipe.run import dvc


def run_iterations(root: str | Path = ".", *, until: int, params_file: str = "params.yaml", commit: bool = True,
                   servers: bool = True,
                   on_iteration: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run iterations until params.yaml says iteration ``until``; returns their history rows."""
    from rlpipe.run.servers import RunServers

    root = Path(root)
    rows: list[dict[str, Any]] = []
    if commit:
        finish_interrupted_start(root, params_file=params_file)
    params = load_params(root / params_file)
    if params.iteration >= until:
        return rows
    with RunServers(root, params) if servers else _NoServers() as running:
        while (params := load_params(root / params_file)).iteration < until:
            running.refresh(params)
            reproduced = False
            if not handover_started(root, params):
                if not (root / params.policy.path).exists():  # the tiny default: prepare makes the model
                    dvc.repro(root, ["prepare"])
                    running.refresh(params)
                try:
                    dvc.repro(root)
                except RlpipeError as e:
                    raise RlpipeError(f"{e} (iteration {params.iteration}); fix the cause and run "
                                      f"`rlpipe run --until {until}` to resume") from None
                reproduced = True
            row = advance(root, params_file=params_file, commit=commit, just_reproduced=reproduced)
            rows.append(row)
            if on_iteration is not None:
                on_iteration(row)
    return rows


class _NoServers:
    def __enter__(self) -> "_NoServers":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def refresh(self, params) -> None:
        pass
