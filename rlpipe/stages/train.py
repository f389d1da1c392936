"""The train stage's logic: read what the iteration produced, load the models to train, run the updates,
write the checkpoint and the trainer's tables.

Four steps, each a function the stage script calls in its phase: `read_inputs` (the joined training
frame, checked against params), `load_trainees` (the policy, full or LoRA, and for gae the critic,
compiled and sharded as configured), `run_updates` (mu epochs of optimizer steps, resumable),
`write_outputs` (checkpoint, critic, per-token statistics, per-step CSV). `train_metrics` says what the
stage measured. Under torchrun every rank runs every step on its own share of the rows
(`rlpipe.training.share`); only rank 0 writes, the per-token statistics arriving from each rank in turn.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import polars as pl

from rlpipe.config import Params, fine_points
from rlpipe.data.io import count_rows, read_artifact, read_policy_version, write_artifact, write_artifact_parts
from rlpipe.data.schema import ADVANTAGES, REF_LOGPROBS, ROLLOUTS, SCORES, TRAIN_TOKEN_STATS, VALUES
from rlpipe.distributed import Dist
from rlpipe.engines.logprobs import compile_decoder_layers, compile_layers_wanted, enable_gradient_checkpointing
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.models.critic import load_critic, save_critic
from rlpipe.models.loading import (load_tokenizer, load_trainable_model, lora_for_training, save_checkpoint,
                                   stored_dtype)
from rlpipe.models.lora.adapter import is_adapter_dir
from rlpipe.training.data import (TRAINED_ADVANTAGE_COLUMNS, TRAINED_ROLLOUT_COLUMNS, check_policy_version, training_data,
                                  training_frame)
from rlpipe.training.loop import TrainResult, count_optimizer_steps, sampling_truncation, train_policy, trainable_rows
from rlpipe.training.report import (check_sampler, importance_weights, reward_stats, sampler_check_applies,
                                   sampler_mismatch, token_stats_frame, write_steps_csv)
from rlpipe.training.resume import ResumeStates, resume_key
from rlpipe.training.share import share_bounds, share_rows

# train settings that decide how often and how durably resume states are written, never the result:
# left out of the resume key, so changing them keeps a killed run's states usable
RESUME_CADENCE_KEYS = ("checkpoint_every_steps", "checkpoint_every_s", "checkpoint_fsync")


@dataclass(frozen=True)
class TrainPaths:
    """The stage's files, as dvc.yaml passes them (values, critic, critic_checkpoint: gae only)."""

    rollouts: str
    scores: str
    ref_logprobs: str
    advantages: str
    values: str | None
    policy: str
    critic: str | None
    checkpoint: str
    critic_checkpoint: str | None
    token_stats: str
    steps: str
    resume_root: str


@dataclass
class TrainInputs:
    """The rollouts, the joined training frame, the score table and how stale the sampler was."""

    rollouts: Any  # rlpipe.data.io.Artifact
    frame: pl.DataFrame
    scores: pl.DataFrame
    staleness: int
    rows: tuple[int, int] | None = None  # under torchrun: this rank's rows [start, stop) of every table


@dataclass
class Trainees:
    """What train optimises: the policy (its PEFT wrapper too with LoRA), the critic (gae), the tokenizer,
    and how they were set up (compiled layers; sharded over torchrun ranks; float32 master weights read)."""

    model: Any
    tokenizer: Any
    critic: Any
    lora: Any  # rlpipe.models.lora.peft_model.LoraStart, or None for full fine-tuning
    master_loaded: bool
    compiled: bool
    sharded: Any  # rlpipe.training.distributed.ShardedTraining under torchrun, else None


def share_of(paths: TrainPaths, dist: Dist | None, with_critic: bool) -> tuple[int, int] | None:
    """This rank's rows of the tables under torchrun; None for one process (or for tables whose row counts
    differ: every rank then reads them whole, and the join names the keys that do not match)."""
    if dist is None:
        return None
    tables = [paths.rollouts, paths.advantages, paths.ref_logprobs] + ([paths.values] if with_critic else [])
    counts = {count_rows(t) for t in tables}
    return share_bounds(counts.pop(), dist.rank, dist.world_size) if len(counts) == 1 else None


