"""DVC stage `prepare`: build the prompt tables (and, for the embedded default, the tiny model).

    python stages/prepare.py --params params.yaml --model-dir artifacts/prepare/model \
        --train-prompts TRAIN.parquet --eval-prompts EVAL.parquet --preferences PREFS.parquet \
        --metrics metrics/prepare.json

With ``prepare.source: tiny`` it builds a character tokenizer, a tiny Llama and an addition task
from the seed, warm-starts the model and saves it to --model-dir. With ``source: files`` it reads
the user's prompt files, tokenizes them with ``prepare.files.tokenizer_path`` and writes only
the prompt tables (--model-dir is left alone).

It also writes the reward model's preference table: for the tiny task a synthetic set drawn from
the train prompts (rlpipe/tiny/preferences.py); for files, ``prepare.files.preferences`` tokenized
like the prompts, or an empty table when that key is null. The logic is rlpipe/stages/prepare.py.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.data.io import write_artifact
from rlpipe.data.schema import PREFERENCES, PROMPTS
from rlpipe.models.loading import setup_torch
from rlpipe.stages import prepare

app = typer.Typer(add_completion=False)


@app.command()
@stage.stage_main("prepare")
def main(params: str = typer.Option("params.yaml", help="params file"),
         model_dir: str = typer.Option(..., help="where the tiny default's model is written (source: tiny)"),
         train_prompts: str = typer.Option(..., help="train prompt table to write"),
         eval_prompts: str = typer.Option(..., help="held-out prompt table to write"),
         preferences: str = typer.Option(..., help="reward-model preference table to write (may be empty)"),
         metrics: str = typer.Option(..., help="metrics JSON to write")) -> None:
    timer = stage.PhaseTimer()
    with timer.phase("setup"):
        p = load_params(params)
        cfg = p.prepare
        setup_torch(p.torch_threads, p.seed)
    if cfg.source == "tiny":
        with timer.phase("compute"):
            sources = prepare.build_tiny_sources(cfg, seed=p.seed, model_dir=model_dir)
    else:
        with timer.phase("read"):
            sources = prepare.read_file_sources(cfg, rewards=p.score.rewards)
    chat = sources.chat_template
    with timer.phase("write"):
        train, held_out, prefs = prepare.tables(sources, max_prompt_tokens=cfg.max_prompt_tokens)
        write_artifact(train, train_prompts, PROMPTS, metadata=prepare.prompt_footer(sources, "train"))
        write_artifact(held_out, eval_prompts, PROMPTS, metadata=prepare.prompt_footer(sources, "eval"))
        write_artifact(prefs, preferences, PREFERENCES, metadata={"source": sources.preferences_source,
                                                                  "chat_template": chat})
    m = {"source": cfg.source, **sources.metrics, "num_train_prompts": train.height,
         "num_eval_prompts": held_out.height, "num_preference_pairs": prefs.height}
    stage.write_metrics(metrics, "prepare", m, timer)
    stage.summary_line("prepare", train=train.height, eval=held_out.height, preference_pairs=prefs.height,
                       seconds=timer.report()["total"])


if __name__ == "__main__":
    stage.run(app)
