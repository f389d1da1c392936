"""The iteration history as a DVC plot: plots/iterations.csv rewritten from history/iterations.jsonl."""
import csv
import json

import pytest

from rlpipe.errors import ArtifactError
from rlpipe.run.history import read_history, write_history_csv


def test_csv_has_one_row_per_iteration_sorted(tmp_path):
    hist = tmp_path / "history/iterations.jsonl"
    hist.parent.mkdir()
    rows = [{"iteration": 1, "eval_accuracy": 0.75, "kl_ref": 0.2}, {"iteration": 0, "eval_accuracy": 0.5,
                                                                     "kl_ref": None}]
    hist.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    out = write_history_csv(hist, tmp_path / "plots/iterations.csv")
    table = list(csv.DictReader(out.open()))
    assert list(table[0]) == ["iteration", "eval_accuracy", "kl_ref"]
    assert [(r["iteration"], r["eval_accuracy"], r["kl_ref"]) for r in table] == [("0", "0.5", ""), ("1", "0.75", "0.2")]


def test_missing_history_gives_a_header_only_and_bad_lines_are_named(tmp_path):
    assert read_history(tmp_path / "none.jsonl") == []
    bad = tmp_path / "h.jsonl"
    bad.write_text('{"iteration": 0}\n{oops\n')
    with pytest.raises(ArtifactError, match=r"h.jsonl:2: not a JSON line"):
        read_history(bad)
