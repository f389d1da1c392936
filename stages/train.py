"""DVC stage `train`: mu epochs of policy updates (GRPO/PPO-clip/GSPO) on this iteration's rollouts,
and for PPO (advantage.estimator: gae) of the critic alongside.

    python stages/train.py --params params.yaml --rollouts R.parquet --scores S.parquet \
        --ref-logprobs F.parquet --advantages A.parquet --values V.parquet --policy MODEL_DIR \
        --critic CRITIC_DIR --checkpoint OUT_DIR --critic-checkpoint CRITIC_OUT_DIR \
        --token-stats T.parquet --metrics metrics/train.json --steps plots/train_steps.csv

Without a critic (every estimator but gae) --critic-checkpoint gets a directory holding only
rlpipe.json with ``kind: none``: DVC needs the declared output, and the file says why it is empty.
On several GPUs (FSDP2; docs/distributed.md), the same arguments under
``torchrun --standalone --nproc_per_node 2 stages/train.py ...``. The logic is rlpipe/stages/train.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.distributed import finish, start
from rlpipe.engines.logprobs import compile_seconds
from rlpipe.models.loading import setup_torch
from rlpipe.progress import stage_progress
from rlpipe.stages import train

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("train")
def main(params: str = typer.Option("params.yaml", help="params file"),
         rollouts: str = typer.Option(..., help="rollout table"),
         scores: str = typer.Option(..., help="score table (for reward statistics)"),
         ref_logprobs: str = typer.Option(..., help="reference log-prob table"),
         advantages: str = typer.Option(..., help="advantage table"),
         values: str = typer.Option(None, help="critic value table (gae)"),
         policy: str = typer.Option(..., help="model directory of pi_old (the sampler), the starting weights"),
         critic: str = typer.Option(None, help="critic dir, or a causal-LM dir to start one from (gae)"),
         checkpoint: str = typer.Option(..., help="directory to write the trained model + tokenizer to"),
         critic_checkpoint: str = typer.Option(None, help="directory to write the trained critic to"),
         token_stats: str = typer.Option(..., help="per-token trainer statistics table to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write"),
         steps: str = typer.Option(..., help="per-optimizer-step CSV to write (DVC plots)"),
         resume_root: str = typer.Option(".rlpipe/resume", help="where a killed run's resume state is kept")) -> None:
    timer = stage.PhaseTimer()
    paths = train.TrainPaths(rollouts, scores, ref_logprobs, advantages, values, policy, critic, checkpoint,
                             critic_checkpoint, token_stats, steps, resume_root)
    with timer.phase("setup"):
        p = load_params(params)
        dist = start(p.train.device)  # None unless launched by torchrun
        writes = dist is None or dist.is_main  # under torchrun rank 0 alone writes
        setup_torch(p.torch_threads, p.seed)
    with timer.phase("read"):
        inputs = train.read_inputs(p, paths, dist)
        trainees = train.load_trainees(p, paths, dist)
    with timer.phase("compute"):
        data, total = train.trainer_data(inputs, p, dist)
        states = train.resume_states(p, paths, dist)
        with stage_progress("train", total=total, unit="steps") as advance:
            updates = train.run_updates(p, inputs, trainees, data, states, policy=policy, progress=advance)
    timer.move(compile_seconds(), to="compile")
    with timer.phase("write"):
        saved = train.write_outputs(p, paths, inputs, trainees, updates, states, writes=writes)
    m = train.train_metrics(p, inputs, trainees, updates, saved, states)  # under torchrun: a collective
    finish(dist)
    if not writes:
        return
    stage.write_metrics(metrics, "train", m, timer)
    stage.summary_line("train", steps=m["optimizer_steps"], sequences=m["trained_sequences"],
                       seconds=timer.report()["total"], clip_fraction=round(m["clip_fraction"], 4),
                       approx_kl=round(m["approx_kl_old"], 5))


if __name__ == "__main__":
    stage.run(app)
