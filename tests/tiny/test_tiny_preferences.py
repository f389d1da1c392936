"""The tiny task's synthetic preference set: right sum vs a plausible wrong one, train prompts only, seeded."""
import numpy as np
import pytest

from rlpipe.tiny import carry_free_sum, make_task_rows
from rlpipe.tiny.preferences import make_preference_rows, near_miss, rejected_sum


@pytest.fixture(scope="module")
def task():
    return make_task_rows(num_train=300, num_eval=100, seed=5)


def operands(prompt):
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def test_pairs_are_deterministic_from_the_seed(task):
    train, _ = task
    a = make_preference_rows(train, num_pairs=200, seed=1)
    assert a == make_preference_rows(train, num_pairs=200, seed=1)
    assert a != make_preference_rows(train, num_pairs=200, seed=2)


def test_pairs_come_from_train_prompts_only(task):
    train, evals = task
    rows = make_preference_rows(train, num_pairs=300, seed=1)
    assert sorted(r["prompt_id"] for r in rows) == list(range(300))  # without replacement while they last
    assert all(r["prompt"] == train[r["prompt_id"]]["prompt"] for r in rows)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in evals}


def test_chosen_is_right_rejected_is_the_carry_bug_or_a_near_miss(task):
    train, _ = task
    kinds = {"carry": 0, "near": 0}
    for r in make_preference_rows(train, num_pairs=300, seed=1):
        a, b = operands(r["prompt"])
        assert r["chosen"] == str(a + b)
        assert r["rejected"] != r["chosen"] and int(r["rejected"]) >= 0
        if carry_free_sum(a, b) != a + b:
            assert r["rejected"] == str(carry_free_sum(a, b))
            kinds["carry"] += 1
        else:
            wrong = int(r["rejected"])
            one_digit = len(str(wrong)) == len(str(a + b)) and sum(x != y for x, y in zip(str(wrong), str(a + b))) == 1
            assert abs(wrong - (a + b)) in (1, 10) or one_digit, r
            kinds["near"] += 1
    assert kinds["carry"] > 100 and kinds["near"] > 30  # both kinds of mistake are represented


def test_more_pairs_than_prompts_repeat_prompts(task):
    train, _ = task
    rows = make_preference_rows(train[:10], num_pairs=25, seed=0)
    assert len(rows) == 25 and {r["prompt_id"] for r in rows} == set(range(10))
    assert make_preference_rows(train, num_pairs=0, seed=0) == []
    with pytest.raises(ValueError, match="no train rows"):
        make_preference_rows([], num_pairs=1, seed=0)


def test_wrong_sums_hand_checked():
    assert rejected_sum(47, 85, np.random.default_rng(0)) == 22  # 132 without carries: 4+8 -> 2, 7+5 -> 2
    assert rejected_sum(99, 1, np.random.default_rng(0)) == 90  # 100 without carries: 9+0 -> 9, 9+1 -> 0
    rng = np.random.default_rng(0)
    for total in (0, 5, 9, 10, 57, 198):
        misses = {near_miss(total, rng) for _ in range(50)}
        assert total not in misses and min(misses) >= 0
        assert all(not str(m).startswith("0") or m == 0 for m in misses)  # no leading zeros
