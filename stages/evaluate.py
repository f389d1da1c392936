"""DVC stage `evaluate`: held-out accuracy of the trained policy (greedy decoding; multi-turn with the
environment of generate.environment when one is set).

    python stages/evaluate.py --params params.yaml --prompts EVAL.parquet --policy CHECKPOINT \
        --out eval_rollouts.parquet --metrics metrics/evaluate.json

The logic is rlpipe/stages/evaluate.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import sys

import typer

from rlpipe.config import load_params
from rlpipe.data.io import read_metadata, read_policy_version, write_artifact
from rlpipe.data.schema import EVAL_ROLLOUTS, PROMPT_MESSAGES_KEY
from rlpipe.models.loading import setup_torch
from rlpipe.stages.evaluate import evaluate_policy, greedy_engine, read_inputs

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
        inputs = read_inputs(p, prompts, policy)
    with timer.phase("engine_start"):
        engine = greedy_engine(p, policy, inputs)
    version = read_policy_version(policy)
    with timer.phase("compute"):
        frame, m = evaluate_policy(engine, inputs.prompts, cfg=cfg, score_cfg=p.score,
                                   policy_version=-1 if version is None else version,
                                   decode=lambda ids: inputs.tokenizer.decode(ids, skip_special_tokens=True),
                                   multi_turn=inputs.multi_turn,
                                   messages_field=read_metadata(prompts).get(PROMPT_MESSAGES_KEY))
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
