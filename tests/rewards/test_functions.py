"""Hand-written cases for the built-in reward functions, plus their doctests."""

import doctest
import subprocess
import sys

import pytest

from rlpipe.rewards import functions
from rlpipe.rewards.code import code_tests
from rlpipe.rewards.functions import (
    REWARD_FUNCTIONS,
    Sample,
    digit_match,
    environment_reward,
    exact_answer,
    format_regex,
    length_penalty,
)
from rlpipe.rewards.model_reward import reward_model


def make(completion="", answer=None, tokens=1, truncated=False):
    return Sample(
        prompt="Q", completion=completion, answer=answer, metadata={},
        completion_tokens=tokens, truncated=truncated,
    )


def exact(completion, answer, prefix=None, tolerance=0.0, case_sensitive=True):
    return exact_answer(
        make(completion, answer), answer_prefix=prefix, tolerance=tolerance, case_sensitive=case_sensitive
    )


def test_doctests_pass():
    result = doctest.testmod(functions)
    assert result.attempted >= 8
    assert result.failed == 0


def test_registry_lists_the_builtins():
    assert REWARD_FUNCTIONS == {
        "exact_answer": exact_answer,
        "digit_match": digit_match,
        "format_regex": format_regex,
        "length_penalty": length_penalty,
        "environment_reward": environment_reward,
        "code_tests": code_tests,
        "reward_model": reward_model,
    }


def test_environment_reward_sums_the_turn_rewards_the_environment_gave():
    with_turns = Sample("Q", "9", None, {}, 12, False, turns=["add(4,5)", "9"], turn_rewards=[0.25, None])
    assert environment_reward(with_turns) == 0.25  # 0.25 + (no reward for the last turn)
    assert environment_reward(make("9")) == 0.0  # single-turn: no environment


def test_importing_rewards_does_not_import_torch():
    code = "import sys, rlpipe.rewards; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- exact_answer, numeric truths


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("The answer is 42", "42"),
        ("so 42.", "42"),  # trailing full stop is punctuation
        ("42.0", "42"),
        ("+42", "42"),
        ("  42  \n", " 42 "),  # whitespace around both
        ("total: 1,234", "1234"),  # well-formed thousands separator
        ("total: 1234", "1,234"),  # ... on either side
        ("1,234,567.5 dollars", "1234567.5"),
        ("it drops to -7", "-7"),
        ("it drops to \u22127", "-7"),  # unicode minus
        ("it drops to -7", "\u22127"),
        ("halve it: 0.5", ".5"),
        ("$12 + $30 = $42!", "42"),
        ("3 apples\nand 4 pears\n\n7\n", "7"),  # last number, across newlines
        ("12345678901234567890", "12345678901234567890"),  # exact beyond float precision
    ],
)
def test_exact_answer_numeric_matches(completion, answer):
    assert exact(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("The answer is 41", "42"),
        ("no number at all", "42"),
        ("", "42"),
        ("4,2", "42"),  # not a thousands separator: numbers 4 and 2
        ("1,2345", "12345"),  # malformed grouping is not one number
        ("42 then 7", "42"),  # the last number counts
        ("it is 7", "-7"),  # sign matters
        ("5-7", "-7"),  # a minus glued to a number is subtraction, not a sign
        ("12345678901234567891", "12345678901234567890"),
    ],
)
def test_exact_answer_numeric_mismatches(completion, answer):
    assert exact(completion, answer) == 0.0


def test_exact_answer_tolerance_is_absolute_and_inclusive():
    # |3.14 - 3.14159| = 0.00159
    assert exact("pi is 3.14", "3.14159", tolerance=0.01) == 1.0
    assert exact("pi is 3.14", "3.14159", tolerance=0.001) == 0.0
    # |0.75 - 0.5| = 0.25 exactly: the boundary counts as a match
    assert exact("0.75", "0.5", tolerance=0.25) == 1.0
    assert exact("-1.5", "-1", tolerance=0.5) == 1.0


def test_exact_answer_uses_text_after_the_last_prefix():
    # The prefix appears twice: the first "#### 5" is an intermediate result, the second is final.
    text = "#### 5 is wrong, retry\n#### 42"
    assert exact(text, "42", prefix="####") == 1.0
    assert exact(text, "5", prefix="####") == 0.0


def test_exact_answer_takes_first_number_after_prefix():
    assert exact("Answer: $1,234 apples, not 99", "1234", prefix="Answer:") == 1.0
    assert exact("Answer: \u22123.\n", "-3", prefix="Answer:") == 1.0


def test_exact_answer_without_prefix_in_completion_scores_zero():
    assert exact("the result is 42", "42", prefix="####") == 0.0
    assert exact("#### ", "42", prefix="####") == 0.0  # prefix present, no number after it
    assert exact("Paris", "Paris", prefix="Answer:") == 0.0


def test_exact_answer_string_truths():
    assert exact("  Paris \n", "Paris") == 1.0
    assert exact("paris", "Paris", case_sensitive=True) == 0.0
    assert exact("PARIS", "Paris", case_sensitive=False) == 1.0
    assert exact("Answer: B\n", "B", prefix="Answer:") == 1.0
    assert exact("Answer: A then Answer:  C ", "C", prefix="Answer:") == 1.0
    assert exact("The capital is Paris", "Paris") == 0.0  # no prefix: whole completion must match
    assert exact("4,2", "4,2") == 1.0  # not a well-formed number, so compared as text


