"""DVC stage `generate`: sample G completions per prompt with the current policy (pi_old).

    python stages/generate.py --params params.yaml --prompts P.parquet --policy MODEL_DIR \
        --out rollouts.parquet --metrics metrics/generate.json
"""
import rlpipe.stage as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.errors import ArtifactError
from rlpipe.generate import (check_context, choose_engine, generate_rollouts, make_engine, rollout_metrics,
                             select_prompts)
from rlpipe.io import read_artifact, write_artifact
from rlpipe.models import (load_tokenizer, model_eos_token_ids, read_model_config, read_policy_version,
                           setup_torch)
from rlpipe.progress import stage_progress
from rlpipe.schema import PROMPTS, ROLLOUTS

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("generate")
def main(params: str = typer.Option("params.yaml", help="params file"),
         prompts: str = typer.Option(..., help="prompt table (prepare's train_prompts)"),
         policy: str = typer.Option(..., help="model directory of the sampling policy"),
         out: str = typer.Option(..., help="rollout table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
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
        tokenizer = load_tokenizer(policy)
        check_context(table, max_new_tokens=cfg.max_new_tokens, source=prompts, setting="generate.max_new_tokens",
                      context_length=getattr(read_model_config(policy), "max_position_embeddings", None))
    with timer.phase("engine_start"):
        # The project's engine server when one runs with these settings; else loads the weights here
        # (hf: with transformers; vllm: in its own workers, so CUDA stays uninitialised in this process).
        engine = make_engine(cfg, engine=choose_engine(cfg), model_dir=policy,
                             eos_token_ids=model_eos_token_ids(policy, tokenizer), pad_token_id=tokenizer.pad_token_id)
    with timer.phase("compute"):
        with stage_progress("generate", total=table.height * cfg.group_size, unit="samples") as advance:
            rollouts = generate_rollouts(engine, table, cfg=cfg, seed=p.seed, iteration=p.iteration,
                                         policy_version=p.policy.version,
                                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                         progress=advance)
        if hasattr(engine, "close"):
            engine.close()  # vllm: stop its worker processes here; stage.run ends with os._exit
    with timer.phase("write"):
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                    "max_new_tokens": cfg.max_new_tokens, "group_size": cfg.group_size}
        write_artifact(rollouts, out, ROLLOUTS, metadata={"policy_version": p.policy.version, "sampling": sampling,
                                                          "engine": engine.name})
    m = rollout_metrics(rollouts)
    stage.write_metrics(metrics, "generate", {**m, "engine": engine.name, "policy_version": p.policy.version,
                                              "iteration": p.iteration,
                                              **stage.engine_metrics(engine)}, timer)
    stage.summary_line("generate", rows=m["num_samples"], tokens=m["completion_tokens"],
                       seconds=timer.report()["total"], truncation_rate=round(m["truncation_rate"], 3))


if __name__ == "__main__":
    stage.run(app)
