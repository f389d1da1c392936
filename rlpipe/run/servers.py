"""Which warm servers a run uses, from params.yaml's ``worker`` section, and their command lines.

The stage server is started for every run (``worker.stage_server``); the engine server only where
an engine is worth keeping (``worker.engine_server: auto`` = when generation runs on vLLM) and only
once the policy directory exists (the tiny default's ``prepare`` creates it in iteration 0).

Overlapped runs with generation on GPUs of its own (``worker.generate_devices`` and
``worker.train_devices`` set and different) get a second engine server, the *train engine*, on the
training GPUs: the generation engine is busy sampling the next iteration for minutes, and evaluate
would queue behind it (33-43 s an iteration on 2 H100s, BENCHMARKS.md). The train engine sleeps
(vLLM sleep mode) whenever it is not serving, so train gets the GPU memory.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Iterator
from pathlib import Path

from rlpipe.config import Params, compile_layers_wanted
from rlpipe.errors import RlpipeError
from rlpipe.models.lora.adapter import is_adapter_dir, is_policy_dir, model_dir_of
from rlpipe.run.ahead import generation_has_own_devices
from rlpipe.worker import lifecycle, wire
from rlpipe.worker.engine_client import ENV_SERVER as ENGINE_SERVER_ENV


def warm_dirs(root: Path, params: Params) -> list[str]:
    dirs = {params.policy.path, params.reference.path, params.paths.model_dir}
    # an adapter's config and tokenizer are its base's (a relative base path is relative to the project root)
    return sorted({str(root / model_dir_of(root / d)) if is_adapter_dir(root / d) else str(root / d)
                   for d in dirs if is_policy_dir(root / d)})


def stage_server_args(root: Path, params: Params) -> list[str]:
    args = []
    for d in warm_dirs(root, params):
        args += ["--warm", d]
    if stages_compile_layers(params):
        args.append("--warm-compiler")
    return args


def stages_compile_layers(params: Params) -> bool:
    """Whether reference_logprob or train compiles its decoder layers (on CUDA by default): then the stage
    server imports torch.compile's modules once for them."""
    return any(compile_layers_wanted(cfg.compile_layers, cfg.device) for cfg in (params.reference_logprob, params.train))


def wants_engine_server(params: Params) -> bool:
    setting = params.worker.engine_server
    if setting == "auto":
        from rlpipe.stages.generate import choose_engine

        return choose_engine(params.generate) == "vllm"
    return bool(setting)


@contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` for a block, then as it was (None: left alone). The stages DVC starts
    inherit this process's environment, so this is how a run points them at GPUs or a server."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def wants_train_engine(params: Params) -> bool:
    """Overlapped, with generation and training on different GPUs, and an engine server wanted at all."""
    return params.policy.max_staleness >= 1 and generation_has_own_devices(params) and wants_engine_server(params)


def engine_server_args(root: Path, params: Params) -> list[str]:
    from rlpipe.stages.generate import choose_engine
    from rlpipe.worker.engine_client import engine_settings

    g = params.generate
    settings = engine_settings(choose_engine(g), device=g.device, dtype=g.dtype, batch_size=g.batch_size, vllm=g.vllm)
    args = ["--settings", json.dumps(settings), "--model", str(root / params.policy.path)]
    if params.train.lora.enabled:  # room for the adapters train will write, from the first engine start on
        args += ["--max-lora-rank", str(params.train.lora.rank)]
    return args + (["--sleep"] if params.worker.engine_sleep else [])


class RunServers:
    """The servers of one `rlpipe run`: started on entry (or when they become possible), stopped on exit.

    A server that was already running (`rlpipe worker start`) is used and left running.
    """

    def __init__(self, root: str | os.PathLike, params: Params) -> None:
        self.root = Path(root).resolve()
        self.stack = ExitStack()
        self.engine_started = False
        self.train_engine: lifecycle.ServerInfo | lifecycle.Launched | None = None
        self.train_engine_failed = False
        self.params = params

    def __enter__(self) -> "RunServers":
        if self.params.worker.stage_server:
            self.stack.enter_context(lifecycle.serving("stage", self.root, stage_server_args(self.root, self.params)))
        self.refresh(self.params)
        return self

    def refresh(self, params: Params) -> None:
        """Warm the model dirs that exist now; start the engine server once it is wanted and its policy exists."""
        self.params = params
        if params.worker.stage_server:
            lifecycle.warm(self.root, warm_dirs(self.root, params))
        if self.engine_started or not wants_engine_server(params):
            return
        if not is_policy_dir(self.root / params.policy.path):
            return
        if wants_train_engine(params):  # on other GPUs: it starts while the generation engine starts
            self._launch_train_engine(params)
        env = dict(os.environ)
        if params.worker.generate_devices is not None:  # generation on its own GPUs (overlapped runs)
            env["CUDA_VISIBLE_DEVICES"] = params.worker.generate_devices
        self.stack.enter_context(lifecycle.serving("engine", self.root, engine_server_args(self.root, params), env=env))
        self.engine_started = True

    def for_training(self, params: Params) -> AbstractContextManager:
        """The main pipeline's stages after sampling (train, evaluate) use the train engine, where one is wanted."""
        return environment(ENGINE_SERVER_ENV, self._train_engine(params))

    def _train_engine(self, params: Params) -> str | None:
        """The train engine's address once it answers (launched with the generation engine, or now);
        None where none is wanted or it could not start."""
        if not (self.engine_started and wants_train_engine(params)) or self.train_engine_failed:
            return None
        if self.train_engine is None:
            self._launch_train_engine(params)
        if isinstance(self.train_engine, lifecycle.Launched):
            try:
                self.train_engine = lifecycle.wait_until_serving(self.train_engine)
            except RlpipeError as e:
                self._no_train_engine(params, e)
        return None if self.train_engine_failed else wire.printable(wire.address("train-engine", self.root))

    def _launch_train_engine(self, params: Params) -> None:
        """Start the train engine on the training GPUs, asleep between requests, without waiting for it:
        those GPUs are idle until iteration 0's sampling is done, the time its start takes."""
        if self.train_engine is not None or self.train_engine_failed:
            return
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = params.worker.train_devices
        # a compile cache of its own: two engines compiling the same graphs at once must not share one
        env["VLLM_CACHE_ROOT"] = str(self.root / ".rlpipe" / "cache" / "vllm-train-engine")
        args = engine_server_args(self.root, params)
        try:
            self.train_engine = lifecycle.launch("train-engine", self.root,
                                                 args + ([] if "--sleep" in args else ["--sleep"]),
                                                 env=env, owner=os.getpid())
        except OSError as e:
            self._no_train_engine(params, e)
            return
        if isinstance(self.train_engine, lifecycle.Launched):  # started here: stopped with the run
            self.stack.callback(lifecycle.stop, "train-engine", self.root)

    def _no_train_engine(self, params: Params, why: Exception) -> None:
        # e.g. no room on the training GPUs: evaluate waits for the generation engine instead
        print(f"rlpipe run: no train engine on GPUs {params.worker.train_devices}, evaluate uses the "
              f"generation engine: {why}", file=sys.stderr, flush=True)
        self.train_engine_failed = True

    def env_for_sampling(self) -> dict[str, str]:
        """The environment of a process that runs sampling stages elsewhere in the project (the prefetch of
        rlpipe.run.ahead): this run's servers named explicitly, on the generation GPUs (worker.generate_devices)."""
        env = dict(os.environ)
        if self.params.worker.stage_server:
            env["RLPIPE_STAGE_SERVER"] = wire.printable(wire.address("stage", self.root))
        if self.engine_started:
            env["RLPIPE_ENGINE_SERVER"] = wire.printable(wire.address("engine", self.root))
        if self.params.worker.generate_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.params.worker.generate_devices
        return env

    def __exit__(self, *exc) -> None:
        self.stack.close()
