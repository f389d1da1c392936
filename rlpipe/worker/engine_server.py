"""The engine server: one generation engine that outlives the generate and evaluate stages.

Why: on a GPU, building a vLLM engine costs 40-60 s per stage (its torch.compile, CUDA-graph capture,
memory profiling), every iteration, for a policy whose shape never changes. The engine server builds
it once per `rlpipe run`; each request names the policy directory to sample from, and the server
reloads the weights from that directory when its files changed since the last request (vLLM's
``reload_weights`` into the running engine, then its prefix cache is dropped). The stage still reads
its prompts and writes its table itself, so the table is the same whichever way it was generated
(`rlpipe.worker.engine_client.RemoteEngine`).

The server's engine settings (engine kind, dtype, vLLM options) are fixed at start from params.yaml;
a stage whose params ask for other settings is declined and builds its own engine, so a request
never runs under settings its params do not state.

A LoRA policy (an adapter directory over a base, rlpipe/models/lora) is part of the fingerprint: the
adapter's files and its base's. vLLM serves it unmerged: the engine runs the base with LoRA enabled
(``--max-lora-rank``, from ``train.lora.rank``, so that a LoRA run's engine needs no rebuild when the
first adapter arrives), and each new adapter gets a new LoRA request. vLLM cannot load a checkpoint's
plain weight names into its LoRA-wrapped layers, so a LoRA engine never reloads its base: a changed
base gets a new engine. The hf engine reloads base and adapter through rlpipe.models.loading.load_model.

With ``--sleep`` (vLLM only), the engine frees its GPU memory between requests (vLLM sleep level 2:
weights and KV cache dropped, CUDA graphs kept) so that train and reference_logprob on the same GPU
get all of it; the next request wakes it and loads the weights it names. A LoRA engine sleeps at
level 1 instead: its base weights wait in CPU memory (the base's size in bf16) and come back on wake.

    python -P -m rlpipe.worker.engine_server --project DIR --settings JSON --model DIR [--sleep] [--max-lora-rank R] [--kind engine|train-engine]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path

from rlpipe.worker import wire

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")


def weights_fingerprint(model_dir: str | os.PathLike) -> tuple:
    """What identifies the weights in a model directory: its real path and its files' names, sizes and mtimes.

    Cheap (no hashing of gigabytes): a new checkpoint, a `dvc checkout` or `rlpipe iterate` all
    rewrite the files, so any of them changes the fingerprint and the server reloads.
    """
    from rlpipe.models.lora.adapter import base_dir, is_adapter_dir

    root = Path(model_dir).resolve()
    files = []
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in WEIGHT_SUFFIXES:
            st = f.stat()
            files.append((str(f.relative_to(root)), st.st_size, st.st_mtime_ns))
    if is_adapter_dir(root):  # a LoRA policy is its adapter and its base
        return (str(root), tuple(files), weights_fingerprint(base_dir(root)))
    return (str(root), tuple(files))


def architecture(model_dir: str | os.PathLike) -> dict:
    """config.json without the keys a trained checkpoint may change: a different rest needs a new engine."""
    from rlpipe.models.lora.adapter import model_dir_of

    config = json.loads((model_dir_of(model_dir) / "config.json").read_text())  # an adapter's: its base's
    for key in ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "architectures"):
        config.pop(key, None)
    return config


class EngineHost:
    """The engine behind the server: built from ``settings``; reloads weights when a request names new ones.

    ``settings``: what a stage must ask for to be served (see `rlpipe.worker.engine_client.engine_settings`);
    the EOS and pad ids are read from the start model here and are part of them.
    """

    def __init__(self, settings: dict, model_dir: str, *, sleep: bool, max_lora_rank: int | None = None) -> None:
        from rlpipe.models.loading import load_tokenizer, model_eos_token_ids

        tokenizer = load_tokenizer(model_dir)
        self.settings = {**settings, "eos_token_ids": model_eos_token_ids(model_dir, tokenizer),
                         "pad_token_id": int(tokenizer.pad_token_id)}
        self.sleep_between = sleep and settings["engine"] == "vllm"
        self.engine = None
        self.loaded: tuple | None = None
        self.architecture: dict | None = None
        self.asleep = False
        self.max_lora_rank = max_lora_rank  # vLLM: build with LoRA up to this rank (train.lora.rank), or None
        self.base_loaded: tuple | None = None  # vLLM: fingerprint of the base weights in the engine
        t0 = time.perf_counter()
        self._build(model_dir)
        self.start_seconds = time.perf_counter() - t0
        if self.sleep_between:
            self.engine.sleep()
            self.asleep = True

    def _build(self, model_dir: str) -> None:
        self.close()
        s = self.settings
        if s["engine"] == "vllm":
            from rlpipe.engines.vllm import VLLMEngine, lora_serving

            base, adapter, rank = lora_serving(model_dir)
            ranks = [r for r in (self.max_lora_rank, rank) if r]
            self.engine = VLLMEngine(base, dtype=s["dtype"], eos_token_ids=s["eos_token_ids"],
                                     tensor_parallel_size=s["tensor_parallel_size"],
                                     data_parallel_size=s["data_parallel_size"],
                                     engines_per_gpu=s.get("engines_per_gpu", 1),
                                     gpu_memory_utilization=s["gpu_memory_utilization"],
                                     enable_prefix_caching=s["enable_prefix_caching"],
                                     enforce_eager=s["enforce_eager"], max_model_len=s["max_model_len"],
                                     enable_sleep_mode=self.sleep_between, max_lora_rank=max(ranks) if ranks else None)
            if adapter is not None:
                self.engine.use_adapter(adapter)
            self.base_loaded = weights_fingerprint(base)
        else:
            from rlpipe.engines.hf import HFEngine
            from rlpipe.models.loading import load_model

            model = load_model(model_dir, device=s["device"], dtype=s["dtype"])
            self.engine = HFEngine.from_model(model, batch_size=s["batch_size"], eos_token_ids=s["eos_token_ids"],
                                              pad_token_id=s["pad_token_id"])
        self.loaded = weights_fingerprint(model_dir)
        self.architecture = architecture(model_dir)

    def generate(self, model_dir: str, requests, params) -> tuple[list, dict]:
        timings = {"wake": 0.0, "reload": 0.0, "rebuild": 0.0, "generate": 0.0, "sleep": 0.0}
        t = time.perf_counter()
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False
            timings["wake"] = time.perf_counter() - t
        fingerprint = weights_fingerprint(model_dir)
        t = time.perf_counter()
        if (architecture(model_dir) != self.architecture or not self._serves_lora_of(model_dir)
                or self._new_base_under_lora(model_dir)):
            self._build(model_dir)  # another model, an adapter this engine has no LoRA room for, a new LoRA base
            timings["rebuild"] = time.perf_counter() - t
        elif fingerprint != self.loaded or self.sleep_between:  # after sleep level 2 the weights are gone
            self._reload(model_dir)
            self.loaded = fingerprint
            timings["reload"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            results = self.engine.generate(requests, params)
        finally:
            timings["generate"] = time.perf_counter() - t
            if self.sleep_between:
                t = time.perf_counter()
                self.engine.sleep()
                self.asleep = True
                timings["sleep"] = time.perf_counter() - t
        return results, timings

    def _serves_lora_of(self, model_dir: str) -> bool:
        """vLLM: whether the running engine can take ``model_dir``'s adapter (LoRA on, rank within its maximum)."""
        from rlpipe.models.lora.adapter import adapter_config, is_adapter_dir

        if self.settings["engine"] != "vllm" or not is_adapter_dir(model_dir):
            return True
        return self.engine.max_lora_rank is not None and int(adapter_config(model_dir)["r"]) <= self.engine.max_lora_rank

    def _new_base_under_lora(self, model_dir: str) -> bool:
        """vLLM with LoRA: whether ``model_dir``'s base is not the one loaded (which it cannot reload in place)."""
        if self.settings["engine"] != "vllm" or self.engine.max_lora_rank is None:
            return False
        from rlpipe.engines.vllm import lora_serving

        return weights_fingerprint(lora_serving(model_dir)[0]) != self.base_loaded

    def _reload(self, model_dir: str) -> None:
        if self.settings["engine"] == "vllm":
            from rlpipe.engines.vllm import lora_serving

            base, adapter, _ = lora_serving(model_dir)
            base_print = weights_fingerprint(base)
            slept_away = self.sleep_between and not self.engine.keeps_weights_asleep
            if base_print != self.base_loaded or slept_away:  # the base itself changed (or sleep freed it)
                self.engine.reload_weights(base)
                self.base_loaded = base_print
            self.engine.use_adapter(adapter)  # a new LoRA request (new id) for new adapter weights; None: base alone
        else:
            self._build(model_dir)

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        self.engine = None


