"""The prepare stage's logic: turn prompts (the tiny task's or the user's files) into prompt tables,
and (prompt, chosen, rejected) pairs into the reward model's preference table.

Tokenizing here, once, means every later stage sees exactly the tokens the sampler saw, chat
template included, and a prompt that cannot fit the model's context fails now, naming its row.
Preference completions are tokenized as a rollout that stopped holds them: the text's tokens plus
EOS, so that the reward model is trained on the same token layout it later scores.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import polars as pl

from rlpipe.config import PrepareConfig, PromptFilesConfig
from rlpipe.data.conversation import (CONVERSATIONAL, checked_messages, column_format, ends_with_reply,
                                      prompt_format, require_chat_template, same_format)
from rlpipe.data.io import read_table_file
from rlpipe.data.schema import PROMPT_MESSAGES_KEY, user_column_name
from rlpipe.errors import ArtifactError, ConfigError


def use_chat_template(tokenizer: Any, mode: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has_template:
        raise ConfigError("prepare.files.chat_template is 'on' but the tokenizer has no chat template")
    return mode == "on" or (mode == "auto" and has_template)


def tokenize_prompt(prompt: Any, tokenizer: Any, *, max_prompt_tokens: int, chat_template: bool,
                    where: str) -> tuple[str, list[int]]:
    """(text after the chat template, its token ids); errors name ``where`` (file and row).

    ``prompt``: a string, or a conversational prompt's messages (`rlpipe.data.conversation`), which the
    chat template renders as they are, with the generation prompt added; a list ending with an assistant
    message is a reply begun for the model, continued where it stops (as TRL does).
    """
    if isinstance(prompt, list):
        prefilled = ends_with_reply(prompt)
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not prefilled,
                                             continue_final_message=prefilled)
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif not isinstance(prompt, str) or not prompt:
        raise ArtifactError(f"{where}: prompt must be a non-empty string, got {prompt!r}")
    elif chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = prompt
        token_ids = tokenizer(text)["input_ids"]
    if len(token_ids) > max_prompt_tokens:
        raise ArtifactError(f"{where}: prompt has {len(token_ids)} tokens, more than "
                            f"prepare.max_prompt_tokens={max_prompt_tokens}")
    return text, list(token_ids)


def prompt_table(rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_prompt_tokens: int, chat_template: bool,
                 source: str, user_columns: pl.DataFrame | None = None) -> pl.DataFrame:
    """Rows of {prompt, answer, metadata} -> the PROMPTS table; prompt_id is the row number.

    ``user_columns``: the file's own columns, one row per prompt, kept as typed columns after the schema's
    (`user_columns`); the tiny task has none.
    """
    if not rows:
        raise ArtifactError(f"{source}: no prompts (empty file)")
    texts, ids = [], []
    for i, row in enumerate(rows):
        text, token_ids = tokenize_prompt(row["prompt"], tokenizer, max_prompt_tokens=max_prompt_tokens,
                                          chat_template=chat_template, where=f"{source}: row {i}")
        texts.append(text)
        ids.append(token_ids)
    answers = [None if r.get("answer") is None else str(r["answer"]) for r in rows]
    metadata = [json.dumps(r.get("metadata") or {}, sort_keys=True) for r in rows]
    table = pl.DataFrame({
        "prompt_id": pl.Series(range(len(rows)), dtype=pl.Int64),
        "prompt": pl.Series(texts, dtype=pl.String),
        "prompt_token_ids": pl.Series(ids, dtype=pl.List(pl.Int32)),
        "answer": pl.Series(answers, dtype=pl.String),
        "metadata": pl.Series(metadata, dtype=pl.String),
    })
    return table if user_columns is None else table.hstack(user_columns)


def user_columns(frame: pl.DataFrame, cfg: PromptFilesConfig, path: str | Path) -> pl.DataFrame:
    """The columns of a user's prompt file that the prompt table keeps typed (schema.PROMPTS' user columns).

    Left out: the prompt column (the table's `prompt` holds it rendered, `metadata` as given) and an answer
    column named `answer` (the table's own). A name an rlpipe table uses gets the prefix `user_`
    (`rlpipe.data.schema.user_column_name`), so the rollout view never holds one name twice.
    """
    kept = [c for c in frame.columns if c != cfg.prompt_column and not (c == "answer" == cfg.answer_column)]
    names = {c: user_column_name(c) for c in kept}
    clashes = sorted(c for c, name in names.items() if name != c and name in frame.columns)
    if clashes:
        raise ArtifactError(f"{path}: column {clashes[0]!r} is a name rlpipe's tables use, and its renamed form "
                            f"{names[clashes[0]]!r} is also a column of the file; rename one of them")
    return frame.select(pl.col(c).alias(names[c]) for c in kept)


@dataclass(frozen=True)
class PromptFile:
    """A user's prompt file as prepare reads it: its rows, its columns and its format (TRL's standard or
    conversational, `rlpipe.data.conversation`)."""

    rows: list[dict[str, Any]]
    columns: list[str]
    format: str
    user_columns: pl.DataFrame  # the columns the prompt table keeps typed (`user_columns`)


def read_prompt_rows(path: str | Path, cfg: PromptFilesConfig) -> PromptFile:
    """A user's prompt file (Parquet, JSONL or CSV) as {prompt, answer, metadata} rows.

    Every column of the file, the prompt and answer columns included, is kept as per-row metadata
    under its own name for reward functions (unit tests of a coding task; the raw prompt, as
    written before the chat template; a TRL-style reward's column arguments). A conversational
    prompt is its list of messages, there and in ``prompt``.
    """
    frame = read_table_file(path)
    if frame.height == 0:
        raise ArtifactError(f"{path}: no prompts (empty file)")
    for key, col in (("prompt_column", cfg.prompt_column), ("answer_column", cfg.answer_column)):
        if col is not None and col not in frame.columns:
            raise ArtifactError(f"{path}: no column {col!r} (prepare.files.{key}); columns are {frame.columns}")
    fmt = prompt_format(frame, cfg.prompt_column, path)
    rows = []
    for i, rec in enumerate(frame.iter_rows(named=True)):
        if fmt == CONVERSATIONAL:
            rec[cfg.prompt_column] = checked_messages(rec[cfg.prompt_column], f"{path}: row {i}")
        rows.append({
            "prompt": rec[cfg.prompt_column],
            "answer": rec[cfg.answer_column] if cfg.answer_column else None,
            "metadata": dict(rec),
        })
    return PromptFile(rows, frame.columns, fmt, user_columns(frame, cfg, path))


PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def completion_tokens(text: str, tokenizer: Any) -> list[int]:
    """A completion's token ids as a rollout that stopped holds them: the text's tokens, then EOS."""
    if tokenizer.eos_token_id is None:
        raise ArtifactError("the tokenizer has no EOS token; preference completions cannot be tokenized "
                            "like rollouts")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [int(tokenizer.eos_token_id)]


def preference_table(rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_prompt_tokens: int,
                     chat_template: bool, source: str) -> pl.DataFrame:
    """Rows of {prompt, chosen, rejected[, prompt_id]} -> the PREFERENCES table; pair_id is the row number.

    Zero rows give an empty table with the full schema (no preference data: train_reward_model then
    writes a placeholder). The prompt goes through the same chat template and length check as the
    prompt tables; chosen and rejected become their tokens plus EOS (`completion_tokens`).
    """
    cols: dict[str, list] = {c: [] for c in ("prompt", "prompt_token_ids", "chosen", "chosen_token_ids",
                                             "rejected", "rejected_token_ids")}
    for i, row in enumerate(rows):
        text, ids = tokenize_prompt(row["prompt"], tokenizer, max_prompt_tokens=max_prompt_tokens,
                                    chat_template=chat_template, where=f"{source}: row {i}")
        cols["prompt"].append(text)
        cols["prompt_token_ids"].append(ids)
        for key in ("chosen", "rejected"):
            if not isinstance(row[key], str):
                raise ArtifactError(f"{source}: row {i}: {key} must be a string, got {row[key]!r}")
            cols[key].append(row[key])
            cols[f"{key}_token_ids"].append(completion_tokens(row[key], tokenizer))
    return pl.DataFrame({
        "pair_id": pl.Series(range(len(rows)), dtype=pl.Int64),
        "prompt_id": pl.Series([row.get("prompt_id") for row in rows], dtype=pl.Int64),
        **{c: pl.Series(v, dtype=pl.List(pl.Int32) if c.endswith("_token_ids") else pl.String)
           for c, v in cols.items()},
    })


def read_preference_rows(path: str | Path) -> list[dict[str, Any]]:
    """A user's preference file (Parquet or JSONL) in either of TRL's formats, as {prompt, chosen, rejected} rows.

    Standard: ``prompt``, ``chosen``, ``rejected`` strings. Conversational: ``prompt`` a list of messages,
    ``chosen`` and ``rejected`` each the assistant's reply as a one-message list; the row's ``prompt``
    is then the message list (the chat template renders it), chosen and rejected the replies' text.
    Without a ``prompt`` column (TRL's implicit prompt) the prompt is what chosen and rejected share:
    their leading text, or every message but the last (`implicit_prompt`). Other columns are ignored;
    every pair needs every text, and an empty file is an error (set ``prepare.files.preferences:
    null`` when there is no preference data).
    """
    frame = read_table_file(path)
    columns = [c for c in PREFERENCE_COLUMNS if c != "prompt" or "prompt" in frame.columns]
    for col in PREFERENCE_COLUMNS[1:]:
        if col not in frame.columns:
            raise ArtifactError(f"{path}: no column {col!r} (prepare.files.preferences needs columns "
                                f"{list(PREFERENCE_COLUMNS)}, prompt optional); columns are {frame.columns}")
    for col in columns:
        if column_format(frame.schema[col]) is None:
            raise ArtifactError(f"{path}: column {col!r} must hold strings or lists of {{role, content}} "
                                f"messages, has {frame.schema[col]}")
        nulls = frame[col].null_count()
        if nulls:
            first = frame.with_row_index().filter(pl.col(col).is_null())["index"][0]
            raise ArtifactError(f"{path}: column {col!r} has {nulls} null value(s), first at row {first}")
    if frame.height == 0:
        raise ArtifactError(f"{path}: no preference pairs (empty file); set prepare.files.preferences: null "
                            "when there are none")
    return [preference_row(row, f"{path}: row {i}") for i, row in enumerate(frame.select(columns).iter_rows(named=True))]


def preference_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """One pair as {prompt, chosen, rejected}: the prompt a string or messages, chosen and rejected the replies' text."""
    if "prompt" not in row:
        row = implicit_prompt(row, where)
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        prompt = checked_messages(prompt, where)
    return {"prompt": prompt, "chosen": reply_text(row["chosen"], f"{where}: chosen"),
            "rejected": reply_text(row["rejected"], f"{where}: rejected")}


def reply_text(reply: Any, where: str) -> str:
    """A completion's text: a string as it is, or a conversational reply's one assistant message's content."""
    if isinstance(reply, str):
        return reply
    messages = checked_messages(reply, where)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise ArtifactError(f"{where}: must be one assistant message, as TRL's conversational preference format "
                            f"has it, got {messages!r}")
    return messages[0]["content"]


def implicit_prompt(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A pair without a prompt column split into prompt and replies: conversations share every message but their
    last, the assistant's reply; strings share their leading text, cut back to just after a space."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ArtifactError(f"{where}: chosen and rejected must both be strings or both be message lists")
    if not isinstance(chosen, str):
        chosen, rejected = checked_messages(chosen, f"{where}: chosen"), checked_messages(rejected, f"{where}: rejected")
        if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
            raise ArtifactError(f"{where}: without a prompt column, chosen and rejected must be the same "
                                "conversation up to their last message (the prompt), then differ in it")
        return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    cut = chosen.rfind(" ", 0, shared) + 1 if shared < len(chosen) and chosen[shared - 1:shared] != " " else shared
    if cut == 0:
        raise ArtifactError(f"{where}: without a prompt column, chosen and rejected must begin with the same "
                            "text (the prompt); these share none")
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


# --------------------------------------------------------------------------------------------
# the stage's steps, in the order stages/prepare.py calls them


@dataclass
class Sources:
    """The rows prepare tokenizes, the tokenizer to do it with, and where each set came from."""

    tokenizer: Any
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    preferences: list[dict[str, Any]]
    names: tuple[str, str]  # (train, eval): the files, or what built them; named in errors
    preferences_source: str | None  # the preference file or what built the pairs; None: no preference file
    chat_template: bool
    metrics: dict[str, Any] = field(default_factory=dict)  # what building the tiny default measured
    messages_field: str | None = None  # conversational prompts: the metadata field of their messages
    user_columns: tuple[pl.DataFrame | None, pl.DataFrame | None] = (None, None)  # (train, eval): the files' columns


def build_tiny_sources(cfg: PrepareConfig, *, seed: int, model_dir: str) -> Sources:
    """The embedded default: its tokenizer, tiny model (saved to ``model_dir``), task rows and preference pairs."""
    from rlpipe.engines.base import derive_seed
    from rlpipe.tiny.build import build_tiny_default
    from rlpipe.tiny.preferences import PREFERENCE_STREAM, make_preference_rows

    tokenizer, train_rows, eval_rows, tiny_metrics = build_tiny_default(cfg.tiny, seed=seed, model_dir=model_dir)
    pref_rows = make_preference_rows(train_rows, num_pairs=cfg.tiny.num_preference_pairs,
                                     seed=derive_seed(seed, PREFERENCE_STREAM))
    chat = bool(getattr(tokenizer, "chat_template", None))  # the calculator task has its own template
    return Sources(tokenizer, train_rows, eval_rows, pref_rows, ("tiny task (train)", "tiny task (eval)"),
                   "tiny task (preferences)", chat, tiny_metrics)


def read_file_sources(cfg: PrepareConfig, *, rewards: Sequence[Any] = ()) -> Sources:
    """The user's prompt files (and optional preference file), with the tokenizer they are prepared with.

    Refused here, before anything is written: conversational prompts the tokenizer cannot render, train
    and eval files of different formats, and a column a reward in ``rewards`` (score.rewards) needs that
    either file lacks (`rlpipe.rewards.columns`).
    """
    from rlpipe.models.loading import load_tokenizer
    from rlpipe.rewards.columns import check_reward_columns

    files = cfg.files
    tokenizer = load_tokenizer(files.tokenizer_path)
    train, held_out = read_prompt_rows(files.train, files), read_prompt_rows(files.eval, files)
    fmt = same_format({files.train: train.format, files.eval: held_out.format})
    if fmt == CONVERSATIONAL:
        require_chat_template(tokenizer, model_dir=files.tokenizer_path, source=files.train, mode=files.chat_template)
    try:
        check_reward_columns(rewards, {files.train: train.columns, files.eval: held_out.columns},
                             answer_column=files.answer_column)
    except ValueError as e:
        raise ConfigError(f"score.rewards: {e}") from None
    pref_rows = read_preference_rows(files.preferences) if files.preferences is not None else []
    if any(isinstance(row["prompt"], list) for row in pref_rows):
        require_chat_template(tokenizer, model_dir=files.tokenizer_path, source=files.preferences,
                              mode=files.chat_template)
    return Sources(tokenizer, train.rows, held_out.rows, pref_rows, (files.train, files.eval), files.preferences,
                   fmt == CONVERSATIONAL or use_chat_template(tokenizer, files.chat_template),
                   messages_field=files.prompt_column if fmt == CONVERSATIONAL else None,
                   user_columns=(train.user_columns, held_out.user_columns))


def prompt_footer(sources: Sources, split: str) -> dict[str, Any]:
    """A prompt table's footer metadata; the messages' field only for conversational prompts (the standard
    format's tables keep their bytes)."""
    footer: dict[str, Any] = {"split": split, "chat_template": sources.chat_template}
    if sources.messages_field is not None:
        footer[PROMPT_MESSAGES_KEY] = sources.messages_field
    return footer


def tables(sources: Sources, *, max_prompt_tokens: int) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """The train and eval prompt tables and the preference table, tokenized alike."""
    prompts = [prompt_table(rows, sources.tokenizer, max_prompt_tokens=max_prompt_tokens,
                            chat_template=sources.chat_template, source=name, user_columns=columns)
               for rows, name, columns in zip((sources.train, sources.eval), sources.names, sources.user_columns)]
    prefs = preference_table(sources.preferences, sources.tokenizer, max_prompt_tokens=max_prompt_tokens,
                             chat_template=sources.chat_template, source=str(sources.preferences_source))
    return prompts[0], prompts[1], prefs
