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
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.engines.base import derive_seed
from rlpipe.errors import ArtifactError
from rlpipe.data.io import read_artifact
from rlpipe.models.loading import load_tokenizer, setup_torch
from rlpipe.progress import stage_progress
from rlpipe.stages.train_reward_model import (HEAD_STREAM, SHUFFLE_STREAM, SPLIT_STREAM, PreferencePairs, count_steps,
                                 evaluate_pairs, split_pairs, train_bradley_terry, write_placeholder)
from rlpipe.data.schema import PREFERENCES
from rlpipe.models.value_model import load_scalar_model, save_scalar_model

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
        prefs = read_artifact(preferences, PREFERENCES)
    reason = None
    if not cfg.train:  # why: a fresh project would otherwise train a model that no configured reward reads
        reason = f"{params}: reward_model.train is false (set it to true to train a reward model on {preferences})"
    elif prefs.frame.height == 0:
        reason = f"{preferences} has no preference pairs (prepare.files.preferences is null)"
    if reason is not None:
        with timer.phase("write"):
            write_placeholder(out, reason=reason)
        pairs_in_file = prefs.frame.height
        stage.write_metrics(metrics, "train_reward_model", {"kind": "none", "reason": reason, "num_pairs": pairs_in_file},
                            timer)
        stage.summary_line("train_reward_model", pairs=pairs_in_file, model="none",
                           **({"train": "false"} if not cfg.train else {}), seconds=timer.report()["total"])
        return
    with timer.phase("read"):
        pairs = PreferencePairs.from_frame(prefs.frame)
        tokenizer = load_tokenizer(init)
        model = load_scalar_model(init, seed=derive_seed(p.seed, HEAD_STREAM), device=cfg.device, dtype=cfg.dtype)
        vocab = model.body.get_input_embeddings().num_embeddings
        if pairs.max_token_id() >= vocab:
            raise ArtifactError(f"{preferences}: holds token id {pairs.max_token_id()} but {init} has a vocabulary of "
                                f"{vocab}; prepare the preferences with the reward model's tokenizer")
    pad = tokenizer.pad_token_id
    with timer.phase("compute"):
        train_idx, eval_idx = split_pairs(len(pairs), eval_fraction=cfg.eval_fraction,
                                          seed=derive_seed(p.seed, SPLIT_STREAM))
        before = evaluate_pairs(model, pairs, eval_idx, pad_token_id=pad)
        total = count_steps(len(train_idx), epochs=cfg.epochs, batch_size=cfg.batch_size)
        with stage_progress("train_reward_model", total=total, unit="steps") as advance:
            train_m = train_bradley_terry(model, pairs, train_idx, epochs=cfg.epochs, batch_size=cfg.batch_size,
                                          lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                                          seed=derive_seed(p.seed, SHUFFLE_STREAM), pad_token_id=pad,
                                          progress=advance)
        after = evaluate_pairs(model, pairs, eval_idx, pad_token_id=pad)
    with timer.phase("write"):
        save_scalar_model(model, tokenizer, out, info={"trained_by": "train_reward_model", "objective": "bradley_terry",
                                                       "num_train_pairs": len(train_idx)})
    m = {"kind": "bradley_terry", "num_pairs": len(pairs), "num_train_pairs": len(train_idx),
         "num_eval_pairs": len(eval_idx), "eval_accuracy_init": before["accuracy"],
         **{f"eval_{k}": v for k, v in after.items()}, **train_m}
    stage.write_metrics(metrics, "train_reward_model", m, timer)
    stage.summary_line("train_reward_model", pairs=len(pairs), steps=train_m["optimizer_steps"],
                       eval_accuracy=None if after["accuracy"] is None else round(after["accuracy"], 4),
                       seconds=timer.report()["total"])


if __name__ == "__main__":
    stage.run(app)
