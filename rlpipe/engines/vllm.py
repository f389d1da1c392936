"""Generation with vLLM (the optional extra ``rlpipe[vllm]``), behind the same contract as the HF engine.

vLLM loads the weights itself from a model directory and must start in a process that has not
initialised CUDA (it spawns its own workers): build this engine before anything touches the GPU.
Nothing here imports vllm or torch at module import, so CPU machines never need vLLM.

What rlpipe asks of vLLM, and why (checked against vLLM 0.26.0's source):
- One request per prompt with ``n = G`` and ``seed`` = a value derived from ``PromptRequest.seed``.
  vLLM fans a request out into G child requests and seeds child j with ``seed + j``
  (``vllm/v1/engine/parallel_sampling.py``); its sampler draws per-request noise from (seed, position)
  only, so the randomness of a sample does not depend on which other prompts share the batch. The
  arithmetic can: vLLM's kernels are not bitwise reproducible across runs and batch shapes, and a
  near-tie can then flip a token (measured in benchmarks/vllm_generate.md: a few samples in a
  thousand on a random-weight model). The ``sample_seed`` column keeps rlpipe's name for sample j,
  ``derive_seed(request.seed, j)``; vLLM's own stream for it is ``vllm_seed(request.seed) + j``, a
  different integer but just as fixed.
- ``logprobs=0`` returns the sampled token's log-prob only, and the engine runs with
  ``logprobs_mode="processed_logprobs"``: log_softmax of the logits after temperature and
  top-k/top-p masking, i.e. the log-prob under the distribution actually sampled from, which is
  the HF engine's definition (ALGORITHMS.md, 'Sampling truncation'). vLLM's default
  ``raw_logprobs`` would be log_softmax(logits) with neither temperature nor truncation. For greedy
  decoding (temperature 0) both modes give the untempered softmax, again as the HF engine does.
- Temperatures in (0, 0.01) are refused: vLLM raises them to 0.01 with only a warning, which would
  make the recorded log-probs those of another temperature than the trainer's.
- ``top_k`` 0 (off in rlpipe) is sent as -1 (off in every vLLM release; 0 is off only from ~0.9).
  Filter order is the same as rlpipe's: temperature, then top-k, then top-p.
- EOS: ``stop_token_ids`` = rlpipe's EOS ids, and ``generation_config="vllm"`` so that defaults in
  the model's generation_config.json never change sampling. vLLM appends the sampled token to the
  output before checking for a stop, and checks the stop before the length cap, so EOS is the last
  entry of ``token_ids`` and an EOS that is also the ``max_tokens``-th token ends as "stop", exactly as
  in the HF engine. The adapter does not rely on it: the finish reason is read off the last token,
  and an EOS that a vLLM version left out of ``token_ids`` is put back with its log-prob (or the
  request fails loudly), so every per-token list has one entry per completion token.
- A LoRA policy (an adapter directory, rlpipe/models/lora) is served unmerged: vLLM loads the base model
  with ``enable_lora`` and ``max_lora_rank`` (the adapter's rank rounded up to a size vLLM compiles
  for) and every request carries a ``LoRARequest`` for the adapter directory. A new adapter gets a new
  integer id (vLLM caches adapters by id, so an id is never reused for other weights). Adapters that
  train the LM head or embeddings in full (``modules_to_save``) are refused: vLLM serves LoRA layers only.
  Written against vLLM 0.26's API; run on the GPU by tests/engines/test_vllm_gpu.py (``gpu``).
- Prompts go in as token ids (``TokensPrompt``) with ``skip_tokenizer_init=True`` and
  ``detokenize=False``: rlpipe decodes, vLLM never loads the tokenizer.
- Data parallelism: vLLM's offline ``LLM`` refuses ``data_parallel_size > 1`` in one process, so rlpipe
  runs ``data_parallel_size`` independent replicas, each in its own process on its own
  ``tensor_parallel_size`` GPUs, and splits the prompts between them in contiguous shards. For a
  dense model this is what vLLM's data parallelism does too; seeds travel with each request, so the
  split changes no sample beyond that float noise. (Not yet run on several GPUs.)
- Engines per GPU: one vLLM engine decodes a small model at a fraction of the GPU's speed, because each
  step's host-side work (scheduling and output handling, about 50 us per sequence) runs in one Python
  process while the GPU idles (benchmarks/vllm_decode_bound.py: CUDA busy 5 of 54-64 ms per step of
  1,024 sequences for a 0.5B shape on an H200). ``engines_per_gpu`` replicas share each GPU, each with
  that share of ``gpu_memory_utilization``; their host work runs in parallel. Engines sharing a GPU start
  one after another, since vLLM sizes its KV cache from the memory it finds free when it starts.

Usage:
    with VLLMEngine("models/policy", dtype="bfloat16", eos_token_ids=[151645]) as engine:
        groups = engine.generate([PromptRequest((1, 2, 3), seed=derive_seed(0, 0, 17), n=8)], params)
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlpipe.engines.base import Completion, PromptRequest, SamplingParams

# vLLM raises any temperature in (0, _VLLM_MIN_TEMPERATURE) to this value (vllm/sampling_params.py, _MAX_TEMP).
VLLM_MIN_TEMPERATURE = 1e-2
# vLLM keeps seeds in int64 and seeds child j with seed + j: stay below 2**62 so that never overflows.
_VLLM_SEED_BITS = 62
LOGPROBS_MODE = "processed_logprobs"
# The LoRA ranks vLLM's kernels are built for (vllm/config/lora.py); max_lora_rank must be one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def lora_serving(model_dir: str | Path) -> tuple[Path, Path | None, int | None]:
    """(base model dir, adapter dir or None, adapter rank or None) of a policy directory, checked for vLLM.

    The base's content hash is checked against the adapter's record (rlpipe.models.lora.adapter.checked_base).
    """
    from rlpipe.models.lora.adapter import adapter_config, checked_base, is_adapter_dir

    if not is_adapter_dir(model_dir):
        return Path(model_dir), None, None
    cfg = adapter_config(model_dir)
    if cfg.get("modules_to_save"):
        raise ValueError(f"{model_dir}: the adapter trains {cfg['modules_to_save']} in full (train.lora.train_lm_head/"
                         "train_embeddings), which vLLM cannot serve as LoRA; use the hf engine, or "
                         "`rlpipe export --merge` and sample from the merged model")
    return checked_base(model_dir), Path(model_dir), int(cfg["r"])


def vllm_available() -> bool:
    """True when the vllm package is installed; found without importing it (importing vllm takes seconds,
    and a stage served by the engine server never needs it)."""
    import sys
    from importlib.util import find_spec

    if "vllm" in sys.modules:
        return sys.modules["vllm"] is not None
    return find_spec("vllm") is not None


def vllm_seed(request_seed: int) -> int:
    """The seed rlpipe gives vLLM for a request: its low 62 bits (vLLM seeds sample j with this + j)."""
    return request_seed & ((1 << _VLLM_SEED_BITS) - 1)


def vllm_sampling_kwargs(params: SamplingParams, *, n: int, seed: int, eos_token_ids: Sequence[int]) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one request of ``n`` samples."""
    if 0.0 < params.temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(f"temperature {params.temperature} is below vLLM's smallest sampling temperature "
                         f"{VLLM_MIN_TEMPERATURE} (vLLM would silently use {VLLM_MIN_TEMPERATURE}); use 0 for greedy")
    return {
        "n": n,
        "seed": vllm_seed(seed),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(eos_token_ids),
        "logprobs": 0,  # the sampled token's log-prob, nothing else
        "flat_logprobs": True,  # flat lists instead of a dict per token: far fewer Python objects
        "detokenize": False,
    }


