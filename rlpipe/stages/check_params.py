"""The check_params stage's logic: params.yaml as the strict loader reads it, or what is wrong with it.

Why a stage at all (stages/check_params.py): DVC re-runs a stage when a param that stage declares changes, so a
key no stage declares, such as a typo at the top level (``learning_rate:`` for ``train.lr``), would leave every
stage up to date and go unnoticed. The stage depends on the whole file and runs this check on every edit.
"""
from __future__ import annotations

from pathlib import Path

from rlpipe.config import load_params
from rlpipe.errors import ConfigError


def params_problem(path: str | Path) -> str | None:
    """The loader's error for ``path`` (unknown keys with a "did you mean", bad values), or None when it loads."""
    try:
        load_params(path)
    except ConfigError as e:
        return str(e)
    return None
