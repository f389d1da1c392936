"""The score stage's table: weighted sum, components, correctness, per-row errors, the error threshold,
detail counts of RewardResult labels, and the same results for any worker count."""
import random
import threading
import time

import polars as pl
import pytest

from rlpipe.rewards.functions import RewardResult

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.errors import ConfigError, ScoringError
from rlpipe.stages.score import score_rows

EXACT = RewardEntry("exact_answer", 1.0, {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True})
DIGITS = RewardEntry("digit_match", 0.5, {"answer_prefix": None})


def cfg(rewards=(EXACT, DIGITS), **over):
    base = dict(rewards=tuple(rewards), accuracy_reward="exact_answer", fallback_reward=-1.0, max_error_fraction=0.5,
                workers=1, row_timeout_s=None)
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


def labelled_parity(sample, *, delay_s):
    """A test reward: 1.0 for an even answer, labelled; sleeps a random while so threads finish out of order."""
    time.sleep(random.Random(sample.completion).uniform(0, delay_s))
    if sample.completion == "boom":
        raise RuntimeError("reward failed on this row")
    even = int(sample.completion) % 2 == 0
    return RewardResult(1.0 if even else 0.0, "even" if even else "odd")


PARITY = RewardEntry("tests.stages.test_score:labelled_parity", 1.0, {"delay_s": 0.002})


def test_reward_result_labels_are_counted_per_component():
    frame, m = score_rows(rows(["2", "3", "4", "5", "6"], ["2", "3", "4", "5", "6"]),
                          cfg([EXACT, PARITY]))
    assert frame["reward_labelled_parity"].to_list() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert frame["reward"].to_list() == [2.0, 1.0, 2.0, 1.0, 2.0]  # exact (1.0 each) + parity
    assert m["details"] == {PARITY.name: {"even": 3, "odd": 2}}  # keyed like "components"; exact_answer: no entry


def test_details_are_empty_for_plain_float_rewards():
    _, m = score_rows(rows(["1"], ["1"]), cfg())
    assert m["details"] == {}


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_any_worker_count_gives_the_same_table_and_metrics(workers):
    completions = [str(i) for i in range(40)] + ["boom"]  # one reward error, to check errors keep their row too
    table = rows(completions, completions)
    serial, serial_m = score_rows(table, cfg([EXACT, PARITY]))
    threads_seen = set()

    def progress(n):
        threads_seen.add(threading.current_thread().name)
    parallel, parallel_m = score_rows(table, cfg([EXACT, PARITY], workers=workers), progress=progress)
    assert parallel.equals(serial)  # same rows, same order, same values, same error strings
    assert parallel_m == serial_m
    assert serial_m["errors_by_kind"] == {"RuntimeError": 1} and serial["score_error"][40].startswith("RuntimeError")
    assert threads_seen == {threading.main_thread().name}  # progress is reported from the caller's thread


_barrier = threading.Barrier(2)


def meet_another_row(sample):
    """A test reward that returns only once a second row is being scored at the same moment."""
    _barrier.wait(timeout=5)  # serial scoring would raise BrokenBarrierError here
    return 1.0


def test_workers_score_rows_at_the_same_time():
    _barrier.reset()
    frame, m = score_rows(rows(["1", "2", "3", "4"], ["1", "2", "3", "4"]),
                          cfg([EXACT, RewardEntry("tests.stages.test_score:meet_another_row", 1.0, {})], workers=2))
    assert m["errors"] == 0 and frame["reward_meet_another_row"].to_list() == [1.0] * 4


def test_a_nan_fallback_reward_is_counted_and_left_out_of_the_metrics():
    from rlpipe.stages.score import score_metrics

    frame = pl.DataFrame({"reward": [1.0, float("nan"), 0.0], "correct": [True, None, False],
                          "reward_exact_answer": [1.0, None, 0.0]})
    m = score_metrics(frame, {"exact_answer": "reward_exact_answer"}, {"ValueError": 1}, {})
    assert (m["reward_mean"], m["unscorable"]) == (0.5, 1)
    assert m["reward_std"] == pytest.approx(0.7071, abs=1e-4)
    # the scored rewards 1.0 and 0.0 (sorted 0.0, 1.0): index round(q * 1) is 0 up to p25, 1 from p50
    assert m["reward_quantiles"] == {"p10": 0.0, "p25": 0.0, "p50": 1.0, "p75": 1.0, "p90": 1.0}


def test_token_ids_are_read_only_when_a_reward_can_read_them():
    from rlpipe.stages.score import SCORED_ROLLOUT_COLUMNS, scored_rollout_columns

    without = scored_rollout_columns(cfg())
    assert "completion_token_ids" not in without and "prompt_token_ids" not in without
    assert set(without) == set(SCORED_ROLLOUT_COLUMNS) - {"completion_token_ids", "prompt_token_ids"}
    own = RewardEntry("my_pkg.rewards:by_tokens", 1.0, {})
    model = RewardEntry("reward_model", 1.0, {})
    assert scored_rollout_columns(cfg([EXACT, own])) == SCORED_ROLLOUT_COLUMNS
    assert scored_rollout_columns(cfg([EXACT, model])) == SCORED_ROLLOUT_COLUMNS


def test_rows_in_batches_score_as_one_table():
    from rlpipe.stages.score import score_batches

    table = rows(["1", "2", "x", "4", "5"], ["1", "3", "3", "4", "5"])
    whole, whole_m = score_rows(table, cfg())
    parts, parts_m = score_batches([table.slice(0, 2), table.slice(2, 2), table.slice(4, 1)], cfg())
    assert parts.equals(whole) and parts_m == whole_m