def sampled_logprobs(output: Any) -> list[float]:
    """The sampled token's log-prob at every position of a vLLM ``CompletionOutput``.

    Reads both layouts vLLM returns: ``FlatLogprobs`` (flat lists; position i starts at
    ``start_indices[i]`` with the sampled token, which the sampler always puts first) and the
    classic list of ``{token_id: Logprob}`` dicts.
    """
    logprobs = output.logprobs
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs: the request must be made with logprobs=0")
    token_ids = list(output.token_ids)
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:
        values = [logprobs.logprobs[s] for s in starts]
        sampled = [logprobs.token_ids[s] for s in starts]
        if sampled[: len(token_ids)] != token_ids[: len(sampled)]:
            raise RuntimeError("vLLM's log-prob entries do not start with the sampled tokens")
        return values
    return [position[token].logprob for position, token in zip(logprobs, token_ids)]


def to_completion(output: Any, *, eos_token_ids: Sequence[int]) -> Completion:
    """Map one vLLM ``CompletionOutput`` to a ``Completion`` (EOS kept as the last token, one log-prob per token)."""
    token_ids = [int(t) for t in output.token_ids]
    logprobs = [float(x) for x in sampled_logprobs(output)]
    eos = set(eos_token_ids)
    stop_token = output.stop_reason if isinstance(output.stop_reason, int) else None
    if output.finish_reason == "stop" and stop_token in eos and (not token_ids or token_ids[-1] != stop_token):
        # A vLLM that leaves the stop token out of token_ids: put it back; its log-prob must be there.
        if len(logprobs) != len(token_ids) + 1:
            raise RuntimeError(f"vLLM stopped on EOS {stop_token} but returned neither the token nor its log-prob")
        token_ids.append(stop_token)
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
    if token_ids and token_ids[-1] in eos:
        finish_reason = "stop"
    elif output.finish_reason == "length":
        finish_reason = "length"
    else:  # "stop" on something rlpipe did not ask for (a stop string, another EOS), "abort", ...
        raise RuntimeError(f"vLLM finished a sample with reason {output.finish_reason!r} "
                           f"(stop_reason {output.stop_reason!r}) and no rlpipe EOS as its last token")
    return Completion(token_ids=token_ids, sampler_logprobs=logprobs, finish_reason=finish_reason)


