"""The generate stage's logic: pick this iteration's prompts, sample G completions each, build the rollout table.

Light to import (no torch, no transformers at import time): `rlpipe run` imports it for the engine settings.
"""
from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import polars as pl

from rlpipe.config import GenerateConfig, Params, VLLMConfig
from rlpipe.data.io import read_artifact, read_policy_version
from rlpipe.data.quantiles import quantile_summary
from rlpipe.data.schema import PROMPTS, TOOL_CALL
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
        from rlpipe.models.loading import load_model

        model = load_model(model_dir, device=device, dtype=dtype)
        return HFEngine.from_model(model, batch_size=batch_size, eos_token_ids=eos_token_ids,
                                   pad_token_id=pad_token_id)
    from rlpipe.engines.vllm import VLLMEngine, lora_serving

    try:
        base, adapter, rank = lora_serving(model_dir)  # a LoRA policy: the base, with the adapter per request
    except ValueError as e:
        raise ConfigError(f"{section}.engine: {e}") from None
    built = VLLMEngine(base, dtype=dtype, eos_token_ids=eos_token_ids,
                       tensor_parallel_size=vllm.tensor_parallel_size, data_parallel_size=vllm.data_parallel_size,
                       engines_per_gpu=vllm.engines_per_gpu,
                       gpu_memory_utilization=vllm.gpu_memory_utilization,
                       enable_prefix_caching=vllm.enable_prefix_caching, enforce_eager=vllm.enforce_eager,
                       max_model_len=vllm.max_model_len, max_lora_rank=rank)
    if adapter is not None:
        built.use_adapter(adapter)
    return built


def generate_rollouts(engine: GenerationEngine, prompts: pl.DataFrame, *, cfg: GenerateConfig, seed: int,
                      iteration: int, policy_version: int, decode: Any, progress: Any = None,
                      tokenizer_hash: str = "") -> pl.DataFrame:
    """Sample ``cfg.group_size`` completions for every prompt row; return the rollout table.

    ``iteration`` seeds the samples (each iteration draws new ones); ``policy_version`` is the version of
    the sampling policy, recorded in every row (``iteration`` itself, or older with overlapped iterations).
    ``decode`` turns completion token ids into text (the tokenizer's decode without special tokens).
    ``progress``: optional callback (samples finished per batch), see rlpipe.progress.
    Multi-turn rollouts (``generate.environment``) go through `generate_multi_turn` instead.
    """
    requests = [
        PromptRequest(prompt_token_ids=tuple(ids), seed=sample_seed(seed, iteration, pid), n=cfg.group_size)
        for pid, ids in zip(prompts["prompt_id"].to_list(), prompts["prompt_token_ids"].to_list())
    ]
    results = engine.generate(requests, sampling_params(cfg), progress=progress)
    return rollout_frame(prompts, requests, results, policy_version=policy_version, decode=decode,
                         tokenizer_hash=tokenizer_hash)


def generate_multi_turn(driver: Any, prompts: pl.DataFrame, *, seed: int, iteration: int,
                        policy_version: int) -> pl.DataFrame:
    """Multi-turn rollouts of every prompt row through ``driver`` (`rlpipe.environments.driver.Driver`).

    ``prompts`` needs prompt_id, prompt, prompt_token_ids, answer and metadata (the environment is
    created with them). Sample seeds are those of single-turn generation (``iteration`` seeds them,
    ``policy_version`` is recorded, as in `generate_rollouts`).
    """
    seeds = [sample_seed(seed, iteration, pid) for pid in prompts["prompt_id"].to_list()]
    return driver.run(prompts, seeds).with_columns(pl.lit(policy_version, dtype=pl.Int64).alias("policy_version"))


