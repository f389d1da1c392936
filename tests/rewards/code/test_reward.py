"""The `code_tests` reward: its options, where the tests come from, the rewards and labels it gives on the
30-problem code task (tests/code_task), and the score stage's logic over it."""
from __future__ import annotations

import json

import polars as pl
import pytest

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.rewards.code import BadTests, code_tests, extract_code
from rlpipe.rewards.functions import RewardResult, Sample
from rlpipe.stages.score import score_rows
from tests.code_task import PROBLEMS, completion, prompt_rows
from tests.rewards.code.helpers import ADD_IO, ADD_TESTS, ISOLATION, OPTIONS, score

TASK_OPTIONS = {**OPTIONS, "timeout_s": 5.0, "cpu_time_s": 5, "memory_mb": 512, "float_tolerance": 1e-6}


def code_table(completions: list[str], tests, metadata: list[dict] | None = None) -> pl.DataFrame:
    n = len(completions)
    metadata = metadata or [{"tests": tests}] * n
    return pl.DataFrame({
        "prompt_id": list(range(n)), "sample_idx": pl.Series([0] * n, dtype=pl.Int32),
        "prompt": ["Write the program."] * n, "completion_text": completions, "answer": [None] * n,
        "metadata": [json.dumps(m) for m in metadata],
        "completion_length": pl.Series([len(c) for c in completions], dtype=pl.Int32), "truncated": [False] * n,
    })


def stage_config(workers: int = 1, max_error_fraction: float = 0.0, **options) -> ScoreConfig:
    entry = RewardEntry("code_tests", 1.0, {**TASK_OPTIONS, **options})
    return ScoreConfig(rewards=(entry,), accuracy_reward="code_tests", fallback_reward=0.0,
                       max_error_fraction=max_error_fraction, workers=workers, row_timeout_s=None)


# ---------------------------------------------------------------------------------------------
# The code task
# ---------------------------------------------------------------------------------------------

def task_samples(which: str) -> list[Sample]:
    out = []
    for problem, row in zip(PROBLEMS, prompt_rows()):
        metadata = {k: v for k, v in row.items() if k != "prompt"}
        out.append(Sample(row["prompt"], completion(problem, which), None, metadata, 10, False))
    return out


def test_the_code_task_has_every_format():
    kinds = [p["kind"] for p in PROBLEMS]
    assert (len(PROBLEMS), kinds.count("stdin"), kinds.count("call"), kinds.count("assert")) == (30, 16, 8, 6)


def test_partial_credit_is_the_share_of_tests_passed():
    wrong = "def add(a, b):\n    return 5\n"  # right on add(2, 3) == 5, wrong on add(-1, 1) == 0: 1 of 2
    assert score(wrong, partial_credit=True) == RewardResult(0.5, "wrong_answer")
    assert score(wrong, partial_credit=False) == RewardResult(0.0, "wrong_answer")
    io = {"inputs": ["2 3\n", "-1 1\n", "0 0\n"], "outputs": ["5\n", "0\n", "0\n"]}
    assert score("print(5 if input() == '2 3' else 0)", io, partial_credit=True) == RewardResult(1.0, "pass")
    assert score("print(5)", io, partial_credit=True) == RewardResult(1 / 3, "wrong_answer")


def test_a_timeout_fails_only_its_own_test_with_partial_credit():
    slow_on_negatives = "import time\ndef add(a, b):\n    if a < 0:\n        time.sleep(30)\n    return a + b\n"
    assert score(slow_on_negatives, partial_credit=True, timeout_s=0.5) == RewardResult(0.5, "timeout")


def test_a_syntax_error_stops_the_row_and_fails_every_test():
    assert score("def add(a, b)\n    return a + b\n", partial_credit=True) == RewardResult(0.0, "syntax_error")


def test_float_tolerance_applies_to_stdout_and_values():
    io = {"inputs": ["\n"], "outputs": ["0.3333333333\n"]}
    assert score("print(1 / 3 + 1e-8)", io, float_tolerance=1e-6).value == 1.0
    assert score("print(1 / 3 + 1e-8)", io, float_tolerance=0.0).value == 0.0
    assert score("def f():\n    return 0.1 + 0.2\n", "assert f() == 0.3", float_tolerance=1e-9).value == 1.0
    assert score("def f():\n    return 0.1 + 0.2\n", "assert f() == 0.3", float_tolerance=0.0).value == 0.0


def test_stdin_programs_may_exit_and_use_threads_as_on_a_judge():
    io = {"inputs": ["2 3\n"], "outputs": ["5\n"]}
    assert score("import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)\n", io).detail == "pass"
    assert score("print(5)\nexit()\n", io).detail == "pass"
    threaded = ("import sys, threading\nsys.setrecursionlimit(10000)\nthreading.stack_size(1 << 26)\n"
                "def main():\n    print(sum(map(int, sys.stdin.readline().split())))\n"
                "threading.Thread(target=main).start()\n")
    assert score(threaded, io, memory_mb=512).detail == "pass"
    assert score("print(5)\nraise SystemExit(3)\n", io).detail == "runtime_error"  # right output, exit 3


def test_call_based_solutions_may_be_a_leetcode_class_and_stdin_main_blocks_do_not_run():
    lcb = [{"input": "[1, 2]", "output": "3", "testtype": "functional"}]
    leetcode = "class Solution:\n    def total(self, xs):\n        return sum(xs)\n"
    assert score(leetcode, lcb, metadata={"fn_name": "total"}).detail == "pass"
    guarded = ("def add(a, b):\n    return a + b\n"
               "if __name__ == '__main__':\n    print(add(*map(int, input().split())))\n")
    assert score(guarded).detail == "pass"  # its __main__ block would wait for input: it does not run