def run_requests(vllm: Any, llm: Any, requests: Sequence[PromptRequest], params: SamplingParams,
                 eos_token_ids: Sequence[int], lora_request: Any = None) -> list[list[Completion]]:
    """Generate on one ``vllm.LLM``: one vLLM request per prompt, results in request and sample order.

    ``lora_request``: a ``vllm.lora.request.LoRARequest`` applied to every request (a LoRA policy), or None.
    """
    if not requests:
        return []
    prompts = [vllm.TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
    sampling = [vllm.SamplingParams(**vllm_sampling_kwargs(params, n=r.n, seed=r.seed, eos_token_ids=eos_token_ids))
                for r in requests]
    lora = {"lora_request": lora_request} if lora_request is not None else {}
    outputs = llm.generate(prompts, sampling, use_tqdm=False, **lora)  # returned in prompt order
    if len(outputs) != len(requests):
        raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(requests)} prompts")
    groups = []
    for request, out in zip(requests, outputs):
        samples = sorted(out.outputs, key=lambda o: o.index)
        if [o.index for o in samples] != list(range(request.n)):
            raise RuntimeError(f"vLLM returned samples {[o.index for o in samples]}, expected 0..{request.n - 1}")
        groups.append([to_completion(o, eos_token_ids=eos_token_ids) for o in samples])
    return groups


def visible_gpu_ids() -> list[str] | None:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (None: not set, all of them)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [g.strip() for g in value.split(",") if g.strip()]


