"""The generate stage's logic: pick this iteration's prompts, sample G completions each, build the rollout table."""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from rlpipe.config import GenerateConfig, VLLMConfig
from rlpipe.engines.base import Completion, GenerationEngine, PromptRequest, SamplingParams, derive_seed
from rlpipe.errors import ArtifactError, ConfigError

# Domain tags keep the seed streams of different uses apart (prompt choice vs sampling).
PROMPT_SELECTION_STREAM = 1
SAMPLING_STREAM = 2


def select_prompts(prompts: pl.DataFrame, *, count: int, seed: int, iteration: int) -> pl.DataFrame:
    """This iteration's prompts: a seeded draw without replacement, different every iteration.

    Why seeded by (seed, iteration): a rerun of the same iteration picks the same prompts, the
    next iteration sees others, and nothing depends on the file's row order beyond prompt_id.
    """
    if prompts.height == 0:
        raise ArtifactError("the prompt table is empty: nothing to generate from")
    if count <= 0 or count >= prompts.height:
        return prompts.sort("prompt_id")
    rng = np.random.default_rng(derive_seed(seed, PROMPT_SELECTION_STREAM, iteration))
    ids = prompts["prompt_id"].sort().to_numpy()
    chosen = np.sort(rng.choice(ids, size=count, replace=False))
    return prompts.filter(pl.col("prompt_id").is_in(chosen.tolist())).sort("prompt_id")


def check_context(prompts: pl.DataFrame, *, max_new_tokens: int, context_length: int | None, source: str,
                  setting: str) -> None:
    """Fail before sampling if a prompt plus the longest completion cannot fit the model's context.

    ``setting``: the params key of ``max_new_tokens`` (generate's or evaluate's), named in the error.
    """
    if context_length is None:
        return
    lengths = prompts["prompt_token_ids"].list.len()
    worst = int(lengths.max())
    if worst + max_new_tokens > context_length:
        pid = prompts["prompt_id"][int(lengths.arg_max())]
        raise ArtifactError(f"{source}: prompt_id {pid} has {worst} tokens; with {setting}="
                            f"{max_new_tokens} that exceeds the model's context of {context_length} tokens")


def sample_seed(seed: int, iteration: int, prompt_id: int) -> int:
    """Per-prompt seed; the engine derives sample j's seed as derive_seed(this, j)."""
    return derive_seed(seed, SAMPLING_STREAM, iteration, prompt_id)


def sampling_params(cfg: GenerateConfig) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens)


ENGINES = ("hf", "vllm")
GREEDY_TEMPERATURE = 0.0  # evaluate's decoding: argmax, the policy's mode, comparable across iterations


def choose_engine(cfg: GenerateConfig) -> str:
    """The engine ``generate.engine`` names; ``auto``: see `resolve_engine`."""
    return resolve_engine(cfg.engine, cfg.device)


def resolve_engine(engine: str, device: str) -> str:
    """``engine`` itself, or for ``auto``: vllm when ``device`` is CUDA, a GPU is visible and vllm imports, else hf.

    Neither check initialises CUDA (``torch.cuda.is_available`` counts devices without creating a
    context), so vLLM can still start its workers in this process afterwards.
    """
    if engine != "auto":
        return engine
    if not device.startswith("cuda"):
        return "hf"
    import torch

    if not torch.cuda.is_available():
        return "hf"
    from rlpipe.engines.vllm import vllm_available

    return "vllm" if vllm_available() else "hf"


def make_engine(cfg: GenerateConfig, *, engine: str, model_dir: str, eos_token_ids: list[int],
                pad_token_id: int) -> GenerationEngine:
    """Build engine `engine` ("hf" | "vllm", see `choose_engine`) for the model in `model_dir` with generate's settings."""
    return build_engine(engine, device=cfg.device, dtype=cfg.dtype, batch_size=cfg.batch_size, vllm=cfg.vllm,
                        temperature=cfg.temperature, model_dir=model_dir, eos_token_ids=eos_token_ids,
                        pad_token_id=pad_token_id, section="generate")


