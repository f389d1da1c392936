"""DVC stage `generate`: sample G completions per prompt with the current policy (pi_old).

    python stages/generate.py --params params.yaml --prompts P.parquet --policy MODEL_DIR \
        --out rollouts.parquet --metrics metrics/generate.json

With ``generate.environment.name`` set the rollouts are multi-turn (docs/multi-turn.md): an
environment answers each model turn, and finished chunks are kept under --resume-root so that a
killed stage resumes where it was. The logic is rlpipe/stages/generate.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.data.io import write_artifact
from rlpipe.data.schema import ROLLOUTS
from rlpipe.models.loading import setup_torch
from rlpipe.progress import stage_progress
from rlpipe.stages import generate

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
        generate.check_sampler_dir(policy, p)
        kind = generate.choose_engine(cfg)
        dist = generate.generation_ranks(cfg, kind)  # None unless several processes share it, one engine each
    with timer.phase("read"):
        inputs = generate.read_inputs(p, prompts, policy, resume_root=resume_root,
                                      warn=lambda message: stage.warn("generate", message),
                                      rank=(dist.rank, dist.world_size) if dist else (0, 1))
    with timer.phase("engine_start"):
        # The project's engine server when one runs with these settings; else loads the weights here
        # (hf: with transformers; vllm: in its own workers, so CUDA stays uninitialised in this process).
        engine = generate.make_engine(cfg, engine=kind, model_dir=policy,
                                      eos_token_ids=inputs.eos_token_ids, pad_token_id=inputs.tokenizer.pad_token_id)
    with timer.phase("compute"):
        with stage_progress("generate", total=inputs.prompts.height * cfg.group_size, unit="samples") as advance:
            rollouts, resumed_chunks = generate.sample(engine, inputs, p, progress=advance)
        if hasattr(engine, "close"):
            engine.close()  # vllm: stop its worker processes here; stage.run ends with os._exit
        rollouts = generate.gather_rollouts(dist, rollouts, inputs)
        if rollouts is None:  # not rank 0: its rows are with rank 0, which writes
            return
    with timer.phase("write"):
        write_artifact(rollouts, out, ROLLOUTS, metadata=generate.rollout_metadata(cfg, engine=engine.name,
                                                                                   policy_version=p.policy.version))
        if inputs.multi_turn is not None:
            inputs.multi_turn.clear()
    m = generate.rollout_metrics(rollouts, multi_turn=cfg.environment.multi_turn)
    if resumed_chunks is not None:
        m["resumed_chunks"] = resumed_chunks
    stage.write_metrics(metrics, "generate", {**m, "engine": engine.name, "policy_version": p.policy.version,
                                              "iteration": p.iteration, **stage.engine_metrics(engine)}, timer)
    stage.summary_line("generate", rows=m["num_samples"], tokens=m["completion_tokens"],
                       seconds=timer.report()["total"], truncation_rate=round(m["truncation_rate"], 3))


if __name__ == "__main__":
    stage.run(app)
