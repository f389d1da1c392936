"""TRL-style rewards (``fn(prompts, completions, **columns)``) through the score stage's logic, unchanged."""
from __future__ import annotations

import json
import sys
import textwrap

import polars as pl
import pytest

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.errors import ConfigError
from rlpipe.stages.score import score_rows

MODULE = '''
CALLS = []

def match_solution(completions, solution, **kwargs):
    """Written for TRL's GRPOTrainer: 1.0 where the completion is the file's solution column."""
    CALLS.append(sorted(kwargs))
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]

def scaled_length(prompts, completions, completion_ids, *, scale):
    return [scale * len(ids) for ids in completion_ids]
'''


@pytest.fixture
def trl_module(tmp_path, monkeypatch):
    (tmp_path / "trl_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)  # the score stage imports project modules from its working directory
    yield
    sys.modules.pop("trl_rewards", None)


def rows() -> pl.DataFrame:
    meta = [{"question": "1+1", "solution": "2"}, {"question": "2+2", "solution": "4"}]
    return pl.DataFrame({
        "prompt_id": [0, 1], "sample_idx": [0, 0], "prompt": ["Q: 1+1", "Q: 2+2"], "completion_text": ["2", "5"],
        "answer": ["2", "4"], "metadata": [json.dumps(m) for m in meta], "completion_length": [2, 3],
        "truncated": [False, False], "completion_token_ids": [[7, 1], [8, 9, 1]],
    })


def config(*entries: RewardEntry) -> ScoreConfig:
    return ScoreConfig(rewards=entries, accuracy_reward=entries[0].name, fallback_reward=0.0,
                       max_error_fraction=0.0, workers=1, row_timeout_s=None)


def test_trl_rewards_get_completions_ids_and_the_files_columns(trl_module):
    frame, metrics = score_rows(rows(), config(RewardEntry("trl_rewards:match_solution", 1.0, {}),
                                               RewardEntry("trl_rewards:scaled_length", 0.5, {"scale": 0.1})))
    assert frame["reward_match_solution"].to_list() == [1.0, 0.0]
    assert frame["reward_scaled_length"].to_list() == pytest.approx([0.2, 0.3])  # 0.1 x 2 and 3 token ids
    assert frame["reward"].to_list() == pytest.approx([1.0 + 0.5 * 0.2, 0.5 * 0.3])
    import trl_rewards

    assert trl_rewards.CALLS == [["answer", "completion_ids", "prompts", "question"]]  # one call, every column


def test_trl_reward_options_are_checked_before_scoring(trl_module):
    with pytest.raises(ConfigError, match="has no option 'scal'"):
        score_rows(rows(), config(RewardEntry("trl_rewards:scaled_length", 1.0, {"scal": 1})))


def test_doctests_pass():
    import doctest

    from rlpipe.rewards import trl_style

    result = doctest.testmod(trl_style)
    assert result.attempted > 0 and result.failed == 0


RAISING = '''
def first_letter(completions, solution, **kwargs):
    return [1.0 if c.index("5") == 0 else 0.0 for c in completions]   # line 3: "2" has no "5"

def per_row(sample, **options):
    return float("abc".index(sample.completion))   # line 6
'''


@pytest.fixture
def raising_module(tmp_path, monkeypatch):
    (tmp_path / "raising_rewards.py").write_text(RAISING)
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "raising_rewards.py"
    sys.modules.pop("raising_rewards", None)


def test_a_raising_batch_reward_names_its_line_and_the_first_row_it_fails_on(raising_module):
    from rlpipe.errors import ScoringError

    with pytest.raises(ScoringError) as exc:
        score_rows(rows(), config(RewardEntry("raising_rewards:first_letter", 1.0, {})))
    message = str(exc.value)
    assert "batch reward 'raising_rewards:first_letter' failed on the whole batch of 2 rows: ValueError" in message
    assert f"(at {raising_module}:3)" in message
    assert message.endswith("; first failing row: prompt_id 0, sample_idx 0, completion '2'")


def test_a_row_error_names_the_reward_and_the_users_line(raising_module):
    entry = RewardEntry("raising_rewards:per_row", 1.0, {})
    frame, metrics = score_rows(rows(), ScoreConfig(rewards=(entry,), accuracy_reward=entry.name, fallback_reward=0.0,
                                                    max_error_fraction=1.0, workers=1, row_timeout_s=None))
    assert frame["score_error"].to_list() == [
        f"ValueError: substring not found (in reward 'raising_rewards:per_row', at {raising_module}:6)"] * 2
    assert metrics["errors_by_kind"] == {"ValueError": 2}
