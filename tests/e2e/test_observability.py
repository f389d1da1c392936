"""End to end: `rlpipe inspect` / `rlpipe diff`, `dvc metrics`, `dvc plots` and `dvc exp` on a real iteration."""
from __future__ import annotations

import csv
import json

import pytest
import yaml

from rlpipe.data.io import read_json
from rlpipe.reports.packed import unpack
from tests.e2e.conftest import run
from tests.plots_project import ITERATION_CHARTS, STEP_CHARTS
from tests.test_docs import doc_test_blocks

pytestmark = pytest.mark.slow

STAGES = ("prepare", "generate", "train_reward_model", "score", "reference_logprob", "values", "advantage", "train",
          "evaluate")
ITERATION_PLOTS = ITERATION_CHARTS
STEP_PLOTS = ["plots/train_steps.csv", *STEP_CHARTS]


def test_inspect_agrees_with_the_stage_metrics(reproduced, tmp_path):
    data = json.loads(run(["rlpipe", "inspect", ".", "--json"], reproduced).stdout)
    s = data["summary"]
    assert s["rows_total"] == 64 and s["warnings"] == [] and s["missing"] == {}
    assert [a["role"] for a in s["artifacts"]] == ["rollouts", "scores", "ref_logprobs", "advantages",
                                                     "token_stats", "prompts"]
    score, advantage = read_json(reproduced / "metrics/score.json"), read_json(reproduced / "metrics/advantage.json")
    generate = read_json(reproduced / "metrics/generate.json")
    assert s["reward"]["mean"] == pytest.approx(score["reward_mean"])
    assert s["accuracy"] == pytest.approx(score["accuracy"])
    assert s["groups"]["zero_variance_share"] == pytest.approx(advantage["zero_variance_groups"] / 16)
    assert s["length"]["mean"] == pytest.approx(generate["length_mean"])
    assert s["truncation_rate"] == pytest.approx(generate["truncation_rate"])
    assert s["logprob_mismatch"]["mean_abs"] < 1e-4  # the trainer recomputes the sampler's log-probs (fp32 CPU)
    assert abs(s["kl_ref"]["k1"]) < 1e-4  # iteration 0: the reference is the sampling policy

    page = tmp_path / "report.html"
    out = run(["rlpipe", "inspect", ".", "--sort", "reward", "--desc", "--show", "5", "--html", str(page)],
              reproduced).stdout
    assert "colour = token_advantages" in out
    shown = json.loads(run(["rlpipe", "inspect", ".", "--sort", "reward", "--desc", "--show", "5", "--json"],
                           reproduced).stdout)["rows"]
    tokens = unpack(page.read_text())  # each token stored once, packed; the page's script draws the spans
    assert tokens["offsets"][-1] == len(tokens["pieces"]) == sum(r["completion_length"] for r in shown)
    assert tokens["columns"][0] == "token_advantages"  # the colouring column
    assert shown[0]["prompt"] in page.read_text()


def test_show_without_sort_gives_informative_distinct_rows_and_the_run(reproduced):
    """#15 item 10: not G identical samples of a zero-variance group, but mixed groups' best and worst first."""
    data = json.loads(run(["rlpipe", "inspect", ".", "--show", "8", "--json"], reproduced).stdout)
    rows, groups = data["rows"], data["groups"]
    assert data["summary"]["selection"]["order"] == "informative" and len(rows) == 8
    mixed = [not groups[str(r["prompt_id"])]["zero_variance"] for r in rows]
    assert mixed == sorted(mixed, reverse=True)  # every mixed-reward group's rows before any zero-variance one
    seen = {(r["prompt_id"], tuple(r["token_ids"])) for r in rows}
    assert len(seen) == 8  # no completion twice within a prompt
    if mixed[0] and groups[str(rows[0]["prompt_id"])]["shown"] >= 2:  # a group's best, then its worst
        assert rows[0]["advantage"] > 0 > rows[1]["advantage"]
    run_meta = data["summary"]["run"]
    assert run_meta["params"]["advantage.estimator"] == "grpo" and run_meta["policy_version"] == 0
    assert run_meta["sampling"]["group_size"] == 4 and len(run_meta["git"]["commit"]) == 12


