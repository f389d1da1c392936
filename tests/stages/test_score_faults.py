"""A reward that raises, hangs, or returns NaN/None/non-numbers on some rows: per-row error, fallback, threshold."""
import threading
import time

import pytest

from rlpipe.config import RewardEntry
from rlpipe.errors import ScoringError
from rlpipe.stages.score import score_rows
from tests.stages.test_score import EXACT, cfg, rows

RELEASE = threading.Event()  # set at the end of each test so abandoned threads finish


def misbehaving(sample):
    """A test reward: what it does is named by the completion."""
    kind = sample.completion
    if kind == "raise":
        raise KeyError("no such thing")
    if kind == "hang":
        RELEASE.wait(30)  # stands in for a reward that never returns
        return 1.0
    return {"nan": float("nan"), "inf": float("inf"), "none": None, "str": "1.0", "list": [1.0],
            "bool": True}.get(kind, 0.5)


BAD = RewardEntry("tests.stages.test_score_faults:misbehaving", 1.0, {})


@pytest.fixture(autouse=True)
def release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("kind, error", [
    ("raise", "KeyError"), ("nan", "ValueError"), ("inf", "ValueError"), ("none", "TypeError"), ("str", "TypeError"),
    ("list", "TypeError"), ("bool", "TypeError"), ("hang", "TimeoutError"),
])
def test_each_misbehaviour_is_a_row_error_with_the_fallback_reward(kind, error):
    frame, m = score_rows(rows(["ok", kind, "ok"], ["1", "1", "1"]),
                          cfg([EXACT, BAD], row_timeout_s=0.5, max_error_fraction=0.34))
    assert frame["score_error"][1].startswith(f"{error}: ")
    assert frame["reward"].to_list() == [0.5, -1.0, 0.5]  # exact_answer 0 + misbehaving 0.5; the fallback is -1
    assert frame["score_error"][0] is None and frame["score_error"][2] is None
    assert m["errors_by_kind"] == {error: 1}


def test_a_hung_row_is_abandoned_after_the_timeout_with_any_worker_count():
    for workers in (1, 2):
        start = time.monotonic()
        frame, m = score_rows(rows(["ok", "hang", "ok", "hang"], ["1"] * 4),
                              cfg([EXACT, BAD], row_timeout_s=0.3, max_error_fraction=0.5, workers=workers))
        assert time.monotonic() - start < 5
        assert frame["score_error"].to_list()[1].startswith("TimeoutError: the row's rewards ran past "
                                                             "score.row_timeout_s=0.3 s")
        assert m["errors_by_kind"] == {"TimeoutError": 2}


def test_without_a_row_timeout_a_slow_row_just_finishes():
    RELEASE.set()
    frame, m = score_rows(rows(["hang"], ["1"]), cfg([EXACT, BAD], row_timeout_s=None))
    assert frame["reward"].to_list() == [1.0] and m["errors"] == 0


def test_more_failing_rows_than_allowed_fail_the_stage_naming_the_first():
    with pytest.raises(ScoringError, match=r"2 of 3 rows .*max_error_fraction=0.5; first error at prompt_id=1 "
                                           r"sample_idx=0: TimeoutError"):
        score_rows(rows(["ok", "hang", "nan"], ["1"] * 3), cfg([EXACT, BAD], row_timeout_s=0.2, max_error_fraction=0.5))
