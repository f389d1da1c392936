"""DVC stage `train`: mu epochs of policy updates (GRPO/PPO-clip/GSPO) on this iteration's rollouts,
and for PPO (advantage.estimator: gae) of the critic alongside.

    python stages/train.py --params params.yaml --rollouts R.parquet --scores S.parquet \
        --ref-logprobs F.parquet --advantages A.parquet --values V.parquet --policy MODEL_DIR \
        --critic CRITIC_DIR --checkpoint OUT_DIR --critic-checkpoint CRITIC_OUT_DIR \
        --token-stats T.parquet --metrics metrics/train.json --steps plots/train_steps.csv

Without a critic (every estimator but gae) --critic-checkpoint gets a directory holding only
rlpipe.json with ``kind: none``: DVC needs the declared output, and the file says why it is empty.

On several GPUs (FSDP2; docs/distributed.md), the same arguments:

    torchrun --standalone --nproc_per_node 2 stages/train.py --params params.yaml ...
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import dataclasses

import typer

from rlpipe.config import fine_points, load_params
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.models.loading import (load_tokenizer, load_trainable_model, read_policy_version, save_checkpoint,
                           setup_torch, stored_dtype)
from rlpipe.data.schema import ADVANTAGES, REF_LOGPROBS, ROLLOUTS, SCORES, TRAIN_TOKEN_STATS, VALUES
from rlpipe.models.critic import load_critic, save_critic
from rlpipe.distributed import finish, start
from rlpipe.engines.logprobs import (compile_decoder_layers, compile_layers_wanted, compile_seconds,
                                     enable_gradient_checkpointing)
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.models.lora.adapter import is_adapter_dir
from rlpipe.training.data import check_policy_version, training_data, training_frame
from rlpipe.progress import stage_progress
from rlpipe.training.loop import count_optimizer_steps, sampling_truncation, train_policy
from rlpipe.training.resume import ResumeStates, resume_key
from rlpipe.training.report import (check_sampler, importance_weights, reward_stats, sampler_check_applies,
                                   sampler_mismatch, token_stats_frame, write_steps_csv)

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("train")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table"),
         scores: str = typer.Option(..., help="score table (for reward statistics)"),
         ref_logprobs: str = typer.Option(..., help="reference log-prob table"),
         advantages: str = typer.Option(..., help="advantage table"),
         values: str = typer.Option(None, help="critic value table (gae)"),
         policy: str = typer.Option(..., help="model directory of pi_old (the sampler), the starting weights"),
         critic: str = typer.Option(None, help="critic dir, or a causal-LM dir to start one from (gae)"),
         checkpoint: str = typer.Option(..., help="directory to write the trained model + tokenizer to"),
         critic_checkpoint: str = typer.Option(None, help="directory to write the trained critic to"),
         token_stats: str = typer.Option(..., help="per-token trainer statistics table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write"),
         steps: str = typer.Option(..., help="per-optimizer-step CSV to write (DVC plots)"),
         resume_root: str = typer.Option(".rlpipe/resume", help="where a killed run's resume state is kept")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.train
        dist = start(cfg.device)  # None unless launched by torchrun
        writes = dist is None or dist.is_main  # under torchrun rank 0 alone writes
        setup_torch(p.torch_threads, p.seed)
    with timer.phase("read"):
        roll = read_artifact(rollouts, ROLLOUTS)
        staleness = check_policy_version(roll, sampler_version=p.policy.version, iteration=p.iteration,
                                         max_staleness=p.policy.max_staleness, policy_dir=policy,
                                         stored=read_policy_version(policy))
        with_critic = p.advantage.needs_critic
        if with_critic and not (values and critic and critic_checkpoint):
            raise ArtifactError("advantage.estimator 'gae' trains a critic: pass --values, --critic and "
                                "--critic-checkpoint (dvc.yaml does)")
        frame = training_frame(roll, read_artifact(advantages, ADVANTAGES), read_artifact(ref_logprobs, REF_LOGPROBS),
                               read_artifact(values, VALUES) if with_critic else None)
        score_frame = read_artifact(scores, SCORES).frame
        tokenizer = load_tokenizer(policy)
        lora = None
        if cfg.lora.enabled:  # a fresh adapter over the start model, or the adapter it is, continued
            from rlpipe.models.loading import lora_for_training

            lora = lora_for_training(policy, cfg.lora, device=cfg.device,
                                     replaced=[p.paths.checkpoint, "state", ".rlpipe"])
            master_loaded, model = False, lora.peft_model.get_base_model()
        elif is_adapter_dir(policy):
            raise ConfigError(f"train.lora.rank: null (full fine-tuning), but policy.latest_path {policy} is a LoRA "
                              "adapter: set train.lora as the adapter was trained, or `rlpipe export --merge` it "
                              "and start full fine-tuning from the merged model")
        else:
            model, master_loaded = load_trainable_model(policy, device=cfg.device)  # the exact float32 weights
        critic_model = load_critic(critic, seed=p.seed, device=cfg.device) if with_critic else None
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        compiled = compile_layers_wanted(cfg.compile_layers, cfg.device)
        if compiled:
            compile_decoder_layers(model)
        sharded = None
        if dist is not None:
            from rlpipe.training.distributed import gathered_models, shard_for_training

            sharded = shard_for_training(model, dist, critic_model)
    with timer.phase("compute"):
        data = training_data(frame)
        # Which cadence/durability the states are written with never changes the result: not in the key.
        result_params = {k: v for k, v in dataclasses.asdict(cfg).items()
                         if k not in ("checkpoint_every_steps", "checkpoint_every_s", "checkpoint_fsync")}
        states = ResumeStates(resume_root, fsync=cfg.checkpoint_fsync, enabled=writes, key=lambda: resume_key(
            [rollouts, scores, ref_logprobs, advantages, policy] + ([values, critic] if with_critic else []),
            {"train": result_params, "seed": p.seed, "iteration": p.iteration, "estimator": p.advantage.estimator,
             "torch_threads": p.torch_threads, "temperature": p.generate.temperature,
             "max_new_tokens": p.generate.max_new_tokens, "max_completion_tokens": p.generate.max_completion_tokens,
             **({"world_size": dist.world_size} if dist else {})}))
        state = states.load()
        total = count_optimizer_steps(int(data.trainable.sum()), cfg)
        skip_check = sampler_check_applies(staleness=staleness, sampling=roll.metadata.get("sampling"),
                                           tolerance=cfg.max_sampler_mismatch, keep_sampling_mask=cfg.keep_sampling_mask)
        check_old = None if skip_check else (lambda old: check_sampler(frame, old, tolerance=cfg.max_sampler_mismatch,
                                                                      policy=policy))
        with stage_progress("train", total=total, unit="steps") as advance:
            result = train_policy(model, data, cfg, temperature=p.generate.temperature,
                                  pad_token_id=tokenizer.pad_token_id, seed=p.seed, iteration=p.iteration,
                                  max_length=p.generate.max_completion_tokens, critic=critic_model, progress=advance,
                                  resume=state, save_state=states.save, dist=sharded, check_old=check_old,
                                  truncation=sampling_truncation(p.generate, p.train))
        states.wait()
    timer.move(compile_seconds(), to="compile")
    with timer.phase("write"):
        if sharded is not None:
            rebuild = None
            if lora is not None:  # rank 0 saves the adapter of a CPU copy of the PEFT model
                from rlpipe.models.loading import lora_for_training

                rebuild = lambda: lora_for_training(policy, cfg.lora, device="cpu", replaced=[]).peft_model  # noqa: E731
            model, critic_model = gathered_models(sharded, policy, critic, seed=p.seed, rebuild=rebuild)
            if lora is not None and model is not None:
                lora.peft_model = model
        save_dtype = stored_dtype(policy) if cfg.save_dtype == "auto" else cfg.save_dtype
        master = save_dtype != "float32" if cfg.master_weights == "auto" else cfg.master_weights
        if lora is not None:  # the adapter alone, in float32 (megabytes): no master copy needed
            save_dtype, master = "float32", False
        if writes:
            if lora is not None:
                from rlpipe.models.lora.peft_model import save_adapter

                save_adapter(lora.peft_model, checkpoint, policy_version=p.iteration + 1, base_path=lora.base_path,
                             base_hash=lora.base_hash)
            else:
                save_checkpoint(model, tokenizer, checkpoint, policy_version=p.iteration + 1, dtype=save_dtype,
                                master_weights=master)
            if critic_checkpoint:
                save_critic(critic_model, tokenizer, critic_checkpoint, version=p.iteration + 1,
                            estimator=p.advantage.estimator)
            write_artifact(token_stats_frame(frame, result), token_stats, TRAIN_TOKEN_STATS,
                           metadata={"policy_version": p.iteration})
            write_steps_csv(steps, result.steps)
            states.discard()
    finish(dist)
    if not writes:
        return
    m = {**result.metrics, **reward_stats(score_frame), **sampler_mismatch(frame, result.old_logprobs),
         **importance_weights(frame, result.old_logprobs, tis_cap=cfg.tis_cap), "staleness": staleness,
         "sampler_policy_version": p.policy.version,
         "policy_version_out": p.iteration + 1, "policy_loss_function": cfg.policy_loss_function,
         "profile": p.profile, "fine_points": fine_points(p), "compiled_layers": compiled,
         "sampler_check": skip_check or "passed",
         "lora": lora.metrics() if lora is not None else None,
         "resumed_from_step": int(state["step"]) if state else 0, "resume_states_written": states.written,
         "checkpoint_dtype": save_dtype, "master_weights": {"loaded": master_loaded, "saved": master and
                                                            save_dtype != "float32"}}
    stage.write_metrics(metrics, "train", m, timer)
    stage.summary_line("train", steps=m["optimizer_steps"], sequences=m["trained_sequences"],
                       seconds=timer.report()["total"], clip_fraction=round(m["clip_fraction"], 4),
                       approx_kl=round(m["approx_kl_old"], 5))


if __name__ == "__main__":
    stage.run(app)
