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
like the prompts, or an empty table when that key is null.
"""
import rlpipe.stages.runner as stage  # first: starts the stage clock

import typer

from rlpipe.config import load_params
from rlpipe.engines.base import derive_seed
from rlpipe.data.io import write_artifact
from rlpipe.models.loading import load_tokenizer, setup_torch
from rlpipe.stages.prepare import preference_table, prompt_table, read_preference_rows, read_prompt_rows, use_chat_template
from rlpipe.data.schema import PREFERENCES, PROMPTS

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
    m: dict = {"source": cfg.source}
    if cfg.source == "tiny":
        from rlpipe.tiny.build import build_tiny_default
        from rlpipe.tiny.preferences import PREFERENCE_STREAM, make_preference_rows

        with timer.phase("compute"):
            tokenizer, train_rows, eval_rows, tiny_metrics = build_tiny_default(cfg.tiny, seed=p.seed,
                                                                                 model_dir=model_dir)
            pref_rows = make_preference_rows(train_rows, num_pairs=cfg.tiny.num_preference_pairs,
                                             seed=derive_seed(p.seed, PREFERENCE_STREAM))
        m.update(tiny_metrics)
        chat = bool(getattr(tokenizer, "chat_template", None))  # the calculator task has its own template
        sources = ("tiny task (train)", "tiny task (eval)")
        pref_source = "tiny task (preferences)"
    else:
        with timer.phase("read"):
            tokenizer = load_tokenizer(cfg.files.tokenizer_path)
            train_rows = read_prompt_rows(cfg.files.train, cfg.files)
            eval_rows = read_prompt_rows(cfg.files.eval, cfg.files)
            pref_source = cfg.files.preferences
            pref_rows = read_preference_rows(pref_source) if pref_source is not None else []
        chat = use_chat_template(tokenizer, cfg.files.chat_template)
        sources = (cfg.files.train, cfg.files.eval)
    with timer.phase("write"):
        tables = [prompt_table(rows, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, chat_template=chat,
                               source=src) for rows, src in zip((train_rows, eval_rows), sources)]
        write_artifact(tables[0], train_prompts, PROMPTS, metadata={"split": "train", "chat_template": chat})
        write_artifact(tables[1], eval_prompts, PROMPTS, metadata={"split": "eval", "chat_template": chat})
        prefs = preference_table(pref_rows, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, chat_template=chat,
                                 source=str(pref_source))
        write_artifact(prefs, preferences, PREFERENCES, metadata={"source": pref_source, "chat_template": chat})
    m.update({"num_train_prompts": tables[0].height, "num_eval_prompts": tables[1].height,
              "num_preference_pairs": prefs.height})
    stage.write_metrics(metrics, "prepare", m, timer)
    stage.summary_line("prepare", train=tables[0].height, eval=tables[1].height, preference_pairs=prefs.height,
                       seconds=timer.report()["total"])


if __name__ == "__main__":
    stage.run(app)