def _serve(listener, host: EngineHost, log) -> None:
    """Answer one connection at a time: a JSON control message (status, stop) or a pickled generate request."""
    served = 0
    while True:
        conn, _ = listener.accept()
        try:
            if not wire.same_user(conn):
                continue
            got = wire.recv_bytes(conn)
            if got is None:
                continue
            payload = got[0]
            if payload[:1] == b"{":  # control, from rlpipe.worker.lifecycle
                command = json.loads(payload).get("control")
                wire.send_json(conn, {"pid": os.getpid(), "served": served, "settings": host.settings,
                                      "start_seconds": round(host.start_seconds, 3), "asleep": host.asleep})
                if command == "stop":
                    print(f"rlpipe engine server: stopped on request after serving {served} request(s)", file=log, flush=True)
                    return
                continue
            request = pickle.loads(payload)
            if request["settings"] != host.settings:
                wanted, mine = request["settings"], host.settings
                diff = sorted(k for k in set(wanted) | set(mine) if wanted.get(k) != mine.get(k))
                reply = {"ok": False, "declined": True, "error": "its engine settings differ from the stage's: " + ", ".join(
                    f"{k} server {mine.get(k)!r} vs stage {wanted.get(k)!r}" for k in diff)}
            else:
                try:
                    results, timings = host.generate(request["model_dir"], request["requests"], request["params"])
                    reply = {"ok": True, "results": results, "timings": timings}
                    served += 1
                except Exception as e:  # noqa: BLE001 - reported to the stage, which fails with it
                    traceback.print_exc(file=log)
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            wire.send_bytes(conn, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
            print(f"rlpipe engine server: a connection failed: {e}", file=log, flush=True)
        finally:
            conn.close()


def _exit_with(owner: int) -> None:
    """When ``owner`` (the `rlpipe run` that started this server) exits, even by kill -9, stop: an orphaned
    engine would hold its GPU memory for nobody."""
    import select
    import threading

    pidfd = os.pidfd_open(owner)

    def watch() -> None:
        select.select([pidfd], [], [])
        print("rlpipe engine server: the run that started it is gone, exiting", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rlpipe-owner-watch", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description="rlpipe's generation engine server (rlpipe/worker/engine_server.py)")
    parser.add_argument("--project", default=".")
    parser.add_argument("--settings", required=True, help="engine settings as JSON (rlpipe.worker.engine_client)")
    parser.add_argument("--model", required=True, help="model directory to start the engine with")
    parser.add_argument("--sleep", action="store_true", help="vLLM: free GPU memory between requests")
    parser.add_argument("--kind", default="engine", choices=("engine", "train-engine"),
                        help="which of the project's engine servers this is (its socket address)")
    parser.add_argument("--owner", type=int, default=None, help="exit when the process with this pid exits")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="vLLM: serve LoRA adapters up to this rank")
    args = parser.parse_args()
    if args.owner is not None:
        _exit_with(args.owner)
    host = EngineHost(json.loads(args.settings), args.model, sleep=args.sleep, max_lora_rank=args.max_lora_rank)
    # Bound only once the engine is ready: until then `rlpipe worker status` finds no server and
    # `rlpipe.worker.lifecycle.start` keeps waiting.
    addr = wire.address(args.kind, args.project)
    listener = wire.listen(addr)
    signal.signal(signal.SIGTERM, lambda *_: (host.close(), os._exit(0)))
    print(f"rlpipe engine server: {host.settings['engine']} engine ready at {wire.printable(addr)} after "
          f"{host.start_seconds:.1f} s, pid {os.getpid()}", file=sys.stderr, flush=True)
    try:
        _serve(listener, host, sys.stderr)
    finally:
        host.close()
        listener.close()
    sys.stderr.flush()
    os._exit(0)  # vLLM's atexit hooks can stall on a closed engine; everything is shut down already


if __name__ == "__main__":
    main()