def test_metrics_plots_and_diff_after_iterate(project_copy):
    root = project_copy
    run(["rlpipe", "iterate"], root)
    table = list(csv.DictReader((root / "plots/iterations.csv").open()))
    assert [r["iteration"] for r in table] == ["0"]
    assert float(table[0]["eval_accuracy"]) == read_json(root / "metrics/evaluate.json")["accuracy"]
    lengths = read_json(root / "metrics/generate.json")["length_quantiles"]
    assert [float(table[0][f"length_p{q}"]) for q in (10, 25, 50, 75, 90)] == list(lengths.values())
    assert table[0]["train_tool_use_rate"] == table[0]["eval_turns_mean"] == ""  # single-turn: nothing measured

    shown = json.loads(run(["dvc", "metrics", "show", "--json"], root).stdout)
    assert len(shown) == 1  # the workspace (its key is "" or "workspace", depending on the DVC version)
    workspace = next(iter(shown.values()))["data"]
    # the headline only (rlpipe/stages/headline.py): one row per stage, nine columns; the rest stays in metrics/<stage>.json
    assert set(workspace) == {f"metrics/headline/{s}.json" for s in [*STAGES, "baseline"]}  # baseline: evaluate's
    columns = {key for f in workspace.values() for key in f["data"]}
    assert columns == {"accuracy", "reward_mean", "length_mean", "truncation_rate", "zero_variance_fraction",
                       "kl_ref", "approx_kl_old", "clip_fraction", "seconds"}
    evaluate, full = workspace["metrics/headline/evaluate.json"]["data"], read_json(root / "metrics/evaluate.json")
    assert evaluate == {"accuracy": full["accuracy"], "reward_mean": full["reward_mean"],
                        "length_mean": full["length_mean"], "seconds": full["seconds"]["total"]}
    assert len(run(["dvc", "metrics", "show"], root).stdout.splitlines()[0]) < 200  # was 2,036 characters
    assert json.loads(run(["dvc", "metrics", "diff", "iteration-0", "--all", "--json"], root).stdout) is not None

    plots = json.loads(run(["dvc", "plots", "show", "--json"], root).stdout)
    assert "errors" not in plots, plots.get("errors")
    assert set(plots["data"]) == set(ITERATION_PLOTS + STEP_PLOTS)
    accuracy = plots["data"][ITERATION_PLOTS[0]][0]["content"]["data"]["values"]
    assert {v["filename::field"] for v in accuracy} == {"eval.csv::eval_accuracy", "iterations.csv::train_accuracy"}
    evals = [(v["iteration"], v["eval_accuracy"]) for v in accuracy if v["filename::field"] == "eval.csv::eval_accuracy"]
    # the eval curve starts with the starting model (the baseline stage, iteration -1), then iteration 0's
    assert evals == [("-1", str(read_json(root / "metrics/baseline.json")["accuracy"])),
                     ("0", str(read_json(root / "metrics/evaluate.json")["accuracy"]))]
    steps = plots["data"]["plots/train_steps.csv"][0]["content"]
    assert steps["encoding"]["x"]["field"] == "step" and len(steps["data"]["values"]) == 4
    diffed = json.loads(run(["dvc", "plots", "diff", "iteration-0", "--json"], root).stdout)
    assert set(diffed["data"][ITERATION_PLOTS[0]][0]["revisions"]) == {"iteration-0", "workspace"}

    # A git tag on one side: its stage metrics and eval rollouts through DVC from the cache.
    data = json.loads(run(["rlpipe", "diff", "iteration-0", ".", "--json"], root).stdout)
    assert data["a"] == "iteration-0" and data["notes"] == []
    kl_row = next(m for m in data["metrics"] if m["metric"] == "KL to reference (trainer, kl_ref)")
    assert kl_row["a"] == read_json(root / "metrics/train.json")["kl_ref"]  # a key only the full file has
    assert data["flips"]["compared"] == 24
    assert (data["flips"]["wrong_to_right"], data["flips"]["right_to_wrong"]) == (0, 0)
    assert data["flips"]["examples_wrong_to_right"] == []
    accuracy_row = next(m for m in data["metrics"] if m["metric"] == "eval accuracy")
    assert accuracy_row["delta"] == 0.0 and accuracy_row["change"] == "same"
    assert data["params"] == [{"key": "iteration", "a": 0, "b": 1},
                              {"key": "policy.path", "a": "artifacts/prepare/model", "b": "state/policy"},
                              {"key": "policy.version", "a": 0, "b": 1},
                              {"key": "policy.latest_path", "a": "artifacts/prepare/model", "b": "state/policy"}]
    assert "eval accuracy" in run(["rlpipe", "diff", "0", "."], root).stdout
    # the tag's eval rollouts through DVC, as diff's per-prompt commands read them
    old = json.loads(run(["rlpipe", "inspect", ".", "--rev", "0", "--eval", "--prompt-id", "3", "--json"], root).stdout)
    assert [r["prompt_id"] for r in old["rows"]] == [3] and old["summary"]["run"]["revision"] == "iteration-0"

    # Offline plots: the template serves `dvc plots diff` too; static charts of a diff without a browser.
    run(["rlpipe", "plots", "setup"], root)
    run(["dvc", "plots", "diff", "iteration-0", "-o", "diff_html"], root)
    page = (root / "diff_html/index.html").read_text()
    assert "cdn.jsdelivr" not in page and "no network needed" in page
    assert page.count("vegaEmbed('#") == len(ITERATION_PLOTS + STEP_PLOTS)
    run(["rlpipe", "plots", "render", "charts", "--rev", "iteration-0", "--format", "svg"], root)
    svgs = sorted(p.name for p in (root / "charts").glob("*.svg"))
    assert len(svgs) == len(ITERATION_PLOTS + STEP_PLOTS)
    assert "iteration-0" in (root / "charts/reward-per-iteration.svg").read_text()  # the legend's revisions