@dataclass
class MultiTurnSetup:
    """What a multi-turn generate run checks before loading weights: the environment class, the chat
    template (refused by name if it rewrites earlier turns), and where finished chunks are kept."""

    cfg: GenerateConfig
    env_cls: type
    renderer: Any
    tokenizer: Any
    eos_token_ids: list[int]
    tokenizer_hash: str
    resume_dir: Path | None

    def driver(self, engine: GenerationEngine, *, progress: Any = None, sampling: SamplingParams | None = None,
               group_size: int | None = None, keep_chunks: bool = True) -> Any:
        """The driver over ``engine``: generate's sampling and group size unless given (evaluate: greedy, 1)."""
        from rlpipe.environments.driver import Driver

        return Driver(engine, sampling=sampling or sampling_params(self.cfg),
                      group_size=group_size or self.cfg.group_size, env=self.cfg.environment, env_cls=self.env_cls,
                      tokenizer=self.tokenizer, renderer=self.renderer, eos_token_ids=self.eos_token_ids,
                      tokenizer_hash=self.tokenizer_hash, resume_dir=self.resume_dir if keep_chunks else None,
                      progress=progress)

    def clear(self) -> None:
        """Drop the kept chunks (once the rollout table is written)."""
        if self.resume_dir is not None and self.resume_dir.exists():
            shutil.rmtree(self.resume_dir)


def multi_turn_setup(cfg: GenerateConfig, tokenizer: Any, *, eos_token_ids: list[int], source: str,
                     resume_root: str | None = None, inputs: list[str] = (),
                     key_params: dict[str, Any] | None = None) -> MultiTurnSetup:
    """Resolve ``generate.environment`` and check the tokenizer's chat template (ConfigError naming both).

    ``resume_root``: where finished chunks are kept, under a key hashing ``inputs`` (files or
    directories) and every generate param plus ``key_params``, so that only a rerun of the same
    work picks them up (None: nothing is kept).
    """
    from rlpipe.environments.base import resolve_environment
    from rlpipe.environments.template import ChatRenderer, tokenizer_hash

    env_cls = resolve_environment(cfg.environment.name, cfg.environment.options)
    renderer = ChatRenderer(tokenizer, eos_token_ids=eos_token_ids, source=source)
    resume_dir = None
    if resume_root is not None:
        from rlpipe.training.resume import resume_key

        key = resume_key(list(inputs), {"generate": dataclasses.asdict(cfg), **(key_params or {})})
        resume_dir = Path(resume_root) / f"generate-{key}"
    return MultiTurnSetup(cfg, env_cls, renderer, tokenizer, list(eos_token_ids), tokenizer_hash(tokenizer),
                          resume_dir)


def single_turn_columns(frame: pl.DataFrame, *, tokenizer_hash: str = "") -> pl.DataFrame:
    """The multi-turn columns with their single-turn values: every token the policy's, one turn, no tools.

    Why always present: every reader (advantage, train, inspect) then handles both kinds of row the same way.
    """
    return frame.with_columns(
        pl.col("completion_token_ids").list.eval(pl.element().is_not_null()).alias("policy_mask"),
        pl.lit(1, dtype=pl.Int32).alias("num_turns"),
        pl.lit([0], dtype=pl.List(pl.Int32)).alias("turn_starts"),
        pl.lit(None, dtype=pl.List(pl.String)).alias("turn_texts"),
        pl.lit([None], dtype=pl.List(pl.Float64)).alias("turn_rewards"),
        pl.lit([], dtype=pl.List(TOOL_CALL)).alias("tool_calls"),
        pl.lit(None, dtype=pl.String).alias("environment_error"),
        pl.lit(tokenizer_hash, dtype=pl.String).alias("tokenizer_hash"),
    )


def rollout_frame(prompts: pl.DataFrame, requests: list[PromptRequest], results: list[list[Completion]],
                  *, policy_version: int, decode: Any, tokenizer_hash: str = "") -> pl.DataFrame:
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
    frame = frame.with_columns(pl.lit(policy_version, dtype=pl.Int64).alias("policy_version"))
    return single_turn_columns(frame, tokenizer_hash=tokenizer_hash)


