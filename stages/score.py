"""DVC stage `score`: reward every rollout with the configured reward functions (logic: rlpipe/stages/score.py).

    python stages/score.py --params params.yaml --rollouts R.parquet --prompts P.parquet \
        --out scores.parquet --metrics metrics/score.json
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.data.io import read_artifact, stream_artifact, write_artifact
from rlpipe.data.schema import PROMPT_MESSAGES_KEY, PROMPTS, ROLLOUTS, SCORES
from rlpipe.progress import stage_progress
from rlpipe.stages.score import rows_to_score, score_batches, scored_rollout_columns

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("score")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table (generate's output)"),
         prompts: str = typer.Option(..., help="prompt table with answers (prepare's train_prompts)"),
         out: str = typer.Option(..., help="score table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        cfg = load_params(params).score
    with timer.phase("read"):  # the prompts; the rollouts are read a batch at a time while scoring
        roll = stream_artifact(rollouts, ROLLOUTS, columns=scored_rollout_columns(cfg))
        prompt_artifact = read_artifact(prompts, PROMPTS)
        prompt_table = prompt_artifact.frame
    with timer.phase("compute"):
        batches = (rows_to_score(batch, prompt_table, rollouts_path=rollouts, prompts_path=prompts)
                   for batch in roll.batches)
        with stage_progress("score", total=roll.num_rows, unit="rows") as advance:
            scores, m = score_batches(batches, cfg, progress=advance,
                                      messages_field=prompt_artifact.metadata.get(PROMPT_MESSAGES_KEY))
    with timer.phase("write"):
        write_artifact(scores, out, SCORES, metadata={"policy_version": roll.metadata.get("policy_version")})
    stage.write_metrics(metrics, "score", m, timer)
    stage.summary_line("score", rows=m["num_samples"], seconds=timer.report()["total"],
                       reward_mean=round(m["reward_mean"], 4), errors=m["errors"])


if __name__ == "__main__":
    stage.run(app)
