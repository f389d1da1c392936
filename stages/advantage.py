"""DVC stage `advantage`: advantages from the rewards (numpy/polars, no model).

    python stages/advantage.py --params params.yaml --rollouts R.parquet --scores S.parquet \
        --ref-logprobs F.parquet --values V.parquet --out advantages.parquet \
        --kl-controller kl_controller.json --metrics metrics/advantage.json

The reference log-probs are read only by the estimators with the KL in the reward
(reinforce_plus_plus, gae), the values only by gae; the KL-controller record is always written.
The logic is rlpipe/stages/advantage.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.data.io import write_artifact, write_json
from rlpipe.data.schema import ADVANTAGES
from rlpipe.stages.advantage import (compute_advantages, read_row_level, read_rows, reward_weights, stream_advantages,
                                     streams, token_sources)

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("advantage")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table (generate's output)"),
         scores: str = typer.Option(..., help="score table (score's output)"),
         ref_logprobs: str = typer.Option(None, help="reference log-prob table (reinforce_plus_plus, gae)"),
         values: str = typer.Option(None, help="critic value table (gae)"),
         out: str = typer.Option(..., help="advantage table to write"),
         kl_controller: str = typer.Option(..., help="KL-controller record (JSON) to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        weights = reward_weights(p)
        sources = token_sources(p.advantage, rollouts=rollouts, ref_logprobs=ref_logprobs, values=values)
    if streams(rollouts, p.advantage.estimator):  # too many tokens to hold: read, compute and write a chunk of rows at a time
        with timer.phase("compute"):
            roll, rows = read_row_level(p, rollouts=rollouts, scores=scores, weights=weights)
            metadata = {"policy_version": roll.metadata.get("policy_version")}
            m, kl_state = stream_advantages(rows, p.advantage, weights, sources, out, metadata)
    else:
        with timer.phase("read"):
            roll, rows = read_rows(p, rollouts=rollouts, scores=scores, ref_logprobs=sources.ref_logprobs,
                                   values=sources.values, weights=weights)
        with timer.phase("compute"):
            adv, m, kl_state = compute_advantages(rows, p.advantage, weights)
        with timer.phase("write"):
            write_artifact(adv, out, ADVANTAGES, metadata={"policy_version": roll.metadata.get("policy_version")})
    write_json(kl_controller, {**kl_state, "policy_version": roll.metadata.get("policy_version")})
    stage.write_metrics(metrics, "advantage", m, timer)
    stage.summary_line("advantage", rows=m["num_samples"], trained=m["num_trained"], seconds=timer.report()["total"])


if __name__ == "__main__":
    stage.run(app)
