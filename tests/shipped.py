"""The repository's params.yaml as rlpipe ships it, whatever iteration this checkout has run to.

Why: the README's quickstart (`make repro`, then `rlpipe run`) records iterations in this checkout's own
params.yaml (`iteration: 7`, policy paths under state/); tests that check the shipped defaults, or copy
the project, read this copy with the run state reset (`rlpipe.run.iterate.starting_state`) instead.
"""
from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def shipped_params() -> Path:
    from rlpipe.config import load_params
    from rlpipe.run.iterate import starting_state
    from rlpipe.run.params_file import set_params

    copy = Path(tempfile.mkdtemp(prefix="rlpipe-shipped-")) / "params.yaml"
    shutil.copy2(REPO / "params.yaml", copy)
    set_params(copy, starting_state(load_params(copy)))
    return copy