def read_inputs(p: Params, paths: TrainPaths, dist: Dist | None = None) -> TrainInputs:
    """Read and join the iteration's tables (under torchrun, this rank's share of their rows); refuse
    rollouts of another sampler or a gae run without values."""
    rows = share_of(paths, dist, p.advantage.needs_critic)
    roll = read_artifact(paths.rollouts, ROLLOUTS, columns=TRAINED_ROLLOUT_COLUMNS, rows=rows)
    staleness = check_policy_version(roll, sampler_version=p.policy.version, iteration=p.iteration,
                                     max_staleness=p.policy.max_staleness, policy_dir=paths.policy,
                                     stored=read_policy_version(paths.policy))
    with_critic = p.advantage.needs_critic
    if with_critic and not (paths.values and paths.critic and paths.critic_checkpoint):
        raise ArtifactError("advantage.estimator 'gae' trains a critic: pass --values, --critic and "
                            "--critic-checkpoint (dvc.yaml does)")
    frame = training_frame(
        roll, read_artifact(paths.advantages, ADVANTAGES, columns=TRAINED_ADVANTAGE_COLUMNS, rows=rows),
        read_artifact(paths.ref_logprobs, REF_LOGPROBS, columns=["ref_logprobs"], rows=rows),
        read_artifact(paths.values, VALUES, columns=["values"], rows=rows) if with_critic else None)
    if dist is not None and rows is None:  # tables of unequal lengths: joined whole, then this rank's share
        rows = share_bounds(frame.height, dist.rank, dist.world_size)
        frame = frame[rows[0]:rows[1]]
    return TrainInputs(roll, frame, read_artifact(paths.scores, SCORES, columns=["reward", "correct"]).frame,
                       staleness, rows)


def load_trainees(p: Params, paths: TrainPaths, dist: Dist | None) -> Trainees:
    """The policy at its exact float32 weights (or a LoRA adapter over its base), the critic for gae, set up
    as train.gradient_checkpointing / compile_layers ask and sharded across torchrun's ranks."""
    cfg = p.train
    tokenizer = load_tokenizer(paths.policy)
    lora = None
    if cfg.lora.enabled:  # a fresh adapter over the start model, or the adapter it is, continued
        lora = lora_for_training(paths.policy, cfg.lora, device=cfg.device,
                                 replaced=[p.paths.checkpoint, "state", ".rlpipe"])
        master_loaded, model = False, lora.peft_model.get_base_model()
    elif is_adapter_dir(paths.policy):
        raise ConfigError(f"train.lora.rank: null (full fine-tuning), but policy.latest_path {paths.policy} is a LoRA "
                          "adapter: set train.lora as the adapter was trained, or `rlpipe export --merge` it "
                          "and start full fine-tuning from the merged model")
    else:
        model, master_loaded = load_trainable_model(paths.policy, device=cfg.device)  # the exact float32 weights
    critic = load_critic(paths.critic, seed=p.seed, device=cfg.device) if p.advantage.needs_critic else None
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    compiled = compile_layers_wanted(cfg.compile_layers, cfg.device)
    if compiled:
        compile_decoder_layers(model)
    sharded = None
    if dist is not None:
        from rlpipe.training.distributed import shard_for_training

        sharded = shard_for_training(model, dist, critic)
    return Trainees(model, tokenizer, critic, lora, master_loaded, compiled, sharded)


