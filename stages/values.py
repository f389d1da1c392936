"""DVC stage `values`: the PPO critic's per-token values V_t of the rollouts, before GAE.

    python stages/values.py --params params.yaml --rollouts R.parquet --critic CRITIC_DIR \
        --out values.parquet --metrics metrics/values.json

Only `advantage.estimator: gae` needs a critic. For every other estimator the stage writes an
empty table (no torch, no model) so the DVC graph stays one graph: switching grpo <-> gae re-runs
this stage, and a GRPO iteration costs it a fraction of a second.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import polars as pl
import typer

from rlpipe.config import load_params
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import ROLLOUTS, VALUES

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("values")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table (generate's output)"),
         critic: str = typer.Option(..., help="critic dir (scalar-head model) or a causal-LM dir to start one from"),
         out: str = typer.Option(..., help="value table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
    with timer.phase("read"):
        roll = read_artifact(rollouts, ROLLOUTS)
    meta = {"policy_version": roll.metadata.get("policy_version"), "estimator": p.advantage.estimator}
    if not p.advantage.needs_critic:
        with timer.phase("write"):
            write_artifact(pl.DataFrame(schema=VALUES.polars_schema()), out, VALUES, metadata={**meta, "critic": None})
        stage.write_metrics(metrics, "values", {"critic": False, "num_samples": 0}, timer)
        stage.summary_line("values", critic="none", estimator=p.advantage.estimator)
        return
    from rlpipe.models.loading import setup_torch
    from rlpipe.stages.values import critic_values, values_metrics

    with timer.phase("compute"):
        setup_torch(p.torch_threads, p.seed)
        frame, critic_info = critic_values(roll.frame, critic, p.values, seed=p.seed)
    with timer.phase("write"):
        write_artifact(frame, out, VALUES, metadata={**meta, "critic": critic_info})
    m = {"critic": True, **values_metrics(frame)}
    stage.write_metrics(metrics, "values", m, timer)
    stage.summary_line("values", rows=m["num_samples"], seconds=timer.report()["total"],
                       value_mean=round(m["value_mean"], 4))


if __name__ == "__main__":
    stage.run(app)
