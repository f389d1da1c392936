"""DVC stage `evaluate`: held-out accuracy of the trained policy (greedy decoding; multi-turn with the
environment of generate.environment when one is set).

    python stages/evaluate.py --params params.yaml --prompts EVAL.parquet --policy CHECKPOINT \
        --out eval_rollouts.parquet --metrics metrics/evaluate.json
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import sys

import typer

from rlpipe.config import load_params
from rlpipe.stages.evaluate import evaluate_policy
from rlpipe.stages.generate import GREEDY_TEMPERATURE, build_engine, check_context, multi_turn_setup, resolve_engine
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.models.loading import load_tokenizer, model_eos_token_ids, read_model_config, read_policy_version, setup_torch
from rlpipe.data.schema import EVAL_ROLLOUTS, PROMPTS

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("evaluate")
def main(params: str = typer.Option("params.yaml", help="params file"),
         prompts: str = typer.Option(..., help="held-out prompt table (prepare's eval_prompts)"),
         policy: str = typer.Option(..., help="model directory to evaluate (train's checkpoint)"),
         out: str = typer.Option(..., help="eval rollout table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.evaluate
        setup_torch(p.torch_threads, 0)
    with timer.phase("read"):
        table = read_artifact(prompts, PROMPTS).frame
        tokenizer = load_tokenizer(policy)
        env = p.generate.environment
        check_context(table, max_new_tokens=env.max_total_tokens if env.multi_turn else cfg.max_new_tokens,
                      source=prompts,
                      setting="generate.environment.max_total_tokens" if env.multi_turn else "evaluate.max_new_tokens",
                      context_length=getattr(read_model_config(policy), "max_position_embeddings", None))
        eos = model_eos_token_ids(policy, tokenizer)
        # multi-turn (generate.environment): greedy turns with the same environment and limits as generate
        setup = multi_turn_setup(p.generate, tokenizer, eos_token_ids=eos, source=policy) if env.multi_turn else None
    with timer.phase("engine_start"):
        engine = build_engine(resolve_engine(cfg.engine, cfg.device), device=cfg.device, dtype=cfg.dtype,
                              batch_size=cfg.batch_size, vllm=p.generate.vllm, temperature=GREEDY_TEMPERATURE,
                              model_dir=policy, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id,
                              section="evaluate")
    version = read_policy_version(policy)
    with timer.phase("compute"):
        frame, m = evaluate_policy(engine, table, cfg=cfg, score_cfg=p.score,
                                   policy_version=-1 if version is None else version,
                                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                   multi_turn=setup)
        if hasattr(engine, "close"):
            engine.close()  # vllm: stop its worker processes here; stage.run ends with os._exit
    with timer.phase("write"):
        write_artifact(frame, out, EVAL_ROLLOUTS, metadata={"policy_version": version})
    stage.write_metrics(metrics, "evaluate", {**m, "engine": engine.name, **stage.engine_metrics(engine)}, timer)
    stage.summary_line("evaluate", prompts=m["num_prompts"], seconds=timer.report()["total"], accuracy=m["accuracy"])
    print(f"rlpipe: iteration {p.iteration} trained and evaluated; next: `rlpipe inspect . --show 4` (its rollouts), "
          "`dvc metrics show`, then `rlpipe iterate` (commit + tag it, start the next)", file=sys.stderr)


if __name__ == "__main__":
    stage.run(app)