def rollout_metrics(rollouts: pl.DataFrame, *, multi_turn: bool = False) -> dict[str, Any]:
    """The generate stage's metrics; log-prob means over the policy's tokens only (observations have none)."""
    lengths = rollouts["completion_length"]
    policy = rollouts.select(pl.col("sampler_logprobs").explode(), pl.col("policy_mask").explode())
    sampled = policy.filter(pl.col("policy_mask"))["sampler_logprobs"]
    out: dict[str, Any] = {
        "num_prompts": rollouts["prompt_id"].n_unique(),
        "num_samples": rollouts.height,
        "completion_tokens": int(lengths.sum()),
        "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()),
        "length_quantiles": quantile_summary(lengths),  # the per-iteration distribution chart (dvc.yaml plots)
        "truncation_rate": float(rollouts["truncated"].mean()),
        "sampler_logprob_mean": float(sampled.mean()) if sampled.len() else 0.0,
    }
    if multi_turn:
        calls = rollouts["tool_calls"].list.len()
        reasons = rollouts["finish_reason"].value_counts().sort("finish_reason")
        statuses = rollouts["tool_calls"].explode().struct.field("status").drop_nulls().value_counts().sort("status")
        out.update({
            "policy_tokens": int(sampled.len()),
            "observation_tokens": int(lengths.sum()) - int(sampled.len()),
            "turns_mean": float(rollouts["num_turns"].mean()),
            "turns_max": int(rollouts["num_turns"].max()),
            "tool_calls_mean": float(calls.mean()),
            "tool_use_rate": float((calls > 0).mean()),
            "finish_reasons": {r: int(n) for r, n in reasons.iter_rows()},
            "tool_call_status": {s: int(n) for s, n in statuses.iter_rows()},
        })
    return out


# --------------------------------------------------------------------------------------------
# the stage's steps, in the order stages/generate.py calls them


def check_sampler_dir(policy: str, p: Params) -> None:
    """Refuse a policy directory whose recorded version is not params' policy.version (a stale hand-over)."""
    version = read_policy_version(policy)
    if version is not None and version != p.policy.version:
        raise ArtifactError(f"{policy}: holds policy version {version} but params policy.version is "
                            f"{p.policy.version} (iteration {p.iteration}); run `rlpipe iterate` "
                            "to advance, or fix policy.path")


@dataclass
class GenerateInputs:
    """This iteration's prompts, the sampler's tokenizer and EOS ids, and for multi-turn the checked setup."""

    prompts: pl.DataFrame
    tokenizer: Any
    eos_token_ids: list[int]
    multi_turn: MultiTurnSetup | None


def policy_tokens(policy: str, prompts: pl.DataFrame, *, max_new_tokens: int, source: str,
                  setting: str) -> tuple[Any, list[int]]:
    """The policy's tokenizer and EOS ids, once every prompt plus ``max_new_tokens`` (``setting``) is checked
    to fit the model's context: generate and evaluate both refuse a prompt file before loading weights."""
    from rlpipe.models.loading import load_tokenizer, model_eos_token_ids, read_model_config

    tokenizer = load_tokenizer(policy)
    check_context(prompts, max_new_tokens=max_new_tokens, source=source, setting=setting,
                  context_length=getattr(read_model_config(policy), "max_position_embeddings", None))
    return tokenizer, model_eos_token_ids(policy, tokenizer)


def read_inputs(p: Params, prompts_path: str, policy: str, *, resume_root: str, warn: Callable[[str], None],
                rank: tuple[int, int] = (0, 1)) -> GenerateInputs:
    """Pick the prompts, load the tokenizer and check that prompt + completion fit the model's context;
    for multi-turn also the environment and the chat template: all before any weight is loaded.

    ``rank``: (this process, processes) when several share the stage, one engine each: this process keeps its
    contiguous block of the iteration's prompts (`prompt_share`)."""
    cfg = p.generate
    table = select_prompts(read_artifact(prompts_path, PROMPTS).frame, count=cfg.prompts_per_iteration,
                           seed=p.seed, iteration=p.iteration)
    if cfg.prompts_per_iteration > table.height and rank[0] == 0:
        warn(f"generate.prompts_per_iteration is {cfg.prompts_per_iteration} but {prompts_path} holds "
             f"{table.height} prompts: every one is used, {table.height} x {cfg.group_size} samples")
    table = prompt_share(table, *rank)
    multi = cfg.environment.multi_turn
    tokenizer, eos = policy_tokens(policy, table, max_new_tokens=cfg.max_completion_tokens, source=prompts_path,
                                   setting="generate.environment.max_total_tokens" if multi
                                   else "generate.max_new_tokens")
    setup = multi_turn_setup(cfg, tokenizer, eos_token_ids=eos, source=policy, resume_root=resume_root,
                             inputs=[prompts_path, policy],
                             key_params={"seed": p.seed, "iteration": p.iteration, "policy_version": p.policy.version,
                                         "torch_threads": p.torch_threads,
                                         **({"rank": list(rank)} if rank[1] > 1 else {})}) if multi else None
    return GenerateInputs(table, tokenizer, eos, setup)


