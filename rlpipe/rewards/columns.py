"""The prompt-file columns a reward needs, checked against the train and eval files before anything runs.

A TRL-style reward (``fn(completions, solution, **kwargs)``, `rlpipe.rewards.trl_style`) receives each
column of the prompt file by its name; a required parameter that is neither an option nor a column of
both files fails only when score (train file) or evaluate (eval file) calls it, after generate and train.
`rlpipe init` and the prepare stage call `check_reward_columns` instead. This module also imports a
user's ``module:function`` (`import_user_function`) for the registry, and imports no reward of rlpipe's:
the prepare stage runs the check without depending on the reward code (it never changes its outputs).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from rlpipe.rewards.trl_style import GENERATED_ARGUMENTS, is_trl_reward


def import_user_function(name: str) -> Callable[..., Any]:
    """The callable that ``"package.module:function"`` names, imported with the working directory (the project
    root, where DVC runs every stage) first on the module path; ValueError/TypeError name what is wrong."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ValueError(f"reward {name!r} is not of the form 'package.module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # includes a dependency missing inside the user's module
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {exc} (the module must be "
                         f"in the project directory {cwd}, or installed)") from exc
    obj = module
    for part in attribute.split("."):  # "module:Class.method" works too
        if not hasattr(obj, part):
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward {name!r}: {attribute!r} in module {module_name!r} is a {type(obj).__name__}, "
                        "not callable")
    return obj


def required_columns(fn: Callable[..., Any], options: Mapping[str, Any]) -> list[str]:
    """The parameters of a TRL-style ``fn`` that only a prompt-file column can fill: no default, not given as
    an option, not one rlpipe generates (prompts, completions, completion_ids). [] for any other reward.

    >>> required_columns(lambda completions, solution, *, scale, level=1, **kw: [], {"scale": 2.0})
    ['solution']
    """
    if getattr(fn, "batch_reward", False) is True or not is_trl_reward(fn):
        return []
    skipped = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in skipped and p.default is p.empty and p.name not in GENERATED_ARGUMENTS
            and p.name not in options]


def missing_columns(name: str, needed: Sequence[str], columns_by_file: Mapping[Any, Sequence[str]],
                    answer_column: str | None) -> None:
    """Raise ValueError naming reward ``name``, the first file that lacks a ``needed`` column, and its columns.

    ``answer`` is also filled from the configured answer column (``answer_column``), as the score stage does.
    """
    for source, columns in columns_by_file.items():
        available = set(columns) | ({"answer"} if answer_column else set())
        lacking = [c for c in needed if c not in available]
        if lacking:
            raise ValueError(f"reward {name!r} needs column(s) {', '.join(map(repr, lacking))} (its required "
                             f"parameters), which {source} lacks; its columns are {list(columns)}")


def check_reward_columns(rewards: Sequence[Any], columns_by_file: Mapping[Any, Sequence[str]], *,
                         answer_column: str | None) -> None:
    """Every user reward of ``rewards`` (score.rewards entries: ``name``, ``options``) against every file's columns.

    Built-in rewards (no ``module:`` in the name) read `Sample` fields, not columns, and are skipped.
    """
    for entry in rewards:
        if ":" not in entry.name:
            continue
        fn = import_user_function(entry.name)
        missing_columns(entry.name, required_columns(fn, entry.options), columns_by_file, answer_column)
