"""The second hostile corpus (`hostile_corpus.py`) through the score stage: no wrong program earns anything.

One score-stage run with 2 workers holds every attack and one honest program per task shape, under the
settings that gave issue 32 its forged passes (``float_tolerance: 1e-6``, partial credit). Every attack is
wrong on every test case, so its reward must be exactly 0.0; no row may be an error (the stage would count
it against ``max_error_fraction``); every honest row scores 1.0, so the tests can be passed. The autouse
`host_unaffected` fixture then checks that no process, work dir, cgroup, mount or IPC object is left.
"""
from __future__ import annotations

import json

import polars as pl

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.stages.score import score_rows
from tests.rewards.code.helpers import OPTIONS
from tests.rewards.code.hostile_corpus import (
    CORPUS,
    CORPUS_OPTIONS,
    GROUPS,
    HONEST,
    TASKS,
)


def corpus_table(rows: list[tuple[str, str]]) -> pl.DataFrame:
    """A score-stage input of (task name, program) rows, the program in a fenced block as a policy writes it."""
    n = len(rows)
    return pl.DataFrame({
        "prompt_id": list(range(n)), "sample_idx": pl.Series([0] * n, dtype=pl.Int32),
        "prompt": ["Write the program."] * n,
        "completion_text": [f"Here it is.\n```python\n{program}```\n" for _, program in rows], "answer": [None] * n,
        "metadata": [json.dumps({"tests": TASKS[task].tests, **TASKS[task].metadata}) for task, _ in rows],
        "completion_length": pl.Series([len(p) for _, p in rows], dtype=pl.Int32), "truncated": [False] * n,
    })


def corpus_config(workers: int = 2) -> ScoreConfig:
    entry = RewardEntry("code_tests", 1.0, {**OPTIONS, **CORPUS_OPTIONS})
    return ScoreConfig(rewards=(entry,), accuracy_reward="code_tests", fallback_reward=0.0, max_error_fraction=0.0,
                       workers=workers, row_timeout_s=None)


def test_the_corpus_is_broad_and_every_task_shape_has_an_honest_program():
    assert {name: len(group) for name, group in GROUPS.items()} == {
        "numbers": 30, "data": 13, "status": 6, "caps": 4, "timing": 4, "processes": 5, "kernel": 6, "signals": 3}
    assert {task for task, _ in CORPUS.values()} == set(TASKS) == set(HONEST)


def test_no_hostile_program_earns_anything_and_no_row_is_an_error():
    names = sorted(CORPUS)
    rows = [CORPUS[name] for name in names] + list(HONEST.items())
    frame, metrics = score_rows(corpus_table(rows), corpus_config())
    assert metrics["errors"] == 0, frame.filter(pl.col("score_error").is_not_null())["score_error"].to_list()[:3]
    rewards = frame["reward"].to_list()
    earned = {name: reward for name, reward in zip(names, rewards) if reward != 0.0}
    assert earned == {}, earned  # not a single case of a wrong program passed
    assert rewards[len(names):] == [1.0] * len(HONEST)
    assert metrics["details"]["code_tests"]["pass"] == len(HONEST)
