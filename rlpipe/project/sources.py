"""Bring a user's inputs into a new project: prompt files (any supported format), the model, reward modules.

Prompt files are copied as they are when the prepare stage reads their format (Parquet, JSONL,
CSV); a Hugging Face `datasets` directory (`save_to_disk`) is converted once to Parquet, so the
pipeline never needs `datasets` (and never downloads: only `load_from_disk` is used).
"""
from __future__ import annotations

import importlib
import inspect
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import polars as pl
import yaml

from rlpipe.config import UNSET_OPTION
from rlpipe.data.conversation import CONVERSATIONAL, checked_messages, prompt_format, require_chat_template
from rlpipe.data.io import read_table_file
from rlpipe.errors import ArtifactError, ConfigError

TABLE_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".csv")


def is_hf_dataset_dir(path: Path) -> bool:
    """A directory written by `datasets` (`Dataset.save_to_disk` or `DatasetDict.save_to_disk`)."""
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_info.json",
                                                               "dataset_dict.json"))


def import_prompt_file(src: str | Path, dest_dir: Path, split: str) -> Path:
    """Copy (or, for a `datasets` directory, convert) one prompt source into ``dest_dir``; returns the new file."""
    src = Path(src)
    if src.is_file():
        if src.suffix not in TABLE_SUFFIXES:
            raise ConfigError(f"{src}: unsupported prompt file type {src.suffix!r}; use "
                              f"{', '.join(TABLE_SUFFIXES)} or a `datasets` save_to_disk directory")
        dest = dest_dir / f"{split}{src.suffix}"
        shutil.copyfile(src, dest)
        return dest
    if is_hf_dataset_dir(src):
        return _convert_hf_dataset(src, dest_dir / f"{split}.parquet")
    raise ConfigError(f"{src}: not a prompt file ({', '.join(TABLE_SUFFIXES)}) or a `datasets` "
                      "save_to_disk directory")


def _convert_hf_dataset(src: Path, dest: Path) -> Path:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{src} is a Hugging Face `datasets` directory: install `datasets` to read it "
                          "(pip install datasets), or pass a Parquet/JSONL/CSV file") from None
    if (src / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in src.iterdir() if p.is_dir())
        raise ConfigError(f"{src} holds a DatasetDict with splits {splits}; pass one split's directory, "
                          f"e.g. {src / (splits[0] if splits else 'train')}")
    dataset = datasets.load_from_disk(str(src))
    dataset.to_parquet(str(dest))
    return dest


def read_prompt_table(path: Path, prompt_column: str, answer_column: str | None, *,
                      source: str | Path | None = None) -> pl.DataFrame:
    """The prompt file's table, after checking that it has rows and the prompt (and answer) columns.

    ``source``: the file the user gave, which errors name (``path`` is the project's copy of it)."""
    shown = source if source is not None else path
    try:
        table = read_table_file(path, name=shown)
    except ArtifactError as e:
        raise ConfigError(str(e)) from None
    columns = table.columns
    for flag, column in (("--prompt-column", prompt_column), ("--answer-column", answer_column)):
        if column is not None and column not in columns:
            raise ConfigError(f"{shown}: no column {column!r} ({flag}); its columns are {columns}")
    if table.height == 0:
        raise ConfigError(f"{shown}: no rows: a prompt file needs at least one prompt")
    return table


def prompt_file_format(table: pl.DataFrame, prompt_column: str, source: str | Path) -> str:
    """"standard" (prompt strings) or "conversational" (message lists), as `rlpipe.data.conversation` tells them
    apart; every conversational row's messages are checked, so a bad row is refused now, naming it."""
    try:
        fmt = prompt_format(table, prompt_column, source)
        if fmt == CONVERSATIONAL:
            for i, value in enumerate(table[prompt_column].to_list()):
                checked_messages(value, f"{source}: row {i}")
        return fmt
    except ArtifactError as e:
        raise ConfigError(str(e)) from None


