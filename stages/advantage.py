"""DVC stage `advantage`: advantages from the rewards (numpy/polars, no model).

    python stages/advantage.py --params params.yaml --rollouts R.parquet --scores S.parquet \
        --ref-logprobs F.parquet --values V.parquet --out advantages.parquet \
        --kl-controller kl_controller.json --metrics metrics/advantage.json

The reference log-probs are read only by the estimators with the KL in the reward
(reinforce_plus_plus, gae), the values only by gae; the KL-controller record is always written.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.models.critic import require_critic_values
from rlpipe.stages.advantage import check_finite_rewards, compute_advantages
from rlpipe.rewards.registry import component_column
from rlpipe.config import load_params
from rlpipe.errors import ArtifactError
from rlpipe.data.io import join_on_keys, read_artifact, write_artifact, write_json
from rlpipe.data.schema import ADVANTAGES, REF_LOGPROBS, ROLLOUTS, SCORES, VALUES

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
        cfg = p.advantage
        weights = ({component_column(e.name): e.weight for e in p.score.rewards}
                   if cfg.uses_reward_components else None)
    with timer.phase("read"):
        roll = read_artifact(rollouts, ROLLOUTS)
        rows = join_on_keys(roll, read_artifact(scores, SCORES), columns=["reward", *(weights or {})])
        check_finite_rewards(rows, scores, allow_nan=cfg.nan_rewards == "zero_advantage")
        wanted = ["prompt_id", "sample_idx", "reward", "completion_length", "truncated", "policy_mask",
                  "finish_reason", *(weights or {})]
        if cfg.uses_token_rewards:
            rows = join_on_keys(roll.with_frame(rows),
                                read_artifact(_need(ref_logprobs, "--ref-logprobs", cfg.estimator), REF_LOGPROBS),
                                columns=["ref_logprobs"])
            wanted += ["sampler_logprobs", "ref_logprobs"]
        if cfg.needs_critic:
            table = require_critic_values(read_artifact(_need(values, "--values", cfg.estimator), VALUES))
            rows = join_on_keys(roll.with_frame(rows), table, columns=["values"])
            wanted += ["values"]
    with timer.phase("compute"):
        adv, m, kl_state = compute_advantages(rows.select(wanted), cfg, weights)
    with timer.phase("write"):
        write_artifact(adv, out, ADVANTAGES, metadata={"policy_version": roll.metadata.get("policy_version")})
        write_json(kl_controller, {**kl_state, "policy_version": roll.metadata.get("policy_version")})
    stage.write_metrics(metrics, "advantage", m, timer)
    stage.summary_line("advantage", rows=m["num_samples"], trained=m["num_trained"], seconds=timer.report()["total"])


def _need(path: str | None, option: str, estimator: str) -> str:
    if not path:
        raise ArtifactError(f"advantage.estimator {estimator!r} needs {option}")
    return path


if __name__ == "__main__":
    stage.run(app)
