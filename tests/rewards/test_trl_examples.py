"""Reward functions written the way TRL's documentation writes them run here unchanged, on both of its formats.

Standard prompt files give strings; conversational ones give what TRL's GRPOTrainer passes: ``prompts[i]``
the prompt's message list (system message included), ``completions[i] = [{"role": "assistant", "content": ...}]``.
The functions below are this project's own, in that style: a format reward and a system-prompt reward read
``completion[0]["content"]`` (conversational), a length reward ``len(completion)`` (standard), and an accuracy
reward that accepts either, as TRL's own helpers do.
"""
from __future__ import annotations

import json
import sys
import textwrap

import polars as pl
import pytest

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.stages.score import score_rows

EXAMPLES = '''
import re

SEEN = {}


def think_answer_format(completions, **kwargs):
    """1.0 where the reply is <think>...</think><answer>...</answer>, else 0.0."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    replies = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, reply, re.DOTALL) else 0.0 for reply in replies]


def obeys_system(prompts, completions, **kwargs):
    """1.0 where the system prompt asks for upper case and the reply is upper case."""
    SEEN["prompts"], SEEN["completions"] = prompts, completions
    wants_upper = ["upper case" in prompt[0]["content"] for prompt in prompts if prompt[0]["role"] == "system"]
    return [float(w and c[0]["content"].isupper()) for w, c in zip(wants_upper, completions)]


def close_to_eight(completions, **kwargs):
    """Closer to 8 characters is better: -|8 - length|."""
    return [-abs(8 - len(completion)) for completion in completions]


def matches_solution(completions, solution, **kwargs):
    """1.0 where the text inside <answer> is the solution column; works on both formats."""
    rewards = []
    for completion, expected in zip(completions, solution):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        found = re.search(r"<answer>(.*?)</answer>", text)
        rewards.append(1.0 if found and found.group(1).strip() == expected else 0.0)
    return rewards
'''

SYSTEM = {"role": "system", "content": "Reply in upper case."}
QUESTIONS = ["2+2?", "3+3?"]
COMPLETIONS = ["<think>add</think><answer>4</answer>", "THE ANSWER: 7"]


@pytest.fixture()
def examples(tmp_path, monkeypatch):
    (tmp_path / "trl_examples.py").write_text(textwrap.dedent(EXAMPLES))
    monkeypatch.chdir(tmp_path)
    yield
    sys.modules.pop("trl_examples", None)


def rows(conversational: bool) -> pl.DataFrame:
    """Two scored rows as the score stage joins them; a conversational file keeps its messages in metadata."""
    prompts = [[SYSTEM, {"role": "user", "content": q}] if conversational else q for q in QUESTIONS]
    rendered = [f"<s>{p[0]['content']}<u>{p[1]['content']}<a>" if conversational else p for p in prompts]
    meta = [{"prompt": p, "solution": s} for p, s in zip(prompts, ["4", "6"])]
    return pl.DataFrame({
        "prompt_id": [0, 1], "sample_idx": [0, 0], "prompt": rendered, "completion_text": COMPLETIONS,
        "answer": ["4", "6"], "metadata": [json.dumps(m) for m in meta], "completion_length": [9, 5],
        "truncated": [False, False],
    })


def score(conversational: bool, *names: str) -> pl.DataFrame:
    entries = tuple(RewardEntry(f"trl_examples:{name}", 1.0, {}) for name in names)
    cfg = ScoreConfig(rewards=entries, accuracy_reward=entries[0].name, fallback_reward=0.0, max_error_fraction=0.0,
                      workers=1, row_timeout_s=None)
    frame, _ = score_rows(rows(conversational), cfg, messages_field="prompt" if conversational else None)
    return frame


def test_conversational_examples_get_message_lists_as_under_trl(examples):
    frame = score(True, "think_answer_format", "obeys_system", "matches_solution")
    assert frame["reward_think_answer_format"].to_list() == [1.0, 0.0]  # only the first has the format
    assert frame["reward_obeys_system"].to_list() == [0.0, 1.0]  # only the second is upper case
    assert frame["reward_matches_solution"].to_list() == [1.0, 0.0]  # "4" is right, the second has no <answer>
    import trl_examples

    assert trl_examples.SEEN["prompts"] == [[SYSTEM, {"role": "user", "content": "2+2?"}],
                                            [SYSTEM, {"role": "user", "content": "3+3?"}]]
    assert trl_examples.SEEN["completions"] == [[{"role": "assistant", "content": COMPLETIONS[0]}],
                                                [{"role": "assistant", "content": COMPLETIONS[1]}]]


def test_standard_examples_get_strings(examples):
    frame = score(False, "close_to_eight", "matches_solution")
    assert frame["reward_close_to_eight"].to_list() == [-(36 - 8), -(13 - 8)]  # 7+3+8+8+1+9 = 36 and 13 characters
    assert frame["reward_matches_solution"].to_list() == [1.0, 0.0]


def test_a_reward_for_either_format_scores_both_alike(examples):
    assert score(True, "matches_solution")["reward"].to_list() == score(False, "matches_solution")["reward"].to_list()


def test_a_conversational_only_reward_on_strings_fails_as_under_trl(examples):
    """`completion[0]["content"]` on a string is TRL's TypeError too: the stage stops, naming the reward."""
    from rlpipe.errors import ScoringError

    with pytest.raises(ScoringError, match="batch reward 'trl_examples:think_answer_format' failed .*TypeError"):
        score(False, "think_answer_format")


def test_a_per_row_reward_sees_the_messages_beside_the_rendered_prompt(tmp_path, monkeypatch):
    (tmp_path / "row_rewards.py").write_text(
        "def system_first(sample):\n"
        "    return float(sample.prompt_messages[0]['role'] == 'system' and sample.prompt.startswith('<s>'))\n")
    monkeypatch.chdir(tmp_path)
    entry = RewardEntry("row_rewards:system_first", 1.0, {})
    cfg = ScoreConfig(rewards=(entry,), accuracy_reward=entry.name, fallback_reward=0.0, max_error_fraction=0.0,
                      workers=1, row_timeout_s=None)
    try:
        assert score_rows(rows(True), cfg, messages_field="prompt")[0]["reward"].to_list() == [1.0, 1.0]
    finally:
        sys.modules.pop("row_rewards", None)
