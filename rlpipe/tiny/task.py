"""A verifiable synthetic task for the tiny default: integer addition.

A row is ``{"prompt": "47+385=", "answer": "432"}``; the completion the model is taught (and
rewarded for) is the answer followed by <eos>. Rewards read the last number of a completion and
compare it with ``answer`` (exact match), or count the digits that match right-aligned (partial
credit), so a row needs nothing but these two strings.

Why addition: the answer is checkable by a one-line rule and a 0.5M-parameter model learns
two-digit addition in about a minute of CPU time. Difficulty has two knobs: ``num_digits`` and,
for the warm-start data only, the share of answers that forget their carries
(``with_carry_bugs``), which sets how often greedy decoding is wrong while sampling still finds
the right answer. Plain formats (most significant digit first, no zero padding) were kept: writing
the answer reversed did not speed up learning in our measurements (``benchmarks/tiny_learnability.py``
holds the measurements behind the defaults).
"""
from __future__ import annotations

import re

import numpy as np

TASK_ALPHABET = "0123456789+="
_LAST_NUMBER = re.compile(r"\d+")


def make_task_rows(
    *,
    num_train: int,
    num_eval: int,
    seed: int,
    num_digits: int = 2,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Deterministic train and eval rows for ``a+b=`` with ``0 <= a, b < 10**num_digits``.

    Operand pairs are drawn without replacement, so no prompt repeats; train and eval are
    disjoint as *unordered* pairs too (``3+4=`` in train keeps ``4+3=`` out of eval), so the
    held-out accuracy measures addition rather than recall of the commuted prompt.
    Operands are written without leading zeros and drawn uniformly over their values.
    """
    if num_digits < 1:
        raise ValueError(f"num_digits must be >= 1, got {num_digits}")
    if num_train < 0 or num_eval < 0:
        raise ValueError("num_train and num_eval must be >= 0")
    base = 10**num_digits
    space = base * base
    # Rejection sampling slows down as the space fills up; half of it is plenty for any use.
    if num_train + 2 * num_eval > space // 2:
        raise ValueError(f"{num_train} train + {num_eval} eval rows do not fit {num_digits}-digit addition")

    rng = np.random.default_rng(seed)
    # Rejection sampling over the pair index: skips repeats, needs no permutation of the space.
    # Eval is drawn first and claims both orders of each of its pairs.
    claimed: set[tuple[int, int]] = set()

    def draw(count: int, *, claim_commuted: bool) -> list[tuple[int, int]]:
        pairs: list[tuple[int, int]] = []
        while len(pairs) < count:
            a, b = divmod(int(rng.integers(space)), base)
            if (a, b) in claimed:
                continue
            pairs.append((a, b))
            claimed.add((a, b))
            if claim_commuted:
                claimed.add((b, a))
        return pairs

    eval_pairs = draw(num_eval, claim_commuted=True)
    train_pairs = draw(num_train, claim_commuted=False)
    return [_row(a, b) for a, b in train_pairs], [_row(a, b) for a, b in eval_pairs]


def _row(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def extract_last_number(text: str) -> str | None:
    """The last run of digits in ``text``, or None.

    >>> extract_last_number("so 12+3=15")
    '15'
    """
    found = _LAST_NUMBER.findall(text)
    return found[-1] if found else None


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the completion's last number with the answer (the task's success rule)."""
    return extract_last_number(completion) == answer


def carry_free_sum(a: int, b: int) -> int:
    """Digit-wise sum mod 10, the "forgot to carry" mistake.

    >>> carry_free_sum(47, 85)
    22
    """
    result, scale = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * scale
        a, b, scale = a // 10, b // 10, scale * 10
    return result


def with_carry_bugs(rows: list[dict[str, str]], *, rate: float, seed: int) -> list[dict[str, str]]:
    """Copies of ``rows`` where a seeded ``rate`` of answers forgot every carry (warm-start data).

    Why: a warm start stopped early leaves a model in the middle of learning addition, and GRPO
    measured on such a model moved greedy accuracy by nothing (benchmarks/tiny_learnability.py).
    Training on answers that drop carries some of the time instead gives a model that knows
    addition yet prefers the wrong answer whenever a carry occurs: greedy decoding is right only
    on carry-free prompts, while sampling still finds the right answer on the others, which is
    exactly the within-group reward variance GRPO needs. ``rate`` sets the mix.
    Rows whose prompt has no carry are unchanged by construction.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    rng = np.random.default_rng(seed)
    buggy = rng.random(len(rows)) < rate
    out = []
    for row, bug in zip(rows, buggy):
        if bug:
            a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
            row = {**row, "answer": str(carry_free_sum(a, b))}
        out.append(dict(row))
    return out
