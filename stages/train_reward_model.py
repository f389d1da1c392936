"""DVC stage `train_reward_model`: a Bradley-Terry reward model on prepare's preference table.

    python stages/train_reward_model.py --params params.yaml --preferences PREFS.parquet \
        --init MODEL_DIR --out RM_DIR --metrics metrics/train_reward_model.json

Starts from the body of --init (a causal-LM directory, usually the policy or SFT model, so that it
shares the policy's tokenizer) plus a fresh seeded scalar head, or from a saved reward model to
continue training; writes a scalar-head model directory that the `reward_model` reward loads.
With ``reward_model.train: false`` (the default: no built-in reward but `reward_model` reads it) or an
empty preference table, it writes a placeholder directory holding only rlpipe.json
``{"kind": "none", "reason": ...}``: the stage succeeds in a fraction of a second, and the
`reward_model` reward fails with that reason if someone configures it. See docs/reward-model.md.
The logic is rlpipe/stages/train_reward_model.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.data.io import read_artifact
from rlpipe.data.schema import PREFERENCES
from rlpipe.engines.base import derive_seed
from rlpipe.models.loading import setup_torch
from rlpipe.models.value_model import save_scalar_model
from rlpipe.progress import stage_progress
from rlpipe.stages import train_reward_model as rm

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("train_reward_model")
def main(params: str = typer.Option("params.yaml", help="params file"),
         preferences: str = typer.Option(..., help="preference table (prepare's output)"),
         init: str = typer.Option(..., help="model directory to start from (a causal LM, or a saved reward model)"),
         out: str = typer.Option(..., help="reward model directory to write"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.reward_model
        setup_torch(p.torch_threads, p.seed)
    with timer.phase("read"):
        prefs = read_artifact(preferences, PREFERENCES).frame
    reason = rm.why_no_model(cfg, params=params, preferences=preferences, num_pairs=prefs.height)
    if reason is not None:
        with timer.phase("write"):
            rm.write_placeholder(out, reason=reason)
        stage.write_metrics(metrics, "train_reward_model",
                            {"kind": "none", "reason": reason, "num_pairs": prefs.height}, timer)
        stage.summary_line("train_reward_model", pairs=prefs.height, model="none",
                           **({"train": "false"} if not cfg.train else {}), seconds=timer.report()["total"])
        return
    with timer.phase("read"):
        pairs = rm.PreferencePairs.from_frame(prefs)
        tokenizer, model = rm.load_start(init, pairs, cfg, seed=p.seed, preferences=preferences)
    with timer.phase("compute"):
        train_idx, eval_idx = rm.split_pairs(len(pairs), eval_fraction=cfg.eval_fraction,
                                             seed=derive_seed(p.seed, rm.SPLIT_STREAM))
        total = rm.count_steps(len(train_idx), epochs=cfg.epochs, batch_size=cfg.batch_size)
        with stage_progress("train_reward_model", total=total, unit="steps") as advance:
            m = rm.fit(model, pairs, cfg, train_idx, eval_idx, seed=p.seed, pad_token_id=tokenizer.pad_token_id,
                       progress=advance)
    with timer.phase("write"):
        save_scalar_model(model, tokenizer, out, info={"trained_by": "train_reward_model", "objective": "bradley_terry",
                                                       "num_train_pairs": len(train_idx)})
    stage.write_metrics(metrics, "train_reward_model", m, timer)
    stage.summary_line("train_reward_model", pairs=len(pairs), steps=m["optimizer_steps"],
                       eval_accuracy=None if m["eval_accuracy"] is None else round(m["eval_accuracy"], 4),
                       seconds=timer.report()["total"])


if __name__ == "__main__":
    stage.run(app)
