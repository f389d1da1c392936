"""DVC stages `evaluate` and `baseline`: held-out accuracy of the trained policy, and of the starting model
(``--baseline``; greedy decoding; multi-turn with the environment of generate.environment when one is set).

    python stages/evaluate.py --params params.yaml --prompts EVAL.parquet --policy CHECKPOINT \
        --out eval_rollouts.parquet --metrics metrics/evaluate.json
    python stages/evaluate.py --params params.yaml --prompts EVAL.parquet --policy artifacts/prepare/model \
        --baseline --out artifacts/baseline/eval_rollouts.parquet --metrics metrics/baseline.json

The logic is rlpipe/stages/evaluate.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import sys

import typer

from rlpipe.config import load_params
from rlpipe.data.io import read_metadata, read_policy_version, write_artifact
from rlpipe.data.schema import EVAL_ROLLOUTS, PROMPT_MESSAGES_KEY
from rlpipe.errors import ConfigError
from rlpipe.models.loading import setup_torch
from rlpipe.stages.evaluate import evaluate_policy, greedy_engine, read_inputs

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("evaluate")
def main(params: str = typer.Option("params.yaml", help="params file"),
         prompts: str = typer.Option(..., help="held-out prompt table (prepare's eval_prompts)"),
         policy: str = typer.Option(..., help="model directory to evaluate (train's checkpoint)"),
         out: str = typer.Option(..., help="eval rollout table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write"),
         baseline: bool = typer.Option(False, help="--policy is the starting model (policy version 0): the "
                                                   "baseline stage")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.evaluate
        setup_torch(p.torch_threads, 0)
    with timer.phase("read"):
        inputs = read_inputs(p, prompts, policy)
    version = read_policy_version(policy)
    if baseline and version not in (None, 0):
        raise ConfigError(f"--baseline: {policy} holds policy version {version}, not the starting model (0)")
    version = 0 if baseline else version
    with timer.phase("engine_start"):
        engine = greedy_engine(p, policy, inputs)
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
    print(closing_line(p.iteration, version, policy, baseline=baseline), file=sys.stderr)


def closing_line(iteration: int, version: int | None, policy: str, *, baseline: bool) -> str:
    """What to do next, true to what was evaluated: the iteration's trained policy (version iteration + 1),
    the starting model, or another model dir (a script run by hand)."""
    if baseline:
        return ("rlpipe: the starting model evaluated (the first point of every eval curve; runs once, "
                "not per iteration)")
    if version == iteration + 1:
        return (f"rlpipe: iteration {iteration} trained and evaluated; next: `rlpipe inspect . --show 4` (its "
                "rollouts), `dvc metrics show`, then `rlpipe iterate` (commit + tag it, start the next)")
    return f"rlpipe: evaluated {policy} (policy version {'unknown' if version is None else version})"


if __name__ == "__main__":
    stage.run(app)