def replica_gpu_ids(replica: int, tensor_parallel_size: int, visible: list[str] | None) -> list[str]:
    """GPU ids of data-parallel replica `replica`: the replica-th run of tensor_parallel_size visible GPUs."""
    start, stop = replica * tensor_parallel_size, (replica + 1) * tensor_parallel_size
    if visible is None:
        return [str(i) for i in range(start, stop)]
    if stop > len(visible):
        raise ValueError(f"replica {replica} needs GPUs {start}..{stop - 1} but CUDA_VISIBLE_DEVICES names "
                         f"{len(visible)}: data_parallel_size x tensor_parallel_size must fit the visible GPUs")
    return visible[start:stop]


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError("the vLLM engine needs the vllm package: pip install 'rlpipe[vllm]' "
                          "(a vLLM release built for your torch)") from e
    return vllm


class _LocalReplica:
    """One ``vllm.LLM`` in this process."""

    def __init__(self, llm_kwargs: dict, eos_token_ids: Sequence[int]) -> None:
        self._vllm = _import_vllm()
        self._llm = self._vllm.LLM(**llm_kwargs)
        self._eos = tuple(eos_token_ids)
        self._result: list[list[Completion]] = []
        self._lora_request: Any = None

    def submit(self, requests: Sequence[PromptRequest], params: SamplingParams) -> None:
        self._result = run_requests(self._vllm, self._llm, requests, params, self._eos, self._lora_request)

    def result(self) -> list[list[Completion]]:
        result, self._result = self._result, []
        return result

    def call(self, method: str, *args: Any) -> None:
        """Run an engine-management method (`reload_weights`, `sleep`, `wake_up`) on this replica."""
        getattr(self, f"_{method}")(*args)

    def _reload_weights(self, model_dir: str) -> None:
        # vLLM reads every weight of model_dir into the running engine (its compiled graphs and CUDA graphs
        # stay); cached prefixes were computed with the old weights and must go.
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        self._llm.reset_prefix_cache()

    def _use_adapter(self, spec: tuple[str, int, str] | None) -> None:
        if spec is None:
            self._lora_request = None
            return
        from importlib import import_module

        name, int_id, path = spec
        self._lora_request = import_module("vllm.lora.request").LoRARequest(name, int_id, path)

    def _sleep(self, level: int) -> None:
        self._llm.sleep(level=level)  # 2: weights and KV cache freed; 1: weights kept in CPU memory

    def _wake_up(self) -> None:
        self._llm.wake_up()

    def close(self) -> None:
        # Shut vLLM's engine-core process down now rather than at garbage collection, so its GPU memory
        # is free when this returns (LLM has no public close; llm_engine.engine_core is vLLM's client).
        engine_core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self._llm = None


