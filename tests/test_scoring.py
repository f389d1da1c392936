"""The score stage's table: weighted sum, components, correctness, per-row errors, the error threshold."""
import polars as pl
import pytest

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.errors import ConfigError, ScoringError
from rlpipe.scoring import score_rows

EXACT = RewardEntry("exact_answer", 1.0, {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True})
DIGITS = RewardEntry("digit_match", 0.5, {"answer_prefix": None})


def cfg(rewards=(EXACT, DIGITS), **over):
    base = dict(rewards=tuple(rewards), accuracy_reward="exact_answer", fallback_reward=-1.0, max_error_fraction=0.5)
    return ScoreConfig(**{**base, **over})


def rows(completions, answers):
    n = len(completions)
    return pl.DataFrame({
        "prompt_id": list(range(n)), "sample_idx": pl.Series([0] * n, dtype=pl.Int32),
        "prompt": ["q"] * n, "completion_text": completions, "answer": answers, "metadata": ["{}"] * n,
        "completion_length": pl.Series([len(c) for c in completions], dtype=pl.Int32), "truncated": [False] * n,
    })


def test_weighted_sum_and_components():
    frame, m = score_rows(rows(["1234", "1284", "x"], ["1234", "1234", "1234"]), cfg())
    assert frame["reward_exact_answer"].to_list() == [1.0, 0.0, 0.0]
    assert frame["reward_digit_match"].to_list() == [1.0, 0.75, 0.0]
    assert frame["reward"].to_list() == pytest.approx([1.0 + 0.5, 0.0 + 0.5 * 0.75, 0.0])
    assert frame["correct"].to_list() == [True, False, False]
    assert frame["score_error"].null_count() == 3
    assert m["accuracy"] == pytest.approx(1 / 3)
    assert m["components"] == {"exact_answer": pytest.approx(1 / 3), "digit_match": pytest.approx(1.75 / 3)}


def test_row_error_gets_fallback_and_is_counted():
    frame, m = score_rows(rows(["12", "13", "14"], ["12", None, "14"]), cfg())
    assert frame["reward"][1] == -1.0
    assert frame["correct"][1] is None and frame["reward_digit_match"][1] is None
    assert frame["score_error"][1].startswith("ValueError")
    assert m["errors_by_kind"] == {"ValueError": 1}


def test_too_many_errors_fail_the_stage():
    with pytest.raises(ScoringError, match="max_error_fraction=0.5"):
        score_rows(rows(["12", "13", "14"], [None, None, "14"]), cfg())


def test_config_mistakes_fail_before_scoring():
    with pytest.raises(ConfigError, match="no option 'tolerence'"):
        score_rows(rows(["1"], ["1"]), cfg([RewardEntry("exact_answer", 1.0, {"tolerence": 0})]))
    with pytest.raises(ConfigError, match="accuracy_reward"):
        score_rows(rows(["1"], ["1"]), cfg([DIGITS]))
