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


def test_chart_columns_are_always_there_and_empty_where_nothing_was_measured():
    """dvc.yaml's multi-turn and distribution charts name these columns: a single-turn run writes them empty."""
    from rlpipe.run.history import chart_columns

    quantiles = {"p10": 1.0, "p25": 2.0, "p50": 3.0, "p75": 4.0, "p90": 5.0}
    multi = chart_columns(generate={"tool_use_rate": 0.25, "turns_mean": 1.5, "length_quantiles": quantiles},
                          score={"reward_quantiles": {k: v / 10 for k, v in quantiles.items()}},
                          evaluate={"tool_use_rate": 0.5, "turns_mean": 2.0})
    assert multi == {"eval_tool_use_rate": 0.5, "eval_turns_mean": 2.0, "train_tool_use_rate": 0.25,
                     "train_turns_mean": 1.5, "train_reward_p10": 0.1, "train_reward_p25": 0.2, "train_reward_p50": 0.3,
                     "train_reward_p75": 0.4, "train_reward_p90": 0.5, "length_p10": 1.0, "length_p25": 2.0,
                     "length_p50": 3.0, "length_p75": 4.0, "length_p90": 5.0}
    single = chart_columns(generate={"length_mean": 3.0}, score={}, evaluate={"accuracy": 0.5})
    assert single == dict.fromkeys(multi)  # the same columns, every one empty
