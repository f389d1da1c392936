"""DVC stage `generate`: sample G completions per prompt with the current policy (pi_old).

    python stages/generate.py --params params.yaml --prompts P.parquet --policy MODEL_DIR \
        --out rollouts.parquet --metrics metrics/generate.json

With ``generate.environment.name`` set the rollouts are multi-turn (docs/multi-turn.md): an
environment answers each model turn, and finished chunks are kept under --resume-root so that a
killed stage resumes where it was.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.errors import ArtifactError
from rlpipe.stages.generate import (check_context, choose_engine, generate_multi_turn, generate_rollouts, make_engine,
                             multi_turn_setup, rollout_metrics, select_prompts)
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.models.loading import (load_tokenizer, model_eos_token_ids, read_model_config, read_policy_version,
                           setup_torch)
from rlpipe.environments.template import tokenizer_hash
from rlpipe.progress import stage_progress
from rlpipe.data.schema import PROMPTS, ROLLOUTS

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("generate")
def main(params: str = typer.Option("params.yaml", help="params file"),
         prompts: str = typer.Option(..., help="prompt table (prepare's train_prompts)"),
         policy: str = typer.Option(..., help="model directory of the sampling policy"),
         out: str = typer.Option(..., help="rollout table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write"),
         resume_root: str = typer.Option(".rlpipe/resume", help="where a killed multi-turn run's chunks are kept")
         ) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.generate
        setup_torch(p.torch_threads, p.seed)
        version = read_policy_version(policy)
        if version is not None and version != p.policy.version:
            raise ArtifactError(f"{policy}: holds policy version {version} but params policy.version is "
                                f"{p.policy.version} (iteration {p.iteration}); run `rlpipe iterate` "
                                "to advance, or fix policy.path")
    with timer.phase("read"):
        table = select_prompts(read_artifact(prompts, PROMPTS).frame, count=cfg.prompts_per_iteration,
                               seed=p.seed, iteration=p.iteration)
        if cfg.prompts_per_iteration > table.height:
            stage.warn("generate", f"generate.prompts_per_iteration is {cfg.prompts_per_iteration} but {prompts} "
                                   f"holds {table.height} prompts: every one is used, {table.height} x "
                                   f"{cfg.group_size} samples")
        tokenizer = load_tokenizer(policy)
        multi = cfg.environment.multi_turn
        check_context(table, max_new_tokens=cfg.max_completion_tokens, source=prompts,
                      setting="generate.environment.max_total_tokens" if multi else "generate.max_new_tokens",
                      context_length=getattr(read_model_config(policy), "max_position_embeddings", None))
        eos = model_eos_token_ids(policy, tokenizer)
        # multi-turn: the environment and the chat template are checked before any weight is loaded
        setup = multi_turn_setup(cfg, tokenizer, eos_token_ids=eos, source=policy,
                                 resume_root=resume_root, inputs=[prompts, policy],
                                 key_params={"seed": p.seed, "iteration": p.iteration, "policy_version": p.policy.version,
                                             "torch_threads": p.torch_threads}) if multi else None
    with timer.phase("engine_start"):
        # The project's engine server when one runs with these settings; else loads the weights here
        # (hf: with transformers; vllm: in its own workers, so CUDA stays uninitialised in this process).
        engine = make_engine(cfg, engine=choose_engine(cfg), model_dir=policy,
                             eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    with timer.phase("compute"):
        with stage_progress("generate", total=table.height * cfg.group_size, unit="samples") as advance:
            if multi:
                driver = setup.driver(engine, progress=advance)
                rollouts = generate_multi_turn(driver, table, seed=p.seed, iteration=p.iteration,
                                               policy_version=p.policy.version)
            else:
                rollouts = generate_rollouts(engine, table, cfg=cfg, seed=p.seed, iteration=p.iteration,
                                             policy_version=p.policy.version,
                                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                             progress=advance, tokenizer_hash=tokenizer_hash(tokenizer))
        if hasattr(engine, "close"):
            engine.close()  # vllm: stop its worker processes here; stage.run ends with os._exit
    with timer.phase("write"):
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                    "max_new_tokens": cfg.max_new_tokens, "group_size": cfg.group_size}
        extra = {"environment": cfg.environment.name} if multi else {}
        write_artifact(rollouts, out, ROLLOUTS, metadata={"policy_version": p.policy.version, "sampling": sampling,
                                                          "engine": engine.name, **extra})
        if multi:
            setup.clear()
    m = rollout_metrics(rollouts, multi_turn=multi)
    if multi:
        m["resumed_chunks"] = driver.resumed_chunks
    stage.write_metrics(metrics, "generate", {**m, "engine": engine.name, "policy_version": p.policy.version,
                                              "iteration": p.iteration,
                                              **stage.engine_metrics(engine)}, timer)
    stage.summary_line("generate", rows=m["num_samples"], tokens=m["completion_tokens"],
                       seconds=timer.report()["total"], truncation_rate=round(m["truncation_rate"], 3))


if __name__ == "__main__":
    stage.run(app)
