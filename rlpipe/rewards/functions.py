"""Rule-based reward functions: small pure functions of one `Sample` and keyword options.

Every function here has the signature ``fn(sample, *, **options) -> float``; a function may instead
return a `RewardResult` (the value plus a short label, such as how a program failed), which the
score stage counts per label in its metrics. A function marked with `batch_reward` instead takes
all samples at once and returns one float per sample (`reward_model`). Options carry no
defaults: each one is written out in params.yaml (``rewards:`` section), so the value that scored a
run is always visible in the file DVC tracks. `registry.check_reward_options` rejects a missing or
misspelt option before any row is scored.

Answer extraction, shared by `exact_answer` and `digit_match`
------------------------------------------------------------
* ``answer_prefix`` given (e.g. ``"####"`` or ``"Answer:"``): the span after its LAST occurrence;
  a completion without the prefix has no answer and scores 0. For a numeric ground truth the first
  number of that span is the prediction (so ``"#### $1,234 apples"`` predicts 1234).
* ``answer_prefix`` null: the last number in the completion for a numeric ground truth, else the
  whole stripped completion.

Numbers: an optional sign (``-``, ``+`` or the unicode minus ``−``), digits with optional well-formed
thousands separators (``1,234,567`` but not ``4,2`` or ``1,2345``), an optional decimal part. A
trailing full stop is sentence punctuation, not part of the number. Exponents and fractions
(``1e3``, ``3/4``) are not parsed: ground truths in rlpipe's tasks are plain decimals. Values are
`Decimal`s so that large integers compare exactly.

Run the examples with ``python -m doctest rlpipe/rewards/functions.py`` (pytest runs them too).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Callable

from rlpipe.rewards.base import RewardResult, Sample, batch_reward
from rlpipe.rewards.code import code_tests
from rlpipe.rewards.model_reward import reward_model

__all__ = [  # Sample, RewardResult and batch_reward (rlpipe.rewards.base) are re-exported for existing imports
    "Sample",
    "RewardResult",
    "batch_reward",
    "exact_answer",
    "digit_match",
    "format_regex",
    "length_penalty",
    "environment_reward",
    "REWARD_FUNCTIONS",
]


# ---------------------------------------------------------------------------------------------
# Number parsing
# ---------------------------------------------------------------------------------------------

# Digits of one number. The thousands form needs groups of exactly three digits and must not run
# on into more digits, so "1,2345" falls back to "1" instead of reading as 1,234.
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_SIGNS = "-+\u2212"  # \u2212 is the unicode minus sign "−" that tokenizers and LaTeX renderers emit

# A number inside free text. A sign counts only when it is not glued to a preceding word or
# bracket, so "5-3" reads as 5 and 3 rather than 5 and -3; the digits must not continue a previous
# number ("1.2.3" gives 1.2, not also .3).
_NUMBER_IN_TEXT = re.compile(rf"(?:(?<![\w)\]])(?P<sign>[{_SIGNS}]))?(?<![\d.])(?P<digits>{_DIGITS})")
_WHOLE_NUMBER = re.compile(rf"(?P<sign>[{_SIGNS}])?(?P<digits>{_DIGITS})")


def _to_decimal(sign: str | None, digits: str) -> Decimal:
    value = Decimal(digits.replace(",", ""))
    return -value if sign in ("-", "\u2212") else value


def _parse_number(text: str) -> Decimal | None:
    """The number that `text` is in full (surrounding whitespace and a final '.' allowed), else None."""
    match = _WHOLE_NUMBER.fullmatch(text.strip().removesuffix("."))
    return _to_decimal(match["sign"], match["digits"]) if match else None


def _numbers_in(text: str) -> list[Decimal]:
    """Every number in `text`, in order of appearance."""
    return [_to_decimal(m["sign"], m["digits"]) for m in _NUMBER_IN_TEXT.finditer(text)]


def _answer_span(completion: str, answer_prefix: str | None) -> str | None:
    """The text after the last `answer_prefix`, the whole completion if there is no prefix, else None."""
    if answer_prefix is None:
        return completion
    if answer_prefix == "":
        raise ValueError("answer_prefix must be a non-empty string or null, got ''")
    _, found, tail = completion.rpartition(answer_prefix)
    return tail if found else None


def _predicted_number(completion: str, answer_prefix: str | None) -> Decimal | None:
    """First number after the prefix if one is given, else the last number in the completion."""
    span = _answer_span(completion, answer_prefix)
    numbers = _numbers_in(span) if span is not None else []
    if not numbers:
        return None
    return numbers[0] if answer_prefix is not None else numbers[-1]


def _ground_truth(sample: Sample, reward: str) -> str:
    # The message names the reward because the score stage records only "Type: message" per row.
    if sample.answer is None:
        raise ValueError(f"{reward} needs a ground-truth answer, but the sample's answer is None")
    if not sample.answer.strip():
        raise ValueError(f"{reward} needs a ground-truth answer, but the sample's answer is empty")
    return sample.answer


# ---------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------


def exact_answer(
    sample: Sample, *, answer_prefix: str | None, tolerance: float, case_sensitive: bool
) -> float:
    """1.0 if the extracted answer equals the ground truth, else 0.0.

    A ground truth that parses as a number is compared numerically: ``|pred - truth| <= tolerance``
    (absolute, so ``tolerance: 0`` asks for exact equality; "42", "42.0", "+42" and "42." are all
    42). Any other ground truth is compared as a stripped string, case-folded unless
    `case_sensitive`. Raises ValueError if the sample has no ground truth.

    >>> s = Sample("Q", "6 * 7 = 42, so the answer is 42.", "42", {}, 12, False)
    >>> exact_answer(s, answer_prefix=None, tolerance=0.0, case_sensitive=True)
    1.0
    >>> s = Sample("Q", "48 - 6 = 42\\n#### 1,042", "1042", {}, 9, False)
    >>> exact_answer(s, answer_prefix="####", tolerance=0.0, case_sensitive=True)
    1.0
    >>> s = Sample("Q", "Answer: paris", "Paris", {}, 3, False)
    >>> exact_answer(s, answer_prefix="Answer:", tolerance=0.0, case_sensitive=False)
    1.0
    """
    truth_text = _ground_truth(sample, "exact_answer")
    if not tolerance >= 0:  # also rejects NaN
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    truth = _parse_number(truth_text)
    if truth is not None:
        predicted = _predicted_number(sample.completion, answer_prefix)
        if predicted is None:
            return 0.0
        # Decimal arithmetic keeps integers beyond 2**53 exact; str() turns a float tolerance
        # into its shortest decimal form (1e-06, not 9.99999999999999954748e-7).
        return 1.0 if abs(predicted - truth) <= Decimal(str(tolerance)) else 0.0
    span = _answer_span(sample.completion, answer_prefix)
    if span is None:
        return 0.0
    predicted_text, truth_text = span.strip(), truth_text.strip()
    if not case_sensitive:
        predicted_text, truth_text = predicted_text.casefold(), truth_text.casefold()
    return 1.0 if predicted_text == truth_text else 0.0


def digit_match(sample: Sample, *, answer_prefix: str | None) -> float:
    """Fraction of digit positions, aligned from the units digit, where prediction and truth agree.

    Partial credit that shapes arithmetic tasks: the denominator is the longer of the two digit
    strings, so missing or extra digits count as mismatches. When either number is negative the
    sign is one more position (right for -12 vs -12, wrong for 12 vs -12). The prediction is
    extracted as in `exact_answer`; no number, or a non-integer one, scores 0. Raises ValueError
    if the ground truth is missing or not an integer.

    >>> s = Sample("Q", "1000 + 284 = 1284", "1234", {}, 8, False)
    >>> digit_match(s, answer_prefix=None)  # 4, 3 and 1 match, the tens digit does not
    0.75
    >>> s = Sample("Q", "It is 234", "1234", {}, 3, False)
    >>> digit_match(s, answer_prefix=None)  # 4, 3, 2 match; the missing thousands digit does not
    0.75
    """
    truth_text = _ground_truth(sample, "digit_match")
    truth = _parse_number(truth_text)
    if truth is None or truth != truth.to_integral_value():
        raise ValueError(f"digit_match needs an integer ground truth, got {truth_text!r}")
    predicted = _predicted_number(sample.completion, answer_prefix)
    if predicted is None or predicted != predicted.to_integral_value():
        return 0.0
    pred_int, truth_int = int(predicted), int(truth)
    pred_digits, truth_digits = str(abs(pred_int))[::-1], str(abs(truth_int))[::-1]  # units first
    matches = sum(p == t for p, t in zip(pred_digits, truth_digits))
    positions = max(len(pred_digits), len(truth_digits))
    if pred_int < 0 or truth_int < 0:
        positions += 1
        matches += (pred_int < 0) == (truth_int < 0)
    return matches / positions


_REGEX_MODES = ("fullmatch", "search")


def format_regex(sample: Sample, *, pattern: str, mode: str) -> float:
    """1.0 if the stripped completion matches `pattern`, else 0.0.

    `mode` "fullmatch" requires the whole stripped completion to match; "search" accepts a match
    anywhere. Put inline flags in the pattern when needed: ``(?s)`` lets ``.`` cross newlines.

    >>> s = Sample("Q", "  <think>add</think> <answer>4</answer>\\n", "4", {}, 10, False)
    >>> format_regex(s, pattern=r"<think>.*</think>\\s*<answer>.*</answer>", mode="fullmatch")
    1.0
    >>> format_regex(s, pattern=r"<answer>\\d+</answer>", mode="fullmatch")
    0.0
    >>> format_regex(s, pattern=r"<answer>\\d+</answer>", mode="search")
    1.0
    """
    if mode not in _REGEX_MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(_REGEX_MODES)}")
    match = getattr(re, mode)(pattern, sample.completion.strip())  # re caches compiled patterns
    return 1.0 if match else 0.0


def length_penalty(sample: Sample, *, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer_tokens``, linear to -1 at `max_tokens`.

    With ``L = completion_tokens``: 0 for ``L <= max_tokens - buffer_tokens``, then
    ``(max_tokens - buffer_tokens - L) / buffer_tokens``, and -1 for ``L > max_tokens``; with
    ``buffer_tokens: 0`` it is a hard step at `max_tokens`. Setting `max_tokens` to generation's
    ``max_new_tokens`` gives every truncated completion exactly -1 (ALGORITHMS.md, "Overlong
    handling"; Yu et al. 2025, DAPO, eq. 13).

    >>> s = Sample("Q", "...", None, {}, 900, False)
    >>> length_penalty(s, max_tokens=1024, buffer_tokens=256)  # (768 - 900) / 256
    -0.515625
    """
    if not 0 <= buffer_tokens <= max_tokens:
        raise ValueError(
            f"need 0 <= buffer_tokens <= max_tokens, got buffer_tokens={buffer_tokens!r}, "
            f"max_tokens={max_tokens!r}"
        )
    length, free_until = sample.completion_tokens, max_tokens - buffer_tokens
    if length <= free_until:
        return 0.0
    if length > max_tokens:
        return -1.0
    return (free_until - length) / buffer_tokens


def environment_reward(sample: Sample) -> float:
    """The sum of the rewards a multi-turn rollout's environment gave per turn (0 when it gave none).

    Why a reward function: per-turn rewards live in the rollout table (``turn_rewards``); listing this
    under ``score.rewards`` with a weight makes them part of the total, like any other component.

    >>> environment_reward(Sample("Q", "A", None, {}, 3, False, turn_rewards=[0.5, None, 0.25]))
    0.75
    >>> environment_reward(Sample("Q", "A", None, {}, 3, False))
    0.0
    """
    return float(sum(r for r in sample.turn_rewards or () if r is not None))


REWARD_FUNCTIONS: dict[str, Callable[..., float | RewardResult]] = {
    "exact_answer": exact_answer,
    "digit_match": digit_match,
    "format_regex": format_regex,
    "length_penalty": length_penalty,
    "environment_reward": environment_reward,
    "code_tests": code_tests,
    "reward_model": reward_model,
}