def test_exp_run_sweeps_a_param_and_exp_show_lists_the_metrics(project_copy):
    """Runs the `dvc exp` block of docs/metrics-and-plots.md (a doc-test) and checks what it did."""
    root = project_copy
    [code] = [c for page, _, c in doc_test_blocks() if "dvc exp run -S train.lr=5e-5" in c]
    proc = run(["bash", "-euo", "pipefail", "-c", code], root)
    assert "Running stage 'train'" in proc.stdout and "Running stage 'generate'" not in proc.stdout
    assert "Running stage 'evaluate'" in proc.stdout
    assert "metrics/headline/evaluate.json:accuracy" in proc.stdout and "5e-05" in proc.stdout  # the doc's table
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root).stdout)
    exps = [e for base in shown for e in (base.get("experiments") or [])]
    assert len(exps) == 1
    data = exps[0]["revs"][0]["data"]
    assert data["params"]["params.yaml"]["data"]["train"]["lr"] == 5e-5
    metrics = data["metrics"]
    assert set(metrics["metrics/headline/evaluate.json"]["data"]) >= {"accuracy", "reward_mean"}
    assert set(metrics["metrics/headline/train.json"]["data"]) >= {"kl_ref", "clip_fraction", "approx_kl_old"}
    refused = run(["rlpipe", "iterate"], root, check=False)  # the workspace holds the experiment's results
    assert refused.returncode == 2 and "left by `dvc exp run` or `dvc exp apply`" in refused.stderr
    run(["rlpipe", "iterate", "--allow-experiment"], root)  # asked for: the experiment is the iteration
    recorded = yaml.safe_load(run(["git", "show", "iteration-0:params.yaml"], root).stdout)
    assert float(recorded["train"]["lr"]) == 5e-5 and run(["git", "status", "--porcelain", "-uno"], root).stdout == ""