def _replica_main(conn: Any, llm_kwargs: dict, eos_token_ids: tuple[int, ...], gpu_ids: list[str]) -> None:
    """Body of a data-parallel replica process: own GPUs, own LLM, serve generate calls until told to stop."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)  # before vllm (and CUDA) is imported
    try:
        replica = _LocalReplica(llm_kwargs, eos_token_ids)
        conn.send(("ready", None))
    except Exception as e:  # noqa: BLE001  report any start failure to the parent, then exit
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while (message := conn.recv()) is not None:
        kind, *payload = message
        try:
            if kind == "generate":
                replica.submit(*payload)
                conn.send(("ok", replica.result()))
            else:
                replica.call(*payload)
                conn.send(("ok", None))
        except Exception as e:  # noqa: BLE001  the parent raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))
    replica.close()


class _ProcessReplica:
    """One ``vllm.LLM`` in a child process pinned to `gpu_ids` (data parallelism)."""

    def __init__(self, llm_kwargs: dict, eos_token_ids: Sequence[int], gpu_ids: list[str]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited CUDA state
        self._conn, child = ctx.Pipe()
        # Not a daemon: vLLM starts processes of its own, which daemonic processes may not do.
        self._process = ctx.Process(target=_replica_main, args=(child, llm_kwargs, tuple(eos_token_ids), gpu_ids))
        self._process.start()
        child.close()
        self.gpu_ids = gpu_ids
        self._ready = False

    def wait_ready(self) -> None:
        if not self._ready:
            self._receive()
            self._ready = True

    def _receive(self) -> Any:
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"vLLM replica on GPUs {self.gpu_ids} died (exit code {self._process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"vLLM replica on GPUs {self.gpu_ids}: {payload}")
        return payload

    def submit(self, requests: Sequence[PromptRequest], params: SamplingParams) -> None:
        self.wait_ready()
        self._conn.send(("generate", list(requests), params))

    def result(self) -> list[list[Completion]]:
        return self._receive()

    def call(self, method: str, *args: Any) -> None:
        self.wait_ready()
        self._conn.send(("call", method, *args))
        self._receive()

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=60)
            if self._process.is_alive():
                self._process.terminate()
        self._conn.close()


class VLLMEngine:
    """Sampling with vLLM from a model directory; same inputs and outputs as ``HFEngine``.

    model_dir: a ``save_pretrained`` directory (vLLM reads config.json and the safetensors itself).
    dtype: "bfloat16" | "float16" | "float32"; eos_token_ids: any of these ends a sample (kept as its last token).
    tensor_parallel_size: GPUs per replica; data_parallel_size: replicas (each in its own process when > 1).
    engines_per_gpu: replicas sharing each set of tensor_parallel_size GPUs (data_parallel_size x this in all).
    gpu_memory_utilization: share of each GPU's memory vLLM may take for weights, activations and KV cache,
    split evenly between the engines sharing it.
    enable_prefix_caching: reuse the KV cache of shared prompt prefixes.
    enforce_eager: no CUDA graphs or torch.compile (starts faster, decodes slower).
    max_model_len: context length vLLM plans for (None: the model's own).
    seed: vLLM's engine-wide seed; sampling uses each request's own seed, so it only affects vLLM internals.
    enable_sleep_mode: allow `sleep` / `wake_up` (vLLM's own allocator; the engine server uses it).
    max_lora_rank: serve LoRA adapters up to this rank (one of VLLM_LORA_RANKS; `use_adapter` picks one); None = off.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str,
        eos_token_ids: Sequence[int],
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        engines_per_gpu: int = 1,
        gpu_memory_utilization: float = 0.85,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        max_lora_rank: int | None = None,
    ) -> None:
        if len(eos_token_ids) == 0:
            raise ValueError("eos_token_ids must name at least one token")
        if min(tensor_parallel_size, data_parallel_size, engines_per_gpu) < 1:
            raise ValueError(f"tensor_parallel_size, data_parallel_size and engines_per_gpu must be >= 1, got "
                             f"{tensor_parallel_size}, {data_parallel_size} and {engines_per_gpu}")
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))
        self.llm_kwargs = {
            "model": str(model_dir),
            "dtype": dtype,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization / engines_per_gpu,
            "enable_prefix_caching": enable_prefix_caching,
            "enforce_eager": enforce_eager,
            "max_model_len": max_model_len,
            "seed": seed,
            "logprobs_mode": LOGPROBS_MODE,
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
        }
        if enable_sleep_mode:
            self.llm_kwargs["enable_sleep_mode"] = True
        self.max_lora_rank = max_lora_rank
        self.adapter: str | None = None
        self._lora_ids = 0
        if max_lora_rank is not None:
            # one adapter at a time (the policy); its rank padded to what vLLM compiles for
            self.llm_kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(max_lora_rank), max_loras=1)
        self._replicas: list[Any] = []
        if data_parallel_size * engines_per_gpu == 1:
            self._replicas = [_LocalReplica(self.llm_kwargs, self.eos_token_ids)]
        else:
            self._start_replicas(tensor_parallel_size, data_parallel_size, engines_per_gpu)

    def _start_replicas(self, tensor_parallel_size: int, data_parallel_size: int, engines_per_gpu: int) -> None:
        """One process per replica, in waves: a wave has one engine on every GPU group, all loading at once;
        the next wave starts when it is ready, so each engine finds its GPU's memory as the last one left it."""
        visible = visible_gpu_ids()
        try:
            for _ in range(engines_per_gpu):
                wave = [_ProcessReplica(self.llm_kwargs, self.eos_token_ids,
                                        replica_gpu_ids(i, tensor_parallel_size, visible))
                        for i in range(data_parallel_size)]
                self._replicas.extend(wave)
                for replica in wave:
                    replica.wait_ready()
        except BaseException:
            self.close()
            raise

    def generate(
        self,
        requests: Sequence[PromptRequest],
        params: SamplingParams,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Completion]]:
        """Sample `request.n` completions per request; results in request order, samples in index order.

        progress: optional callback, called with the number of samples finished as each replica's share comes back.
        """
        from rlpipe.distributed import contiguous_blocks

        shards = contiguous_blocks(len(requests), len(self._replicas))
        for replica, (start, stop) in zip(self._replicas, shards):
            replica.submit(requests[start:stop], params)
        results: list[list[Completion]] = []
        for replica in self._replicas:
            groups = replica.result()
            results.extend(groups)
            if progress is not None:
                progress(sum(len(g) for g in groups))
        return results

    def reload_weights(self, model_dir: str | Path) -> None:
        """Load every weight of ``model_dir`` (same architecture) into the running engine, on every replica.

        Why: a new policy checkpoint is a new set of weights for the same graph; starting a new engine
        would repeat vLLM's compilation, CUDA-graph capture and memory profiling (rlpipe/worker/engine_server.py).
        """
        if self.max_lora_rank is not None:
            # vLLM wraps a LoRA engine's layers (embed_tokens.base_layer.weight ...): a checkpoint's plain names
            # do not load into them. A LoRA run never changes its base; a new base needs a new engine.
            raise ValueError("a vLLM engine built with LoRA cannot reload base weights; build a new engine")
        for replica in self._replicas:
            replica.call("reload_weights", str(model_dir))

    def use_adapter(self, adapter_dir: str | Path | None) -> None:
        """Sample through the LoRA adapter in ``adapter_dir`` from now on (None: the base weights alone).

        Each call gives the adapter a new vLLM id, so new weights in the same directory are loaded, never
        taken from vLLM's adapter cache.
        """
        if adapter_dir is not None and self.max_lora_rank is None:
            raise ValueError("this vLLM engine was built without LoRA (max_lora_rank); rebuild it for an adapter")
        spec = None
        if adapter_dir is not None:
            self._lora_ids += 1
            spec = (f"rlpipe-policy-{self._lora_ids}", self._lora_ids, str(Path(adapter_dir).resolve()))
        for replica in self._replicas:
            replica.call("use_adapter", spec)
        self.adapter = None if adapter_dir is None else str(adapter_dir)

    @property
    def keeps_weights_asleep(self) -> bool:
        """Whether `sleep` keeps the weights (in CPU memory), so `wake_up` alone restores them.

        A LoRA engine does (vLLM sleep level 1): its base never changes and could not be reloaded into
        its LoRA-wrapped layers. Otherwise level 2 frees them, since the next policy reloads every weight.
        """
        return self.max_lora_rank is not None

    def sleep(self) -> None:
        """Free the GPU memory of the KV cache and the weights (`keeps_weights_asleep`: to CPU memory);
        `wake_up` undoes it, then `reload_weights` where the weights were dropped."""
        level = 1 if self.keeps_weights_asleep else 2
        for replica in self._replicas:
            replica.call("sleep", level)

    def wake_up(self) -> None:
        for replica in self._replicas:
            replica.call("wake_up")

    def close(self) -> None:
        """Stop the replicas (child processes) and drop the LLMs; the engine is unusable afterwards."""
        for replica in self._replicas:
            replica.close()
        self._replicas = []

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