def test_exact_answer_missing_truth_raises():
    with pytest.raises(ValueError, match="exact_answer needs a ground-truth answer, but the sample's answer is None"):
        exact("42", None)
    with pytest.raises(ValueError, match="exact_answer needs a ground-truth answer, but the sample's answer is empty"):
        exact("42", "  ")


def test_exact_answer_bad_options_raise():
    with pytest.raises(ValueError, match="tolerance must be a number >= 0, got -0.1"):
        exact("42", "42", tolerance=-0.1)
    with pytest.raises(ValueError, match="tolerance must be a number >= 0, got nan"):
        exact("42", "42", tolerance=float("nan"))
    with pytest.raises(ValueError, match="answer_prefix must be a non-empty string or null"):
        exact("42", "42", prefix="")


# ---------------------------------------------------------------- digit_match


def digits(completion, answer, prefix=None):
    return digit_match(make(completion, answer), answer_prefix=prefix)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("1234", "1234", 4 / 4),
        ("1284", "1234", 3 / 4),  # tens digit wrong
        ("234", "1234", 3 / 4),  # 4,3,2 align from the units; thousands missing
        ("91234", "1234", 4 / 5),  # extra leading digit counts as a position
        ("4321", "1234", 0 / 4),
        ("1,234", "1234", 4 / 4),
        ("1234.0", "1234", 4 / 4),
        ("0", "0", 1 / 1),
        ("-12", "-12", 3 / 3),  # sign is one more position when a negative is involved
        ("12", "-12", 2 / 3),
        ("\u221212", "12", 2 / 3),
        ("-13", "-12", 2 / 3),
        ("no digits here", "1234", 0.0),
        ("12.5", "12", 0.0),  # a non-integer prediction is not an integer answer
        ("first 1234 then 9", "1234", 0 / 4),  # last number: 9 vs 1234, units 9 != 4
    ],
)
def test_digit_match(completion, answer, expected):
    assert digits(completion, answer) == pytest.approx(expected)


def test_digit_match_with_prefix():
    assert digits("#### 99\n#### 1284 is it", "1234", prefix="####") == 0.75
    assert digits("1234", "1234", prefix="####") == 0.0


def test_digit_match_rejects_bad_truth():
    with pytest.raises(ValueError, match="digit_match needs a ground-truth answer, but the sample's answer is None"):
        digits("12", None)
    with pytest.raises(ValueError, match="digit_match needs an integer ground truth, got '1.5'"):
        digits("12", "1.5")
    with pytest.raises(ValueError, match="digit_match needs an integer ground truth, got 'twelve'"):
        digits("12", "twelve")


# ---------------------------------------------------------------- format_regex


def test_format_regex_fullmatch_uses_stripped_completion():
    sample = make("\n  <answer>7</answer>  \n")
    assert format_regex(sample, pattern=r"<answer>\d+</answer>", mode="fullmatch") == 1.0
    assert format_regex(sample, pattern=r"<answer>\d</answer>x", mode="fullmatch") == 0.0


def test_format_regex_search_and_fullmatch_differ():
    sample = make("reasoning... <answer>7</answer> trailing")
    assert format_regex(sample, pattern=r"<answer>\d+</answer>", mode="search") == 1.0
    assert format_regex(sample, pattern=r"<answer>\d+</answer>", mode="fullmatch") == 0.0


def test_format_regex_newlines_need_dotall_flag():
    sample = make("<think>line 1\nline 2</think><answer>7</answer>")
    assert format_regex(sample, pattern=r"<think>.*</think><answer>.*</answer>", mode="fullmatch") == 0.0
    assert format_regex(sample, pattern=r"(?s)<think>.*</think><answer>.*</answer>", mode="fullmatch") == 1.0


def test_format_regex_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown mode 'match'; valid modes: fullmatch, search"):
        format_regex(make("x"), pattern="x", mode="match")


# ---------------------------------------------------------------- length_penalty


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (0, 0.0),
        (768, 0.0),  # max_tokens - buffer_tokens = 1024 - 256 = 768: still free
        (769, -1 / 256),  # (768 - 769) / 256
        (896, -0.5),  # (768 - 896) / 256 = -128 / 256
        (1024, -1.0),  # (768 - 1024) / 256
        (1025, -1.0),
        (5000, -1.0),
    ],
)
def test_length_penalty(tokens, expected):
    sample = make(tokens=tokens)
    assert length_penalty(sample, max_tokens=1024, buffer_tokens=256) == pytest.approx(expected)


def test_length_penalty_zero_buffer_is_a_step():
    assert length_penalty(make(tokens=100), max_tokens=100, buffer_tokens=0) == 0.0
    assert length_penalty(make(tokens=101), max_tokens=100, buffer_tokens=0) == -1.0


@pytest.mark.parametrize("max_tokens, buffer_tokens", [(100, 101), (100, -1)])
def test_length_penalty_rejects_bad_buffer(max_tokens, buffer_tokens):
    with pytest.raises(ValueError, match=f"buffer_tokens={buffer_tokens}, max_tokens={max_tokens}"):
        length_penalty(make(tokens=1), max_tokens=max_tokens, buffer_tokens=buffer_tokens)
