"""TRL's two prompt formats, told apart by the prompt column's dtype, and the checks a message list passes.

Standard: each prompt is a string. Conversational: each prompt is a list of ``{role, content}`` messages
(system messages included) that the model's chat template renders, with the generation prompt added.
Why here, in data/: `rlpipe init` and the prepare stage read the same user files and must agree on what
they hold; only prepare renders (it has the tokenizer), but both refuse what cannot be rendered.
"""
from __future__ import annotations

from typing import Any

import polars as pl

from rlpipe.errors import ArtifactError, ConfigError

STANDARD = "standard"
CONVERSATIONAL = "conversational"


def column_format(dtype: pl.DataType) -> str | None:
    """STANDARD for strings, CONVERSATIONAL for lists of structs with role and content, else None.

    >>> column_format(pl.String), column_format(pl.List(pl.Struct({"role": pl.String, "content": pl.String})))
    ('standard', 'conversational')
    >>> column_format(pl.Int64) is None
    True
    """
    if dtype == pl.String:
        return STANDARD
    if isinstance(dtype, pl.List) and isinstance(dtype.inner, pl.Struct):
        if {"role", "content"} <= {f.name for f in dtype.inner.fields}:
            return CONVERSATIONAL
    return None


def prompt_format(frame: pl.DataFrame, column: str, source: Any) -> str:
    """The format of ``frame``'s prompt column; an error naming ``source`` and the column for any other dtype."""
    dtype = frame.schema[column]
    found = column_format(dtype)
    if found is None:
        raise ArtifactError(f"{source}: column {column!r} must hold strings (TRL's standard format) or lists of "
                            f"{{role, content}} messages (its conversational format), has {dtype}")
    return found


def checked_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """One conversational prompt's messages, each with only the fields it sets.

    Why drop null fields: polars gives every message every field any message of the file has (a
    ``name`` on one message becomes ``name: None`` on all), which neither a chat template nor a reward
    expects. Errors name ``where`` (file and row) and the message's index.
    """
    if not isinstance(value, list) or not value:
        raise ArtifactError(f"{where}: prompt must be a non-empty list of {{role, content}} messages, got {value!r}")
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"] \
                or not isinstance(message.get("content"), str):
            raise ArtifactError(f"{where}: message {j} needs a role and a string content, got {message!r}")
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def ends_with_reply(messages: list[dict[str, Any]]) -> bool:
    """True when the last message is the assistant's: a reply begun for the model to continue (TRL's
    "bootstrap"), rendered without a new generation prompt; rewards see it as the start of the completion.

    >>> ends_with_reply([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}])
    True
    """
    return bool(messages) and messages[-1].get("role") == "assistant"


def same_format(formats: dict[Any, str]) -> str:
    """The one format of every prompt file (train, eval); an error naming each file's when they differ.

    Why refuse a mix: a reward receives prompts and completions as strings or as message lists, one or
    the other for the whole project (as TRL decides per dataset).
    """
    if len(set(formats.values())) > 1:
        listed = ", ".join(f"{source} is {fmt}" for source, fmt in formats.items())
        raise ArtifactError(f"the prompt files must share one format (rewards get strings or message lists, "
                            f"not both): {listed}")
    return next(iter(formats.values()))


def require_chat_template(tokenizer: Any, *, model_dir: Any, source: Any, mode: str = "auto") -> None:
    """Refuse conversational prompts that the model cannot render: no chat template, or the template turned off."""
    if mode == "off":
        raise ConfigError(f"{source} holds conversational prompts (lists of messages), which only a chat template "
                          "turns into text, but prepare.files.chat_template is 'off'; set it to auto or on")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{source} holds conversational prompts (lists of messages), but the tokenizer in "
                          f"{model_dir} has no chat template to render them with; save one with the tokenizer "
                          "(tokenizer.chat_template = ...; tokenizer.save_pretrained(DIR)) or give each prompt "
                          "as a string")
