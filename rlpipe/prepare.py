"""The prepare stage's logic: turn prompts (the tiny task's or the user's files) into prompt tables.

Tokenizing here, once, means every later stage sees exactly the tokens the sampler saw, chat
template included, and a prompt that cannot fit the model's context fails now, naming its row.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import polars as pl

from rlpipe.config import PromptFilesConfig
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.io import read_table_file


def use_chat_template(tokenizer: Any, mode: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has_template:
        raise ConfigError("prepare.files.chat_template is 'on' but the tokenizer has no chat template")
    return mode == "on" or (mode == "auto" and has_template)


def prompt_table(rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_prompt_tokens: int, chat_template: bool,
                 source: str) -> pl.DataFrame:
    """Rows of {prompt, answer, metadata} -> the PROMPTS table; prompt_id is the row number."""
    if not rows:
        raise ArtifactError(f"{source}: no prompts (empty file)")
    texts, ids = [], []
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ArtifactError(f"{source}: row {i}: prompt must be a non-empty string, got {prompt!r}")
        if chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = prompt
            token_ids = tokenizer(text)["input_ids"]
        if len(token_ids) > max_prompt_tokens:
            raise ArtifactError(f"{source}: row {i}: prompt has {len(token_ids)} tokens, more than "
                                f"prepare.max_prompt_tokens={max_prompt_tokens}")
        texts.append(text)
        ids.append(list(token_ids))
    answers = [None if r.get("answer") is None else str(r["answer"]) for r in rows]
    metadata = [json.dumps(r.get("metadata") or {}, sort_keys=True) for r in rows]
    return pl.DataFrame({
        "prompt_id": pl.Series(range(len(rows)), dtype=pl.Int64),
        "prompt": pl.Series(texts, dtype=pl.String),
        "prompt_token_ids": pl.Series(ids, dtype=pl.List(pl.Int32)),
        "answer": pl.Series(answers, dtype=pl.String),
        "metadata": pl.Series(metadata, dtype=pl.String),
    })


def read_prompt_rows(path: str | Path, cfg: PromptFilesConfig) -> list[dict[str, Any]]:
    """A user's prompt file (Parquet or JSONL) as {prompt, answer, metadata} rows.

    Columns other than the prompt and answer columns are kept as per-row metadata for reward
    functions (e.g. unit tests of a coding task).
    """
    frame = read_table_file(path)
    if frame.height == 0:
        raise ArtifactError(f"{path}: no prompts (empty file)")
    for key, col in (("prompt_column", cfg.prompt_column), ("answer_column", cfg.answer_column)):
        if col is not None and col not in frame.columns:
            raise ArtifactError(f"{path}: no column {col!r} (prepare.files.{key}); columns are {frame.columns}")
    if frame.schema[cfg.prompt_column] != pl.String:
        raise ArtifactError(f"{path}: column {cfg.prompt_column!r} must hold strings, "
                            f"has {frame.schema[cfg.prompt_column]}")
    extra = [c for c in frame.columns if c not in (cfg.prompt_column, cfg.answer_column)]
    rows = []
    for rec in frame.iter_rows(named=True):
        rows.append({
            "prompt": rec[cfg.prompt_column],
            "answer": rec[cfg.answer_column] if cfg.answer_column else None,
            "metadata": {c: rec[c] for c in extra},
        })
    return rows