def copy_model(src: str | Path, dest: Path, *, prompts: str | Path | None = None, chat_template: str = "auto"
               ) -> Path:
    """Copy a local Hugging Face model directory into the project (a plain copy: DVC then owns it).

    ``prompts``: the (train) prompt file when it is conversational: the tokenizer must have a chat template
    (and ``chat_template`` must not be off) to render it."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise ConfigError(f"{src}: not a Hugging Face model directory (no config.json); rlpipe never downloads "
                          "models: pass the directory `save_pretrained` wrote")
    from rlpipe.models.loading import load_tokenizer

    tokenizer = load_tokenizer(src)  # refused here, naming the directory, not at generate after prepare cached it
    if prompts is not None:
        require_chat_template(tokenizer, model_dir=src, source=prompts, mode=chat_template)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", ".cache"))
    return dest


@dataclass(frozen=True)
class UserReward:
    """One ``--reward module:function``: its params.yaml entry and the files copied into the project."""
    name: str
    options: dict[str, Any]  # defaults where the function has them, UNSET_OPTION where it has none
    files: tuple[str, ...]  # project-relative paths of the copied module (empty when it is installed)


def import_reward(name: str, project: Path, *, columns: list[str], source_dir: Path | None = None,
                  columns_by_file: dict[str, list[str]] | None = None, answer_column: str | None = None
                  ) -> UserReward:
    """Find ``module:function`` in ``source_dir`` (default: the current directory), copy its module into the
    project root and list its options; a built-in reward name lists its options only.

    A module that is not in that directory but importable (installed) is used where it is and not copied.
    ``columns``: the prompt file's columns, which a TRL-style function receives as arguments, not options.
    ``columns_by_file``: every prompt file's columns by the path the user gave: a required parameter of a
    TRL-style function that is a column of one file must be a column of each (`rlpipe.rewards.columns`).
    """
    from rlpipe.rewards.functions import REWARD_FUNCTIONS
    from rlpipe.rewards.registry import is_batch_reward
    from rlpipe.rewards.trl_style import TRL_ARGUMENTS, is_trl_reward

    module_name, _, attribute = name.partition(":")
    local = None
    if name in REWARD_FUNCTIONS:  # a built-in (exact_answer, format_regex, ...): options only, nothing to copy
        fn = REWARD_FUNCTIONS[name]
    elif not module_name or not attribute:
        raise ConfigError(f"--reward {name!r}: name a built-in ({', '.join(sorted(REWARD_FUNCTIONS))}) or a "
                          "function as module:function (e.g. myrewards:brevity)")
    else:
        source_dir = Path(source_dir or os.getcwd()).resolve()
        top = module_name.split(".")[0]
        candidates = [source_dir / f"{top}.py", source_dir / top]
        local = next((c for c in candidates if c.is_file() or (c.is_dir() and (c / "__init__.py").is_file())), None)
        fn = _load_function(name, module_name, attribute, source_dir if local else None)
    check_columns(name, fn, columns_by_file or {}, answer_column)
    files: tuple[str, ...] = ()
    if local is not None:
        dest = project / local.name
        if local.is_dir():
            shutil.copytree(local, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
        else:
            shutil.copyfile(local, dest)
        files = (local.name,)
    skip = set(TRL_ARGUMENTS) | set(columns) if is_trl_reward(fn) and not is_batch_reward(fn) else set()
    options = {}
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if (i == 0 and not skip) or p.name in skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue  # the sample (or samples), TRL's per-row arguments, **kwargs
        options[p.name] = UNSET_OPTION if p.default is p.empty else _yaml_value(p.default)
    return UserReward(name=name, options=options, files=files)


def check_columns(name: str, fn: Callable[..., Any], columns_by_file: dict[str, list[str]],
                  answer_column: str | None) -> None:
    """Refuse a TRL-style reward whose column parameter one prompt file has and another lacks (or ``answer``
    with no answer column): found at evaluate otherwise, after generate and train ran. A required parameter
    no file has is an option to fill in (params.yaml), not a column."""
    from rlpipe.rewards.columns import missing_columns, required_columns

    known = set().union(*columns_by_file.values()) | {"answer"}
    needed = [c for c in required_columns(fn, {}) if c in known]
    try:
        missing_columns(name, needed, columns_by_file, answer_column)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _yaml_value(value: Any) -> Any:
    try:
        yaml.safe_dump(value)
    except yaml.YAMLError:
        return UNSET_OPTION  # a default YAML cannot hold (an object): the user writes one that it can
    return value


def _load_function(name: str, module_name: str, attribute: str, path: Path | None) -> Callable[..., Any]:
    if path is not None:
        sys.path.insert(0, str(path))
    try:
        sys.modules.pop(module_name, None)
        importlib.invalidate_caches()  # a module written moments ago (a test, a script) must be found
        module = importlib.import_module(module_name)
    except ImportError as e:
        where = f"in {path}" if path is not None else "installed, nor in the current directory"
        raise ConfigError(f"--reward {name!r}: cannot import module {module_name!r} ({where}): {e}") from None
    finally:
        if path is not None:
            sys.path.remove(str(path))
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"--reward {name!r}: module {module_name!r} has no attribute {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"--reward {name!r}: {attribute!r} is not a function")
    return fn