def build_engine(engine: str, *, device: str, dtype: str, batch_size: int, vllm: VLLMConfig, temperature: float,
                 model_dir: str, eos_token_ids: list[int], pad_token_id: int, section: str) -> GenerationEngine:
    """An engine for the model in ``model_dir``: the project's engine server when one runs with these
    settings (rlpipe/worker/engine_server.py), else one built here.

    hf loads the model here with transformers; vllm loads the weights itself, and must be built before
    anything in this process initialises CUDA. ``section``: the params section the settings come from,
    named in errors (generate, evaluate).
    """
    if engine not in ENGINES:
        raise ConfigError(f"{section}.engine: unknown engine {engine!r}; valid: {list(ENGINES)}")
    if engine == "vllm":
        from rlpipe.engines.vllm import VLLM_MIN_TEMPERATURE

        if device != "cuda":
            raise ConfigError(f"{section}.device: the vllm engine runs on the GPUs that CUDA_VISIBLE_DEVICES shows; "
                              f"set it to 'cuda' (got {device!r})")
        if 0.0 < temperature < VLLM_MIN_TEMPERATURE:
            raise ConfigError(f"generate.temperature: {temperature} is below vLLM's smallest temperature "
                              f"{VLLM_MIN_TEMPERATURE} (vLLM would sample at {VLLM_MIN_TEMPERATURE}); use the hf engine")
    from rlpipe.worker.engine_client import engine_settings, remote_engine

    settings = engine_settings(engine, device=device, dtype=dtype, batch_size=batch_size, vllm=vllm)
    remote = remote_engine(settings, model_dir=model_dir, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
    if remote is not None:
        return remote
    if engine == "hf":
        from rlpipe.engines.hf import HFEngine
        from rlpipe.models import load_model

        model = load_model(model_dir, device=device, dtype=dtype)
        return HFEngine.from_model(model, batch_size=batch_size, eos_token_ids=eos_token_ids,
                                   pad_token_id=pad_token_id)
    from rlpipe.engines.vllm import VLLMEngine

    return VLLMEngine(model_dir, dtype=dtype, eos_token_ids=eos_token_ids,
                      tensor_parallel_size=vllm.tensor_parallel_size, data_parallel_size=vllm.data_parallel_size,
                      gpu_memory_utilization=vllm.gpu_memory_utilization,
                      enable_prefix_caching=vllm.enable_prefix_caching, enforce_eager=vllm.enforce_eager,
                      max_model_len=vllm.max_model_len)


def generate_rollouts(engine: GenerationEngine, prompts: pl.DataFrame, *, cfg: GenerateConfig, seed: int,
                      iteration: int, decode: Any, progress: Any = None) -> pl.DataFrame:
    """Sample ``cfg.group_size`` completions for every prompt row; return the rollout table.

    ``decode`` turns completion token ids into text (the tokenizer's decode without special tokens).
    ``progress``: optional callback (samples finished per batch), see rlpipe.progress.
    """
    requests = [
        PromptRequest(prompt_token_ids=tuple(ids), seed=sample_seed(seed, iteration, pid), n=cfg.group_size)
        for pid, ids in zip(prompts["prompt_id"].to_list(), prompts["prompt_token_ids"].to_list())
    ]
    results = engine.generate(requests, sampling_params(cfg), progress=progress)
    return rollout_frame(prompts, requests, results, iteration=iteration, decode=decode)


def rollout_frame(prompts: pl.DataFrame, requests: list[PromptRequest], results: list[list[Completion]],
                  *, iteration: int, decode: Any) -> pl.DataFrame:
    """Flatten engine results into rollout rows (shared by every engine, so all write the same table)."""
    rows: dict[str, list] = {k: [] for k in (
        "prompt_id", "sample_idx", "sample_seed", "prompt_token_ids", "completion_token_ids", "completion_text",
        "completion_length", "sampler_logprobs", "finish_reason", "truncated")}
    for pid, req, group in zip(prompts["prompt_id"].to_list(), requests, results):
        if len(group) != req.n:
            raise RuntimeError(f"engine returned {len(group)} samples for prompt {pid}, expected {req.n}")
        for j, c in enumerate(group):
            rows["prompt_id"].append(pid)
            rows["sample_idx"].append(j)
            rows["sample_seed"].append(derive_seed(req.seed, j))
            rows["prompt_token_ids"].append(list(req.prompt_token_ids))
            rows["completion_token_ids"].append(list(c.token_ids))
            rows["completion_text"].append(decode(c.token_ids))
            rows["completion_length"].append(len(c.token_ids))
            rows["sampler_logprobs"].append([float(x) for x in c.sampler_logprobs])
            rows["finish_reason"].append(c.finish_reason)
            rows["truncated"].append(c.finish_reason == "length")
    frame = pl.DataFrame(rows, schema_overrides={
        "prompt_token_ids": pl.List(pl.Int32), "completion_token_ids": pl.List(pl.Int32),
        "sampler_logprobs": pl.List(pl.Float32), "sample_idx": pl.Int32, "completion_length": pl.Int32,
        "sample_seed": pl.Int64})
    return frame.with_columns(pl.lit(iteration, dtype=pl.Int64).alias("policy_version"))


def rollout_metrics(rollouts: pl.DataFrame) -> dict[str, float]:
    lengths = rollouts["completion_length"]
    return {
        "num_prompts": rollouts["prompt_id"].n_unique(),
        "num_samples": rollouts.height,
        "completion_tokens": int(lengths.sum()),
        "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()),
        "truncation_rate": float(rollouts["truncated"].mean()),
        "sampler_logprob_mean": float(rollouts["sampler_logprobs"].explode().mean()),
    }
