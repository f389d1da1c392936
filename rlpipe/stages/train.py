"""The train stage's logic: read what the iteration produced, load the models to train, run the updates,
write the checkpoint and the trainer's tables.

Four steps, each a function the stage script calls in its phase: `read_inputs` (the joined training
frame, checked against params), `load_trainees` (the policy, full or LoRA, and for gae the critic,
compiled and sharded as configured), `run_updates` (mu epochs of optimizer steps, resumable),
`write_outputs` (checkpoint, critic, per-token statistics, per-step CSV). `train_metrics` says what the
stage measured. Under torchrun every rank runs every step; only rank 0 writes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import polars as pl

from rlpipe.config import Params, fine_points
from rlpipe.data.io import read_artifact, read_policy_version, write_artifact
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
from rlpipe.training.loop import TrainResult, count_optimizer_steps, sampling_truncation, train_policy
from rlpipe.training.report import (check_sampler, importance_weights, reward_stats, sampler_check_applies,
                                   sampler_mismatch, token_stats_frame, write_steps_csv)
from rlpipe.training.resume import ResumeStates, resume_key

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


def read_inputs(p: Params, paths: TrainPaths) -> TrainInputs:
    """Read and join the iteration's tables; refuse rollouts of another sampler or a gae run without values."""
    roll = read_artifact(paths.rollouts, ROLLOUTS, columns=TRAINED_ROLLOUT_COLUMNS)
    staleness = check_policy_version(roll, sampler_version=p.policy.version, iteration=p.iteration,
                                     max_staleness=p.policy.max_staleness, policy_dir=paths.policy,
                                     stored=read_policy_version(paths.policy))
    with_critic = p.advantage.needs_critic
    if with_critic and not (paths.values and paths.critic and paths.critic_checkpoint):
        raise ArtifactError("advantage.estimator 'gae' trains a critic: pass --values, --critic and "
                            "--critic-checkpoint (dvc.yaml does)")
    frame = training_frame(roll, read_artifact(paths.advantages, ADVANTAGES, columns=TRAINED_ADVANTAGE_COLUMNS),
                           read_artifact(paths.ref_logprobs, REF_LOGPROBS, columns=["ref_logprobs"]),
                           read_artifact(paths.values, VALUES, columns=["values"]) if with_critic else None)
    return TrainInputs(roll, frame, read_artifact(paths.scores, SCORES, columns=["reward", "correct"]).frame,
                       staleness)


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


def sampler_check_of(p: Params, inputs: TrainInputs, policy: str) -> tuple[str | None, Callable | None]:
    """Why pi_old's recomputed log-probs are not checked against the sampler's (None: they are), and the check."""
    cfg = p.train
    skip = sampler_check_applies(staleness=inputs.staleness, sampling=inputs.rollouts.metadata.get("sampling"),
                                 tolerance=cfg.max_sampler_mismatch, keep_sampling_mask=cfg.keep_sampling_mask)
    if skip:
        return skip, None
    return skip, lambda old: check_sampler(inputs.frame, old, tolerance=cfg.max_sampler_mismatch, policy=policy)


def trainer_data(inputs: TrainInputs, p: Params) -> tuple[Any, int]:
    """The trainer's data and how many optimizer steps it makes of it (the progress bar's total)."""
    data = training_data(inputs.frame)
    return data, count_optimizer_steps(int(data.trainable.sum()), p.train)


def run_updates(p: Params, inputs: TrainInputs, trainees: Trainees, data: Any, states: ResumeStates, *, policy: str,
                progress: Callable[[int], None] | None = None) -> Updates:
    """mu epochs of optimizer steps on the iteration's rollouts, from the last resume state if one is kept."""
    state = states.load()
    skip_check, check_old = sampler_check_of(p, inputs, policy)
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
        write_artifact(token_stats_frame(inputs.frame, updates.result), paths.token_stats, TRAIN_TOKEN_STATS,
                       metadata={"policy_version": p.iteration})
        write_steps_csv(paths.steps, updates.result.steps)
        states.discard()
    return Saved(save_dtype, master)


def train_metrics(p: Params, inputs: TrainInputs, trainees: Trainees, updates: Updates, saved: Saved,
                  states: ResumeStates) -> dict[str, Any]:
    """Everything the stage measured: the trainer's numbers, the rewards, the sampler's agreement with pi_old,
    the importance weights, and how the run was set up and written."""
    cfg, result = p.train, updates.result
    return {**result.metrics, **reward_stats(inputs.scores), **sampler_mismatch(inputs.frame, result.old_logprobs),
            **importance_weights(inputs.frame, result.old_logprobs, tis_cap=cfg.tis_cap),
            "staleness": inputs.staleness, "sampler_policy_version": p.policy.version,
            "policy_version_out": p.iteration + 1, "policy_loss_function": cfg.policy_loss_function,
            "profile": p.profile, "fine_points": fine_points(p), "compiled_layers": trainees.compiled,
            "sampler_check": updates.sampler_check,
            "lora": trainees.lora.metrics() if trainees.lora is not None else None,
            "resumed_from_step": int(updates.resumed["step"]) if updates.resumed else 0,
            "resume_states_written": states.written,
            "checkpoint_dtype": saved.dtype,
            "master_weights": {"loaded": trainees.master_loaded, "saved": saved.master and saved.dtype != "float32"}}