def resume_states(p: Params, paths: TrainPaths, dist: Dist | None) -> ResumeStates:
    """Where a killed run's states are kept: keyed by the bytes of every input and every setting that
    changes the result, so a state is only ever continued by the run that would have written it."""
    cfg = p.train
    inputs = [paths.rollouts, paths.scores, paths.ref_logprobs, paths.advantages, paths.policy]
    if p.advantage.needs_critic:
        inputs += [paths.values, paths.critic]
    result_params = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUME_CADENCE_KEYS}
    key_params = {"train": result_params, "seed": p.seed, "iteration": p.iteration, "estimator": p.advantage.estimator,
                  "torch_threads": p.torch_threads, "temperature": p.generate.temperature,
                  "max_new_tokens": p.generate.max_new_tokens,
                  "max_completion_tokens": p.generate.max_completion_tokens,
                  **({"world_size": dist.world_size} if dist else {})}
    return ResumeStates(paths.resume_root, fsync=cfg.checkpoint_fsync, enabled=dist is None or dist.is_main,
                        key=lambda: resume_key(inputs, key_params))


@dataclass
class Updates:
    """What `run_updates` did: the trainer's result, the resume state it started from, the sampler check."""

    result: TrainResult
    resumed: dict[str, Any] | None
    sampler_check: str  # "passed", or why it did not apply


def sampler_check_of(p: Params, inputs: TrainInputs, policy: str, dist: Dist | None = None
                     ) -> tuple[str | None, Callable | None]:
    """Why pi_old's recomputed log-probs are not checked against the sampler's (None: they are), and the check."""
    cfg = p.train
    skip = sampler_check_applies(staleness=inputs.staleness, sampling=inputs.rollouts.metadata.get("sampling"),
                                 tolerance=cfg.max_sampler_mismatch, keep_sampling_mask=cfg.keep_sampling_mask)
    if skip:
        return skip, None
    gather = None if dist is None else dist.gather
    return skip, lambda old: check_sampler(inputs.frame, old, tolerance=cfg.max_sampler_mismatch, policy=policy,
                                           gather=gather)


def trainer_data(inputs: TrainInputs, p: Params, dist: Dist | None = None) -> tuple[Any, int]:
    """The trainer's data (under torchrun: this rank's rows and what every rank knows of all rows) and how
    many optimizer steps it makes of it (the progress bar's total)."""
    data = training_data(inputs.frame)
    if dist is not None:
        data = share_rows(data, *inputs.rows, dist.gather)
    return data, count_optimizer_steps(len(trainable_rows(data)), p.train)


def run_updates(p: Params, inputs: TrainInputs, trainees: Trainees, data: Any, states: ResumeStates, *, policy: str,
                progress: Callable[[int], None] | None = None) -> Updates:
    """mu epochs of optimizer steps on the iteration's rollouts, from the last resume state if one is kept."""
    state = states.load()
    dist = trainees.sharded.dist if trainees.sharded is not None else None
    skip_check, check_old = sampler_check_of(p, inputs, policy, dist)
    result = train_policy(trainees.model, data, p.train, temperature=p.generate.temperature,
                          pad_token_id=trainees.tokenizer.pad_token_id, seed=p.seed, iteration=p.iteration,
                          max_length=p.generate.max_completion_tokens, critic=trainees.critic, progress=progress,
                          resume=state, save_state=states.save, dist=trainees.sharded, check_old=check_old,
                          truncation=sampling_truncation(p.generate, p.train))
    states.wait()
    return Updates(result, state, skip_check or "passed")


@dataclass(frozen=True)
class Saved:
    """How the checkpoint was written: its dtype, and whether float32 master weights went beside it."""

    dtype: str
    master: bool


def gather_for_writing(p: Params, paths: TrainPaths, trainees: Trainees) -> None:
    """Under torchrun: the full models on rank 0 (None elsewhere), from the shards, ready to be saved."""
    if trainees.sharded is None:
        return
    from rlpipe.training.distributed import gathered_models

    def rebuild():  # rank 0 saves the adapter of a CPU copy of the PEFT model
        return lora_for_training(paths.policy, p.train.lora, device="cpu", replaced=[]).peft_model

    trainees.model, trainees.critic = gathered_models(trainees.sharded, paths.policy, paths.critic, seed=p.seed,
                                                      rebuild=rebuild if trainees.lora is not None else None)
    if trainees.lora is not None and trainees.model is not None:
        trainees.lora.peft_model = trainees.model