def sample(engine: GenerationEngine, inputs: GenerateInputs, p: Params, *,
           progress: Callable[[int], None] | None = None) -> tuple[pl.DataFrame, int | None]:
    """The rollout table, and for multi-turn how many finished chunks a killed run had left (else None)."""
    if inputs.multi_turn is not None:
        driver = inputs.multi_turn.driver(engine, progress=progress)
        rollouts = generate_multi_turn(driver, inputs.prompts, seed=p.seed, iteration=p.iteration,
                                       policy_version=p.policy.version)
        return rollouts, driver.resumed_chunks
    from rlpipe.environments.template import tokenizer_hash

    tokenizer = inputs.tokenizer
    rollouts = generate_rollouts(engine, inputs.prompts, cfg=p.generate, seed=p.seed, iteration=p.iteration,
                                 policy_version=p.policy.version,
                                 decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                 progress=progress, tokenizer_hash=tokenizer_hash(tokenizer))
    return rollouts, None


# --------------------------------------------------------------------------------------------
# Several processes, one engine each (torchrun, or `rlpipe run --cluster` with generate on several nodes or
# processes): each samples a contiguous block of the prompts, rank 0 writes the table in prompt order.
# Every prompt's samples are seeded by its own id, so the split changes no sample's seed.


def generation_ranks(cfg: GenerateConfig, engine: str) -> Any:
    """This process's place among the stage's processes (`rlpipe.distributed.Dist`), its GPUs pinned
    (`pin_rank_gpus`); None for a stage of one process.

    Why gloo even on GPUs: the group only carries the finished rows to rank 0, and an NCCL group would
    initialise CUDA in this process, where vLLM must start in a process that has not.
    """
    import os

    from rlpipe.distributed import start, torchrun_world_size

    if torchrun_world_size() <= 1:
        return None
    dist = start("cpu")
    pin_rank_gpus(cfg, engine, dist.local_rank, os.environ)
    return dist


def prompt_share(prompts: pl.DataFrame, rank: int, world_size: int) -> pl.DataFrame:
    """Rank ``rank``'s contiguous block of the prompts (sizes differ by at most one)."""
    if world_size == 1:
        return prompts
    from rlpipe.distributed import contiguous_blocks

    start, stop = contiguous_blocks(prompts.height, world_size)[rank]
    return prompts.slice(start, stop - start)


def pin_rank_gpus(cfg: GenerateConfig, engine: str, local_rank: int, environ: dict[str, str]) -> None:
    """Give this process its own GPUs of the node: the local_rank-th run of the GPUs one engine uses
    (vllm: tensor x data parallel size; hf on CUDA: one), so engines of one node never share a GPU."""
    if engine == "hf" and not str(cfg.device).startswith("cuda"):
        return
    from rlpipe.engines.vllm import replica_gpu_ids, visible_gpu_ids

    per_engine = cfg.vllm.tensor_parallel_size * cfg.vllm.data_parallel_size if engine == "vllm" else 1
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(replica_gpu_ids(local_rank, per_engine, visible_gpu_ids()))
    environ["RLPIPE_ENGINE_SERVER"] = "off"  # the project's one engine server would serve every rank at once


def gather_rollouts(dist: Any, mine: pl.DataFrame, inputs: GenerateInputs) -> pl.DataFrame | None:
    """On rank 0 every rank's rows in rank order (= prompt order: the blocks are contiguous); None on the
    other ranks, which then drop their kept multi-turn chunks (rank 0 holds their rows). ``mine`` itself
    without ranks (``dist`` None)."""
    from rlpipe.distributed import finish

    if dist is None:
        return mine
    if dist.is_main:
        rows = pl.concat([mine, *(dist.receive_from(r) for r in range(1, dist.world_size))], how="vertical")
    else:
        dist.send_to_main(mine)
        rows = None
    finish(dist)
    if rows is None and inputs.multi_turn is not None:
        inputs.multi_turn.clear()
    return rows


def rollout_metadata(cfg: GenerateConfig, *, engine: str, policy_version: int) -> dict[str, Any]:
    """What the rollout table's footer records: the sampler's version and settings, the engine."""
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                "max_new_tokens": cfg.max_new_tokens, "group_size": cfg.group_size}
    extra = {"environment": cfg.environment.name} if cfg.environment.multi_turn else {}
    return {"policy_version": policy_version, "sampling": sampling, "engine": engine, **extra}
