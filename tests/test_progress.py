"""rlpipe.progress: bars only on a terminal outside CI; callbacks count units and change nothing."""
import io
from pathlib import Path

import polars as pl

from rlpipe.config import load_params
from rlpipe.progress import progress_enabled, stage_progress
from rlpipe.stages.score import score_rows
from tests.shipped import shipped_params

REPO = Path(__file__).resolve().parents[1]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_when_not_a_terminal_or_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("RLPIPE_NO_PROGRESS", raising=False)
    assert progress_enabled(FakeTTY()) is True
    assert progress_enabled(io.StringIO()) is False
    monkeypatch.setenv("CI", "true")
    assert progress_enabled(FakeTTY()) is False
    monkeypatch.delenv("CI")
    monkeypatch.setenv("RLPIPE_NO_PROGRESS", "1")
    assert progress_enabled(FakeTTY()) is False


def test_quiet_bar_writes_nothing_and_accepts_calls(monkeypatch):
    monkeypatch.setenv("CI", "1")
    stream = FakeTTY()
    with stage_progress("score", total=3, unit="rows", stream=stream) as advance:
        for _ in range(3):
            advance(1)
    assert stream.getvalue() == ""


def test_forced_bar_draws_description_count_and_eta():
    stream = io.StringIO()
    with stage_progress("generate", total=10, unit="samples", stream=stream, force=True) as advance:
        advance(4)
        advance(6)
    text = stream.getvalue()
    assert "generate" in text and "samples" in text and "eta" in text


def test_score_rows_calls_progress_once_per_row():
    rows = pl.DataFrame({"prompt_id": [0, 0, 1], "sample_idx": [0, 1, 0], "prompt": ["1+1="] * 3,
                         "completion_text": ["2", "3", "2"], "answer": ["2"] * 3, "metadata": ["{}"] * 3,
                         "completion_length": [1, 1, 1], "truncated": [False] * 3},
                        schema_overrides={"sample_idx": pl.Int32, "completion_length": pl.Int32})
    cfg = load_params(shipped_params()).score  # the default rewards: exact_answer + 0.5 digit_match
    calls: list[int] = []
    with_bar, _ = score_rows(rows, cfg, progress=calls.append)
    assert calls == [1, 1, 1]
    assert with_bar.equals(score_rows(rows, cfg)[0])
    assert with_bar["correct"].to_list() == [True, False, True]
