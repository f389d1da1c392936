"""DVC stage `advantage`: group-relative advantages from the rewards (numpy/polars, no model).

    python stages/advantage.py --params params.yaml --rollouts R.parquet --scores S.parquet \
        --out advantages.parquet --metrics metrics/advantage.json
"""
import rlpipe.stage as stage  # first: starts the stage clock

import typer

from rlpipe.advantage import check_finite_rewards, compute_advantages
from rlpipe.config import load_params
from rlpipe.io import join_on_keys, read_artifact, write_artifact
from rlpipe.schema import ADVANTAGES, ROLLOUTS, SCORES

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("advantage")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table (generate's output)"),
         scores: str = typer.Option(..., help="score table (score's output)"),
         out: str = typer.Option(..., help="advantage table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        cfg = load_params(params).advantage
    with timer.phase("read"):
        roll = read_artifact(rollouts, ROLLOUTS)
        rows = join_on_keys(roll, read_artifact(scores, SCORES), columns=["reward"])
        check_finite_rewards(rows, scores)
    with timer.phase("compute"):
        adv, m = compute_advantages(rows.select("prompt_id", "sample_idx", "reward", "completion_length",
                                                "truncated"), cfg)
    with timer.phase("write"):
        write_artifact(adv, out, ADVANTAGES, metadata={"policy_version": roll.metadata.get("policy_version")})
    stage.write_metrics(metrics, "advantage", m, timer)
    stage.summary_line("advantage", rows=m["num_samples"], trained=m["num_trained"], seconds=timer.report()["total"])


if __name__ == "__main__":
    stage.run(app)
