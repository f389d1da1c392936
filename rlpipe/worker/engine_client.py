"""The stage side of the engine server: a `GenerationEngine` whose work happens in the project's engine server.

`remote_engine` returns one only when an engine server runs for this project with exactly the
settings the stage's params ask for (engine, dtype, device, batch size or vLLM options, EOS and pad
ids); otherwise None, and the stage builds its own engine as before. Either way the stage writes
the same table: the server runs the same engine code on the same requests.
"""
from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlpipe.engines.base import Completion, PromptRequest, SamplingParams
from rlpipe.worker import wire

ENV_SERVER = "RLPIPE_ENGINE_SERVER"  # "off": never use one; "@name": that server; unset: the project's own


def engine_settings(engine: str, *, device: str, dtype: str, batch_size: int, vllm: Any) -> dict:
    """The settings that decide what an engine computes, as the server compares them.

    hf: device, dtype and batch size (the batch layout changes float rounding); vllm: dtype and the
    ``generate.vllm`` options (its device is every GPU CUDA_VISIBLE_DEVICES shows).
    """
    if engine == "vllm":
        return {"engine": "vllm", "dtype": dtype, "tensor_parallel_size": vllm.tensor_parallel_size,
                "data_parallel_size": vllm.data_parallel_size, "engines_per_gpu": vllm.engines_per_gpu,
                "gpu_memory_utilization": vllm.gpu_memory_utilization,
                "enable_prefix_caching": vllm.enable_prefix_caching, "enforce_eager": vllm.enforce_eager,
                "max_model_len": vllm.max_model_len}
    return {"engine": "hf", "device": device, "dtype": dtype, "batch_size": batch_size}


class RemoteEngine:
    """Generation through the engine server; ``timings`` holds the server's seconds for the last call."""

    def __init__(self, addr: str, settings: dict, model_dir: str | os.PathLike) -> None:
        self.addr = addr
        self.settings = settings
        self.name = settings["engine"]  # the table records the engine that computed it, as without the server
        self.model_dir = str(Path(model_dir).resolve())
        self.timings: dict[str, float] = {}

    def generate(self, requests: Sequence[PromptRequest], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        sock = wire.connect(self.addr, timeout=10.0)
        try:
            wire.send_bytes(sock, pickle.dumps({"op": "generate", "settings": self.settings,
                                                "model_dir": self.model_dir, "requests": list(requests),
                                                "params": params}, protocol=pickle.HIGHEST_PROTOCOL))
            got = wire.recv_bytes(sock)
        finally:
            sock.close()
        if got is None:
            raise RuntimeError(f"the engine server {wire.printable(self.addr)} closed the connection without an answer "
                               "(see .rlpipe/worker/engine.log)")
        reply = pickle.loads(got[0])
        if not reply["ok"]:
            raise RuntimeError(f"the engine server {wire.printable(self.addr)} failed: {reply['error']}")
        self.timings = {k: round(v, 3) for k, v in reply["timings"].items()}
        if progress is not None:
            progress(sum(len(group) for group in reply["results"]))
        return reply["results"]


def remote_engine(settings: dict, *, model_dir: str | os.PathLike, eos_token_ids: Sequence[int],
                  pad_token_id: int, project: str | os.PathLike | None = None) -> RemoteEngine | None:
    """A `RemoteEngine` if this project's engine server runs with these settings, else None (with a note why)."""
    setting = os.environ.get(ENV_SERVER, "")
    if setting == "off":
        return None
    addr = "\0" + setting[1:] if setting.startswith("@") else wire.address("engine", project or os.getcwd())
    try:
        sock = wire.connect(addr, timeout=5.0)
    except OSError:
        return None  # no server: the usual case
    try:
        wire.send_json(sock, {"control": "status"})
        reply = wire.recv_json(sock)
    except OSError:
        reply = None
    finally:
        sock.close()
    if reply is None:
        return None
    full = {**settings, "eos_token_ids": sorted(int(t) for t in eos_token_ids), "pad_token_id": int(pad_token_id)}
    served = reply[0]["settings"]
    if served != full:
        diff = sorted(k for k in set(full) | set(served) if full.get(k) != served.get(k))
        what = "; ".join(f"{k}: server {served.get(k)!r}, stage {full.get(k)!r}" for k in diff)
        print(f"rlpipe: the engine server runs other settings ({what}); building this stage's own engine",
              file=sys.stderr)
        return None
    return RemoteEngine(addr, full, model_dir)
