"""The iteration history as a DVC plot: plots/iterations.csv rewritten from history/iterations.jsonl."""
import csv
import json

import pytest

from rlpipe.errors import ArtifactError
from rlpipe.run.history import (
    baseline_row,
    eval_numbers,
    read_history,
    write_history_csv,
)


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


def test_the_baseline_row_starts_the_eval_series_and_stays_out_of_the_train_one(tmp_path):
    """The starting model's eval sits at iteration -1 in plots/eval.csv only: in iterations.csv every train column
    of its row would be empty, which a DVC plot draws as 0."""
    evaluate = {"accuracy": 0.5, "reward_mean": 0.75, "accuracy_by": {"difficulty": {"easy": 1.0, "hard": 0.25}}}
    assert eval_numbers(evaluate) == {"eval_accuracy": 0.5, "eval_reward_mean": 0.75,
                                      "eval_accuracy_by.difficulty.easy": 1.0, "eval_accuracy_by.difficulty.hard": 0.25}
    odd = eval_numbers({"accuracy": 0.5, "reward_mean": 0.75, "accuracy_by": {"src": {"openai/gsm8k": 0.5, "a=b[c]": 0.1}}})
    assert set(odd) - {"eval_accuracy", "eval_reward_mean"} == {  # names MLflow and DVCLive take
        "eval_accuracy_by.src.openai_gsm8k", "eval_accuracy_by.src.a_b_c_"}
    hist = tmp_path / "iterations.jsonl"
    baseline = baseline_row({"accuracy": 0.25, "reward_mean": 0.5})
    assert baseline == {"iteration": -1, "baseline": True, "policy_version": 0, "eval_accuracy": 0.25,
                        "eval_reward_mean": 0.5}
    rows = [baseline, {"iteration": 0, "eval_accuracy": 0.5, "eval_reward_mean": 0.75, "kl_ref": 0.1}]
    hist.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_history_csv(hist, tmp_path / "iterations.csv", tmp_path / "eval.csv")
    assert (tmp_path / "iterations.csv").read_text() == "iteration,eval_accuracy,eval_reward_mean,kl_ref\n0,0.5,0.75,0.1\n"
    assert (tmp_path / "eval.csv").read_text() == "iteration,eval_accuracy,eval_reward_mean\n-1,0.25,0.5\n0,0.5,0.75\n"


def test_iterate_puts_the_baseline_first_and_replaces_its_earlier_rows(tmp_path):
    from rlpipe.run.iterate import write_history

    hist = tmp_path / "h.jsonl"
    write_history(hist, {"iteration": 0, "eval_accuracy": 0.5}, baseline={"iteration": -1, "eval_accuracy": 0.2})
    write_history(hist, {"iteration": 1, "eval_accuracy": 0.6}, baseline={"iteration": -1, "eval_accuracy": 0.3})
    write_history(hist, {"iteration": 1, "eval_accuracy": 0.7}, baseline=None)  # a project without the stage
    assert [json.loads(line) for line in hist.read_text().splitlines()] == [
        {"iteration": -1, "eval_accuracy": 0.3}, {"iteration": 0, "eval_accuracy": 0.5},
        {"iteration": 1, "eval_accuracy": 0.7}]


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
