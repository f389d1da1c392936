"""`rlpipe inspect` and `rlpipe diff` through typer's CliRunner: every option, every kind of bad input."""
import html
import json
import re
import subprocess

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from tests.inspect_project import make_project

runner = CliRunner()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("cli_inspect") / "proj")


def ok(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "220"})  # rich wraps at the terminal's width
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def fails(*args: str, message: str):
    """Exit code 2, one clear line naming the problem, no traceback."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    assert message in result.output, result.output
    return result


def as_json(*args: str) -> dict:
    return json.loads(ok(*args, "--json").stdout)


def test_summary_in_the_terminal(project):
    out = ok("inspect", str(project)).stdout
    for text in ("artifacts", "statistics", "rollouts", "token_stats", "reward_exact_answer", "zero-variance",
                 "ValueError: 1", "KL(sampler || ref)", "truncation rate", "[min, max]"):
        assert text in out, text


def test_show_prints_groups_with_prompt_rewards_advantages_and_legend(project):
    out = ok("inspect", str(project), "--show", "3").stdout
    assert "colour = token_advantages" in out and "the 99th percentile of |value| over the 6 shown tokens" in out
    # the informative order: the two mixed-reward groups first, the zero-variance group 0 not reached
    assert "prompt 1 · answer 5 · 2 samples (2 distinct completions) · reward 0.750 ± 1.061 · 1/2 correct" in out
    assert "prompt 2 · answer 8 · 2 samples, 1 shown (2 distinct completions) · reward 0.750 ± 1.061 · 1/2 correct" in out
    assert "prompt 0" not in out and "2+3=" in out
    assert "#0  reward 1.500 (exact_answer 1.000)  adv +0.707  ✓ correct  2 tok stop" in out
    assert "5<eos>" in out
    assert re.search(r"advantage\.estimator\s+│ grpo", out) and re.search(r"--where\s+│ \(none: every row\)", out)
    zero = ok("inspect", str(project), "--prompt-id", "0").stdout
    assert ("prompt 0 · answer 2 · 2 samples (1 distinct completion) · reward 1.500 ± 0.000 · 2/2 correct"
            " · zero variance") in zero
    assert "filtered: zero_variance_group" in zero and "2<eos>" in zero
    nested = ok("inspect", str(project)).stdout  # sub-rows indented under their parent, one histogram bar a line
    assert re.search(r"│   reward_exact_answer\s+│", nested) and re.search(r"│     1/2 correct\s+│ █+ 2 group\(s\)", nested)


def test_prompt_id_option(project):
    data = as_json("inspect", str(project), "--prompt-id", "2", "--prompt-id", "1")
    assert sorted({r["prompt_id"] for r in data["rows"]}) == [1, 2]
    assert len(data["rows"]) == 4


@pytest.mark.parametrize("column,expected", [
    ("advantage", "token_advantages"), ("token_advantages", "token_advantages"),
    ("sampler_logprobs", "sampler_logprobs"), ("old_logprobs", "old_logprobs"), ("new_logprobs", "new_logprobs"),
    ("ref_logprobs", "ref_logprobs"), ("log_ratio", "log_ratio"), ("sampler_mismatch", "sampler_mismatch"),
    ("ref_log_ratio", "ref_log_ratio"), ("entropy", "entropy")])
def test_color_by_every_per_token_column(project, column, expected):
    data = as_json("inspect", str(project), "--show", "1", "--color-by", column)
    assert data["color_by"] == expected
    assert len(data["rows"][0]["per_token"][expected]) == 2
    assert f"colour = {expected}" in ok("inspect", str(project), "--show", "1", "--color-by", column).stdout


def test_where_sql_and_polars_and_sort_desc(project):
    sql = as_json("inspect", str(project), "--where", "reward < 1 AND NOT truncated", "--show", "5")
    assert [(r["prompt_id"], r["sample_idx"]) for r in sql["rows"]] == [(1, 1)]
    pol = as_json("inspect", str(project), "--where", 'pl.col("completion_text").str.contains("8")', "--show", "5")
    assert [(r["prompt_id"], r["sample_idx"]) for r in pol["rows"]] == [(2, 1), (2, 0)]  # best advantage first
    asc = as_json("inspect", str(project), "--sort", "seq_logprob", "--show", "6")
    desc = as_json("inspect", str(project), "--sort", "seq_logprob", "--desc", "--show", "6")
    lp = [r["seq_logprob"] for r in asc["rows"]]
    assert lp == sorted(lp) and [r["seq_logprob"] for r in desc["rows"]] == sorted(lp, reverse=True)
    assert asc["summary"]["rows_selected"] == 6


def test_eval_tokenizer_and_single_file(project, tmp_path):
    data = as_json("inspect", str(project), "--eval", "--show", "2")
    assert data["summary"]["view"] == "eval" and data["rows"][0]["prompt"] == "2+2="  # a wrong answer first
    tok = as_json("inspect", str(project / "a/rollouts.parquet"), "--show", "1", "--tokenizer", str(project / "model"))
    assert tok["tokenizer"].endswith("tokenizer.json") and tok["rows"][0]["tokens"] == ["2", "<eos>"]
    out = ok("inspect", str(project / "a/scores.parquet")).stdout
    assert "scores" in out and "ValueError: 1" in out


def test_html_report_is_self_contained_with_prompt_legend_and_a_span_per_token(project, tmp_path):
    page = tmp_path / "report.html"
    result = ok("inspect", str(project), "--where", "prompt_id = 1", "--show", "2", "--color-by", "sampler_logprobs",
                "--html", str(page))
    assert f"wrote {page}" in result.stderr
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<style>" in text
    assert not re.search(r"<(script|link|img)\b", text) and "http" not in text  # no external asset
    assert '<div class="prompt">2+3=</div>' in text
    assert 'class="legend"' in text and "colour = <b>sampler_logprobs</b>" in text
    assert "the 99th percentile of the lowest values over the 4 shown tokens" in text
    assert "reward 1.500" in text and "adv +0.707" in text
    spans = re.findall(r'<span class="tok" style="background:(#[0-9a-f]{6})" title="([^"]*)">([^<]*)</span>', text)
    assert [s[2] for s in spans] == ["5", "&lt;eos&gt;", "4", "&lt;eos&gt;"]  # one coloured span per token
    # every per-token value of the token on hover, exactly (float32 -0.5 - 0.5 = -1)
    assert spans[0][1].split("\n") == ["token 0: &#x27;5&#x27; (id 10)", "token_advantages = 0.7071",
                                       "sampler_logprobs = -0.5", "old_logprobs = -0.5", "new_logprobs = -0.45",
                                       "ref_logprobs = -1", "log_ratio = 0.05", "sampler_mismatch = 0",
                                       "ref_log_ratio = 0.5", "entropy = 1"]
    assert len({s[0] for s in spans}) > 1  # different log-probs, different colours
    # run metadata: the options used, the estimator, the policy version, the commit (none here)
    for label, value in (("--where", "prompt_id = 1"), ("--sort", "(none)"), ("advantage.estimator", "grpo"),
                         ("iteration (params.yaml)", "0"), ("policy version of the rows", "0"),
                         ("git commit", "- (not a git repository)")):
        assert f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>" in text, label
    # statistics keep the terminal's nesting; the histogram is one bar a line; honest counts
    assert '<tr class="lvl0"><th>rows</th><td>2 selected of 6 (by --where); 2 shown below</td></tr>' in text
    assert '<tr class="lvl1"><th>reward_exact_answer</th>' in text
    assert ('<tr class="lvl2"><th>1/2 correct</th><td><span class="bar" style="width:200px"></span>1 group(s)'
            '</td></tr>') in text
    assert "2 samples (2 distinct completions) · reward 0.750 ± 1.061 · 1/2 correct" in text
    # one per-token table per sample, the first open: a row per token, exact values right-aligned
    tables = re.findall(r'<details class="per-token"( open)?><summary>per-token values of #(\d) \((\d) tokens\)',
                        text)
    assert tables == [(" open", "0", "2"), ("", "1", "2")]
    assert ('<tr><td class="num">0</td><td><code>5</code></td><td class="num">10</td><td class="num">0.7071</td>'
            '<td class="num">-0.5</td>') in text
    # the artifacts' columns: one per line, not a run of tiny text
    assert "<tr><td>completion_token_ids</td><td>List(Int32)</td></tr>" in text
    assert "Statistics" in text and "Artifacts" in text


def test_eval_html_is_one_table_not_a_card_per_answer(project, tmp_path):
    page = tmp_path / "eval.html"
    ok("inspect", str(project), "--eval", "--show", "4", "--html", str(page))
    text = page.read_text()
    assert 'class="group"' not in text and text.count('<table class="answers">') == 1
    rows = re.findall(r'<tr data-prompt-id="(\d)"><td class="num">\d</td><td><code>([^<]*)</code></td><td>(\d+)</td>'
                      r'.*?<td>([✓✗-])</td>', text)
    # one sample per prompt: lowest reward first (the wrong answers), ties by prompt_id
    assert rows == [("1", "2+2=", "4", "✗"), ("2", "3+3=", "6", "✗"), ("0", "1+2=", "3", "✓"), ("3", "5+5=", "10", "✓")]
    assert "one sample per prompt: lowest reward first, so the wrong answers lead" in text


def test_json_output_is_machine_readable(project):
    data = as_json("inspect", str(project))
    assert set(data) == {"summary", "rows", "groups", "color_by", "tokenizer"}
    assert data["rows"] == [] and data["summary"]["reward"]["mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("args,message", [
    (["--where", "reward <"], "cannot parse 'reward <' as a SQL expression"),
    (["--where", "no_such_column > 1"], "unable to find column \"no_such_column\""),
    (["--where", "reward"], "filter predicate must be of type `Boolean`"),
    (["--where", 'pl.col("reward").map_elements(print) > 0'], "attribute 'map_elements' is not allowed"),
    (["--where", '__import__("os").system("true") | pl.col("x")'], "unknown name '__import__'"),
    (["--where", 'pl.col("x").__class__'], "attribute '__class__' is not allowed"),
    (["--where", "pl.col('reward') > 0 and pl.col('truncated')"], "use & and |"),
    (["--where", "pl.read_csv('x')"], "pl.read_csv is not allowed"),
    (["--where", "pl.col('reward') >"], "cannot parse"),
    (["--sort", "nope"], "--sort 'nope': no such column"),
    (["--sort", "token_advantages"], "cannot be sorted on"),
    (["--color-by", "reward"], "--color-by 'reward': not a per-token column"),
    (["--prompt-id", "42"], "no such prompt"),
    (["--tokenizer", "/nonexistent"], "no tokenizer.json there"),
    (["--html", "/nonexistent/dir/x.html"], "does not exist"),
    (["--rev", "iteration-0"], "--rev iteration-0: "),  # the hand-made project is no git repository
])
def test_bad_options_exit_2_with_a_clear_message(project, args, message):
    fails("inspect", str(project), *args, message=message)


def test_bad_paths_exit_2(project, tmp_path):
    fails("inspect", str(tmp_path / "missing"), message="no such file or directory")
    fails("inspect", str(tmp_path), message="no params.yaml")
    (tmp_path / "junk.parquet").write_text("junk")
    fails("inspect", str(tmp_path / "junk.parquet"), message="not a readable Parquet file")
    fails("inspect", str(project / "params.yaml"), message="not a readable Parquet file")


def test_show_must_not_be_negative(project):
    result = runner.invoke(app, ["inspect", str(project), "--show", "-1"])
    assert result.exit_code == 2 and "Invalid value" in result.output


# ---------------------------------------------------------------------------------------------- diff

@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    a = make_project(root / "a", eval_correct=[True, False, False, True], version=0, with_tokenizer=False)
    b = make_project(root / "b", eval_correct=[True, True, False, False], version=1, with_tokenizer=False)
    return a, b


def test_diff_of_two_directories(two_iterations, tmp_path):
    a, b = two_iterations
    data = json.loads(ok("diff", str(a), str(b), "--json").stdout)
    metrics = {m["metric"]: m for m in data["metrics"]}
    assert metrics["eval accuracy"]["a"] == 0.5 and metrics["eval accuracy"]["b"] == 0.5
    assert metrics["KL to reference (trainer, kl_ref)"]["delta"] == pytest.approx(0.01)
    assert metrics["seconds: train"]["delta"] == pytest.approx(1.0)
    flips = data["flips"]
    assert (flips["wrong_to_right"], flips["right_to_wrong"], flips["right_both"], flips["wrong_both"]) == (1, 1, 1, 1)
    assert flips["examples_wrong_to_right"] == [{"prompt_id": 1, "prompt": "2+2=", "answer": "4", "completion_a": "0",
                                                 "completion_b": "4", "reward_a": 0.0, "reward_b": 1.5,
                                                 "inspect_a": f"rlpipe inspect {a} --eval --prompt-id 1",
                                                 "inspect_b": f"rlpipe inspect {b} --eval --prompt-id 1"}]
    assert [e["prompt_id"] for e in flips["examples_right_to_wrong"]] == [3]
    out = ok("diff", str(a), str(b)).stdout
    assert "wrong -> right" in out and "2+2=" in out and "eval accuracy" in out
    none = json.loads(ok("diff", str(a), str(b), "--json", "--show", "0").stdout)
    assert none["flips"]["examples_wrong_to_right"] == [] and none["flips"]["wrong_to_right"] == 1
    page = tmp_path / "diff.html"
    ok("diff", str(a), str(b), "--html", str(page))
    text = page.read_text()
    assert "<h2>wrong → right: 1 of 1 shown</h2>" in text and "<code>2+2=</code>" in text
    assert not re.search(r"<(script|link|img)\b", text)


def test_diff_directions_params_and_inspect_commands(two_iterations, tmp_path):
    a, b = two_iterations
    data = json.loads(ok("diff", str(a), str(b), "--json").stdout)
    metrics = {m["metric"]: m for m in data["metrics"]}
    assert (metrics["eval accuracy"]["direction"], metrics["eval accuracy"]["change"]) == ("higher", "same")
    assert (metrics["seconds: train"]["direction"], metrics["seconds: train"]["change"]) == ("lower", "worse")
    assert metrics["KL to reference (trainer, kl_ref)"]["change"] is None  # no better side
    assert data["params"] == [{"key": "iteration", "a": 0, "b": 1}]
    [flip] = data["flips"]["examples_wrong_to_right"]
    assert flip["inspect_a"] == f"rlpipe inspect {a} --eval --prompt-id 1"
    assert flip["inspect_b"] == f"rlpipe inspect {b} --eval --prompt-id 1"
    # the command shows that prompt, right on B's side
    shown = as_json(*flip["inspect_b"].split()[1:])
    assert [(r["prompt_id"], r["correct"], r["completion_text"]) for r in shown["rows"]] == [(1, True, "4")]

    out = ok("diff", str(a), str(b)).stdout
    assert re.search(r"seconds: train\s+│\s+1\.0000 │\s+2\.0000 │\s+\+1\.0000 │ worse \(lower is better\)", out)
    assert re.search(r"iteration\s+│ 0 -> 1", out) and "wrong -> right: 1 of 1 shown" in out
    page = tmp_path / "diff.html"
    ok("diff", str(a), str(b), "--show", "0", "--html", str(page))
    text = page.read_text()
    assert ('<tr data-change="worse"><td>seconds: train</td><td class="num">1.0000</td><td class="num">2.0000</td>'
            '<td class="num worse">+1.0000</td><td class="worse">worse (lower is better)</td></tr>') in text
    assert ('<tr data-change="same"><td>eval accuracy</td><td class="num">0.5000</td><td class="num">0.5000</td>'
            '<td class="num">0.0000</td>') in text
    assert "<tr><td>iteration</td><td>0</td><td>1</td></tr>" in text
    assert "<h2>wrong → right: 0 of 1 shown</h2>" in text and "<h2>right → wrong: 0 of 1 shown</h2>" in text


def test_diff_bad_sides_exit_2(two_iterations, tmp_path):
    a, _ = two_iterations
    fails("diff", str(a), "iteration-9", "--repo", str(tmp_path), message="not a git repository")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    fails("diff", str(a), "iteration-9", "--repo", str(tmp_path),
          message="neither a directory nor a git revision")
    fails("diff", str(a), "3", "--repo", str(tmp_path), message="no iteration-* tags yet")
    fails("diff", str(a), str(a), "--html", str(tmp_path / "no/dir.html"), message="does not exist")


def test_diff_lists_tool_use_and_turns_when_a_side_is_multi_turn(two_iterations, tmp_path):
    from tests.inspect_project import make_multi_turn_project

    a, _ = two_iterations
    multi = make_multi_turn_project(tmp_path / "mt")
    metrics = {m["metric"]: m for m in as_json("diff", str(a), str(multi))["metrics"]}
    # tests/inspect_project.py: evaluate 1.0 / 2.0, generate 0.5 / 1.5 on the multi-turn side only
    assert {k: (m["a"], m["b"], m["change"]) for k, m in metrics.items() if "tool" in k or "turns" in k} == {
        "eval tool-use rate (rollouts with a tool call)": (None, 1.0, None),
        "eval turns per rollout (mean)": (None, 2.0, None),
        "train tool-use rate (rollouts with a tool call)": (None, 0.5, None),
        "train turns per rollout (mean)": (None, 1.5, None)}
    single = [m["metric"] for m in as_json("diff", str(a), str(a))["metrics"]]
    assert not [m for m in single if "tool" in m or "turns" in m]  # two single-turn sides: no such rows
    page = tmp_path / "diff.html"
    ok("diff", str(a), str(multi), "--html", str(page))
    assert ('<td>eval tool-use rate (rollouts with a tool call)</td><td class="num">-</td>'
            '<td class="num">1.0000</td>') in page.read_text()


def test_diff_reads_eval_rollouts_written_before_they_kept_turns(two_iterations, tmp_path):
    """eval_rollouts gained turn_starts and tool_calls; diff reads only the columns it compares, so an older
    run's file (without them) still diffs, while inspect names the missing columns."""
    import shutil

    import pyarrow.parquet as pq

    a, b = two_iterations
    old = tmp_path / "old"
    shutil.copytree(a, old)
    path = old / "a/eval_rollouts.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["turn_starts", "tool_calls"]), path)
    data = as_json("diff", str(old), str(b))
    assert (data["flips"]["wrong_to_right"], data["flips"]["right_to_wrong"]) == (1, 1)
    fails("inspect", str(old), "--eval", message="missing column(s) ['turn_starts', 'tool_calls']")


def test_terminal_puts_each_turn_and_each_reply_on_lines_of_their_own(tmp_path):
    from tests.inspect_project import make_multi_turn_project

    out = ok("inspect", str(make_multi_turn_project(tmp_path / "mt")), "--show", "1").stdout
    lines = [line.rstrip() for line in out.splitlines()]
    i = lines.index("  c(2+3)")
    assert lines[i:i + 5] == [
        "  c(2+3)",
        ('    ▸ turn 1 → tool call calculator({"expr": "2+3"}) → ok: 5 · the environment\'s reply follows (not the '
         "policy's tokens)"),
        "  =5;", "    turn 2 (the policy's tokens)", "  5."]
