"""The hand-made iteration of tests/inspect_project.py, committed and tagged twice, for `rlpipe view`'s tests.

    iteration-0   the rows of inspect_project (prompt 1: rewards 1.5 and 0.0)
    iteration-1   scores rewritten: prompt 1's second sample now 1.0
    workspace     scores rewritten again, not committed: 0.5

token_stats is tracked by DVC (`dvc add`, as a stage's output is): a tag's copy is the object in DVC's cache.
The other artifacts are committed to git, so a tag's copy is read out of git through `dvc.api.read`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl

from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import SCORES
from tests.inspect_project import PATHS, make_project

# reward of (prompt 1, sample 1) in each iteration
PROMPT_1_SAMPLE_1 = {"iteration-0": 0.0, "iteration-1": 1.0, "workspace": 0.5}


def set_reward(root: Path, reward: float) -> None:
    scores = read_artifact(root / PATHS["scores"], SCORES)
    hit = (pl.col("prompt_id") == 1) & (pl.col("sample_idx") == 1)
    write_artifact(scores.frame.with_columns(pl.when(hit).then(reward).otherwise(pl.col("reward")).alias("reward")),
                   root / PATHS["scores"], SCORES, metadata=scores.metadata)


def make_tagged_project(root: Path) -> Path:
    make_project(root)
    def run(*args: str) -> None:
        subprocess.run(args, cwd=root, check=True, capture_output=True, text=True)

    run("git", "init", "-q")
    run(sys.executable, "-m", "dvc", "init", "-q")
    run(sys.executable, "-m", "dvc", "add", "-q", PATHS["token_stats"])  # the same in both tags: in DVC's cache
    for tag in ("iteration-0", "iteration-1"):
        set_reward(root, PROMPT_1_SAMPLE_1[tag])
        run("git", "add", "-A")
        run("git", "-c", "user.email=t@x", "-c", "user.name=t", "commit", "-qm", tag)
        run("git", "tag", tag)
    set_reward(root, PROMPT_1_SAMPLE_1["workspace"])
    return root
