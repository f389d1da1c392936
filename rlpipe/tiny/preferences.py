"""A synthetic preference set for the tiny task: the right sum (chosen) against a wrong one (rejected).

Why these pairs: the reward model should learn what the exact-answer reward knows, so that PPO
against it (docs/reward-model.md) can be checked on the tiny default. The rejected answer is the
mistake the warm-started policy actually makes, the sum without its carries (rlpipe/tiny/task.py:
`carry_free_sum`), whenever the prompt has a carry; a carry-free prompt gets a near miss instead
(off by one, off by ten, or one digit changed), so the model cannot win by spotting carries alone.

Pairs are drawn from the TRAIN prompts only: the held-out prompts never reach the reward model,
so held-out accuracy under PPO against it still measures generalisation. Everything is
deterministic from the seed.
"""
from __future__ import annotations

import numpy as np

from rlpipe.tiny.task import carry_free_sum

PREFERENCE_STREAM = 15  # seed domain (see rlpipe/tiny/build.py: task, model, warm start and carry bugs use 11-14)


def near_miss(total: int, rng: np.random.Generator) -> int:
    """A plausible wrong sum: off by one, off by ten, or one digit replaced; never ``total``, never negative.

    >>> near_miss(57, np.random.default_rng(0)) != 57
    True
    """
    while True:
        kind = int(rng.integers(3))
        if kind == 0:
            wrong = total + (1 if rng.random() < 0.5 else -1)
        elif kind == 1:
            wrong = total + (10 if rng.random() < 0.5 else -10)
        else:
            digits = list(str(total))
            pos = int(rng.integers(len(digits)))
            lowest = 1 if pos == 0 and len(digits) > 1 else 0  # no leading zero
            digits[pos] = str(int(rng.integers(lowest, 10)))
            wrong = int("".join(digits))
        if wrong != total and wrong >= 0:
            return wrong


def rejected_sum(a: int, b: int, rng: np.random.Generator) -> int:
    """The carry-bug sum when ``a + b`` has a carry, else a `near_miss`.

    >>> rejected_sum(47, 85, np.random.default_rng(0))  # 132 without carries
    22
    """
    buggy = carry_free_sum(a, b)
    return buggy if buggy != a + b else near_miss(a + b, rng)


def make_preference_rows(train_rows: list[dict[str, str]], *, num_pairs: int, seed: int) -> list[dict]:
    """``num_pairs`` rows of {prompt_id, prompt, chosen, rejected} drawn from ``train_rows``.

    ``prompt_id`` is the row's index in ``train_rows`` (= its prompt_id in the train prompt table).
    Prompts are drawn without replacement while they last (a seeded permutation, repeated when
    ``num_pairs`` exceeds the train prompts); a repeated prompt gets a fresh draw of its near miss.
    """
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")
    if num_pairs and not train_rows:
        raise ValueError("no train rows to draw preference pairs from")
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while len(order) < num_pairs:
        order += [int(i) for i in rng.permutation(len(train_rows))]
    out = []
    for prompt_id in order[:num_pairs]:
        row = train_rows[prompt_id]
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        if str(a + b) != row["answer"]:
            raise ValueError(f"train row {prompt_id}: {row['prompt']!r} has answer {row['answer']!r}, not {a + b}")
        out.append({"prompt_id": prompt_id, "prompt": row["prompt"], "chosen": row["answer"],
                     "rejected": str(rejected_sum(a, b, rng))})
    return out