# ---------------------------------------------------------------------------------------------
# Where the tests come from; options
# ---------------------------------------------------------------------------------------------

def test_tests_from_the_answer_column_when_tests_key_is_null():
    sample = Sample("q", "def add(a, b):\n    return a + b\n", json.dumps(ADD_IO | {"fn_name": None}), {}, 1, False)
    io_sample = Sample("q", "print(sum(map(int, input().split())))", json.dumps(ADD_IO), {}, 1, False)
    assert code_tests(io_sample, **{**OPTIONS, "tests_key": None}) == RewardResult(1.0, "pass")
    assert code_tests(sample, **{**OPTIONS, "tests_key": None}).detail == "wrong_answer"  # it prints nothing


@pytest.mark.parametrize(("metadata", "options", "needle"), [
    ({}, {}, "no tests in metadata['tests']"),
    ({"tests": "for i in range(3):\n    assert add(i, 0) == i\n"}, {}, "cannot be judged outside"),
    ({"tests": "assert ("}, {}, "do not parse"),
    ({"tests": 5}, {}, "must be a string"),
])
def test_bad_tests_are_a_data_error_naming_the_key(metadata, options, needle):
    with pytest.raises(BadTests, match="code_tests: ") as info:
        code_tests(Sample("q", "x = 1", None, metadata, 1, False), **{**OPTIONS, **options})
    assert needle in str(info.value)


@pytest.mark.parametrize(("options", "needle"), [
    ({"required_protections": ["magic"]}, "unknown protection"),
    ({"required_protections": ["process_group_kill"]}, "process_group_kill is now kill_all"),
    ({"required_protections": "pid_namespace"}, "must be a list"),
    ({"cpu_time_s": 1.5}, "cpu_time_s must be an integer"),
    ({"memory_mb": 0}, "memory_mb must be a number > 0"),
    ({"max_open_files": 8}, "max_open_files must be at least 16"),
    ({"partial_credit": "yes"}, "partial_credit must be true or false"),
    ({"allow_forgeable_tests": 1}, "allow_forgeable_tests must be true or false"),
    ({"float_tolerance": -1e-6}, "float_tolerance must be a number >= 0"),
    ({"float_tolerance": float("nan")}, "float_tolerance must be a number >= 0"),
    ({"tests_key": 3}, "tests_key must be a metadata key or null"),
])
def test_option_checks(options, needle):
    with pytest.raises(ValueError, match=None) as info:
        score("def add(a, b):\n    return a + b\n", **options)
    assert needle in str(info.value)


def test_an_old_params_entry_fails_before_any_row_naming_the_new_options():
    from rlpipe.errors import ConfigError
    from rlpipe.stages.score import load_reward_functions

    old = {k: v for k, v in OPTIONS.items() if k not in ("max_open_files", "float_tolerance", "allow_forgeable_tests")}
    cfg = ScoreConfig(rewards=(RewardEntry("code_tests", 1.0, old),), accuracy_reward="code_tests",
                      fallback_reward=0.0, max_error_fraction=0.0, workers=1, row_timeout_s=None)
    with pytest.raises(ConfigError, match="missing required option.*max_open_files"):
        load_reward_functions(cfg)


def test_extract_code_takes_the_last_python_block():
    assert extract_code("```python\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("```python\nc = 3\n") == "c = 3\n"
    assert extract_code("```\nplain fence\n```") == "```\nplain fence\n```"


# ---------------------------------------------------------------------------------------------
# The score stage's logic
# ---------------------------------------------------------------------------------------------

def task_table(which: str) -> pl.DataFrame:
    completions, metadata = [], []
    for problem, row in zip(PROBLEMS, prompt_rows()):
        completions.append(completion(problem, which))
        metadata.append({k: v for k, v in row.items() if k != "prompt"})
    return code_table(completions, None, metadata)


def test_the_score_stage_over_the_task_is_the_same_for_any_worker_count():
    table = pl.concat([task_table("correct"), task_table("wrong")]).with_columns(
        pl.Series("prompt_id", range(2 * len(PROBLEMS))))
    serial, serial_m = score_rows(table, stage_config(workers=1))
    parallel, parallel_m = score_rows(table, stage_config(workers=2))
    assert parallel.equals(serial) and parallel_m == serial_m
    assert serial["reward"].to_list() == [1.0] * 30 + [0.0] * 30
    assert serial_m["details"] == {"code_tests": {"pass": 30, "wrong_answer": 30}}
    assert serial_m["errors"] == 0 and serial_m["accuracy"] == 0.5
    _, partial_m = score_rows(task_table("wrong"), stage_config(workers=2, partial_credit=True))
    assert 0.0 < partial_m["reward_mean"] < 1.0 and partial_m["accuracy"] == 0.0  # none of them reaches 1
    info = serial_m["reward_info"]["code_tests"]["sandbox"]
    assert info["active"] == list(ISOLATION.active) and info["missing"] == ISOLATION.missing


def test_rewards_without_run_info_add_nothing_to_the_metrics():
    entry = RewardEntry("length_penalty", 1.0, {"max_tokens": 10, "buffer_tokens": 2})
    cfg = ScoreConfig(rewards=(entry,), accuracy_reward="length_penalty", fallback_reward=0.0,
                      max_error_fraction=0.0, workers=1, row_timeout_s=None)
    _, metrics = score_rows(code_table(["x"], ADD_TESTS), cfg)
    assert "reward_info" not in metrics
