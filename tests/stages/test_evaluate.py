"""evaluate's numbers per value of a prompt column (evaluate.metrics_by), computed by hand."""
from __future__ import annotations

import polars as pl
import pytest

from rlpipe.errors import ConfigError
from rlpipe.stages.evaluate import check_metrics_by, metrics_by

PROMPTS = pl.DataFrame({"prompt_id": [0, 1, 2, 3], "prompt": ["a", "b", "c", "d"], "prompt_token_ids": [[1]] * 4,
                        "answer": ["x"] * 4, "metadata": ["{}"] * 4, "difficulty": ["hard", "easy", "hard", None],
                        "level": [2, 1, 2, 3], "solved": [True, False, True, False], "tags": [["a"], [], [], []]})
ROWS = pl.DataFrame({"prompt_id": [0, 1, 2, 3], "sample_idx": [0] * 4, "correct": [True, True, False, None],
                     "reward": [1.5, 1.0, 0.0, 0.5], "completion_length": [2, 4, 6, 8]},
                    schema_overrides={"completion_length": pl.Int32})


def test_numbers_per_value_of_each_column_null_last():
    by = metrics_by(ROWS, PROMPTS, ["difficulty", "solved"])
    # hard: prompts 0 and 2 -> correct 1 of 2, rewards (1.5 + 0) / 2, lengths (2 + 6) / 2
    assert by["difficulty"] == {
        "easy": {"num_prompts": 1, "accuracy": 1.0, "reward_mean": 1.0, "length_mean": 4.0},
        "hard": {"num_prompts": 2, "accuracy": 0.5, "reward_mean": 0.75, "length_mean": 4.0},
        "null": {"num_prompts": 1, "accuracy": None, "reward_mean": 0.5, "length_mean": 8.0}}  # not judged: None
    assert list(by["solved"]) == ["false", "true"]
    assert by["solved"]["false"]["accuracy"] == 1.0  # prompt 1 correct, prompt 3 not judged


def test_a_column_the_table_lacks_or_of_lists_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r"evaluate.metrics_by: the eval prompt table has no column 'dificulty'; "
                                          r"its columns: prompt, answer, difficulty, level, solved, tags"):
        check_metrics_by(PROMPTS, ["level", "dificulty"])
    with pytest.raises(ConfigError, match=r"evaluate.metrics_by: column 'tags' holds List\(String\)"):
        check_metrics_by(PROMPTS, ["tags"])


def test_the_closing_line_says_what_was_evaluated():
    """Run by hand on another model dir, evaluate no longer claims the iteration was trained and evaluated."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("stage_evaluate", Path(__file__).resolve().parents[2]
                                                  / "stages/evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.closing_line(12, 13, "artifacts/train/checkpoint", baseline=False).startswith(
        "rlpipe: iteration 12 trained and evaluated; next:")
    assert script.closing_line(12, 0, "models/base", baseline=True).startswith("rlpipe: the starting model evaluated")
    assert script.closing_line(12, None, "/tmp/other", baseline=False) == (
        "rlpipe: evaluated /tmp/other (policy version unknown)")
    assert script.closing_line(12, 3, "state/policy", baseline=False) == (
        "rlpipe: evaluated state/policy (policy version 3)")