def write_outputs(p: Params, paths: TrainPaths, inputs: TrainInputs, trainees: Trainees, updates: Updates,
                  states: ResumeStates, *, writes: bool) -> Saved:
    """The trained policy (a checkpoint, or the LoRA adapter alone), the critic, the per-token statistics and
    the per-step CSV; then the resume states go. Ranks other than 0 (``writes`` False) write nothing."""
    cfg = p.train
    gather_for_writing(p, paths, trainees)
    save_dtype = stored_dtype(paths.policy) if cfg.save_dtype == "auto" else cfg.save_dtype
    master = save_dtype != "float32" if cfg.master_weights == "auto" else cfg.master_weights
    if trainees.lora is not None:  # the adapter alone, in float32 (megabytes): no master copy needed
        save_dtype, master = "float32", False
    write_token_stats(p, paths, inputs, updates, trainees.sharded.dist if trainees.sharded is not None else None)
    if writes:
        if trainees.lora is not None:
            from rlpipe.models.lora.peft_model import save_adapter

            save_adapter(trainees.lora.peft_model, paths.checkpoint, policy_version=p.iteration + 1,
                         base_path=trainees.lora.base_path, base_hash=trainees.lora.base_hash)
        else:
            save_checkpoint(trainees.model, trainees.tokenizer, paths.checkpoint, policy_version=p.iteration + 1,
                            dtype=save_dtype, master_weights=master)
        if paths.critic_checkpoint:
            save_critic(trainees.critic, trainees.tokenizer, paths.critic_checkpoint, version=p.iteration + 1,
                        estimator=p.advantage.estimator)
        write_steps_csv(paths.steps, updates.result.steps)
        states.discard()
    return Saved(save_dtype, master)


def write_token_stats(p: Params, paths: TrainPaths, inputs: TrainInputs, updates: Updates, dist: Dist | None) -> None:
    """The per-token statistics table; under torchrun rank 0 writes each rank's rows as they arrive."""
    stats = token_stats_frame(inputs.frame, updates.result)
    metadata = {"policy_version": p.iteration}
    if dist is None:
        write_artifact(stats, paths.token_stats, TRAIN_TOKEN_STATS, metadata=metadata)
    elif dist.is_main:
        parts = itertools.chain([stats], (dist.receive_from(rank) for rank in range(1, dist.world_size)))
        write_artifact_parts(parts, paths.token_stats, TRAIN_TOKEN_STATS, metadata=metadata)
    else:
        dist.send_to_main(stats)


def train_metrics(p: Params, inputs: TrainInputs, trainees: Trainees, updates: Updates, saved: Saved,
                  states: ResumeStates) -> dict[str, Any]:
    """Everything the stage measured: the trainer's numbers, the rewards, the sampler's agreement with pi_old,
    the importance weights, and how the run was set up and written. Under torchrun a collective: every
    rank calls it (with its own rows) and gets the figures of all rows."""
    cfg, result = p.train, updates.result
    gather = trainees.sharded.dist.gather if trainees.sharded is not None else None
    return {**result.metrics, **reward_stats(inputs.scores),
            **sampler_mismatch(inputs.frame, result.old_logprobs, gather),
            **importance_weights(inputs.frame, result.old_logprobs, tis_cap=cfg.tis_cap, gather=gather),
            "staleness": inputs.staleness, "sampler_policy_version": p.policy.version,
            "policy_version_out": p.iteration + 1, "policy_loss_function": cfg.policy_loss_function,
            "profile": p.profile, "fine_points": fine_points(p), "compiled_layers": trainees.compiled,
            "sampler_check": updates.sampler_check,
            "lora": trainees.lora.metrics() if trainees.lora is not None else None,
            "resumed_from_step": int(updates.resumed["step"]) if updates.resumed else 0,
            "resume_states_written": states.written,
            "checkpoint_dtype": saved.dtype,
            "master_weights": {"loaded": trainees.master_loaded, "saved": saved.master and saved.dtype != "float32"}}
