"""`rlpipe inspect` and `rlpipe diff` through typer's CliRunner: every option, every kind of bad input."""
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
    result = runner.invoke(app, list(args))
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
    assert "colour = token_advantages" in out
    assert "prompt 0 · answer 2 · 2 sample(s) · reward 1.500 ± 0.000 · 2/2 correct" in out
    assert "prompt 1 · answer 5" in out and "1+1=" in out
    assert "#1  reward 1.500 (exact_answer 1.000)  adv +0.000" in out
    assert "filtered: zero_variance_group" in out
    assert "2<eos>" in out


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
    assert [(r["prompt_id"], r["sample_idx"]) for r in pol["rows"]] == [(2, 0), (2, 1)]
    asc = as_json("inspect", str(project), "--sort", "seq_logprob", "--show", "6")
    desc = as_json("inspect", str(project), "--sort", "seq_logprob", "--desc", "--show", "6")
    lp = [r["seq_logprob"] for r in asc["rows"]]
    assert lp == sorted(lp) and [r["seq_logprob"] for r in desc["rows"]] == sorted(lp, reverse=True)
    assert asc["summary"]["rows_selected"] == 6


def test_eval_tokenizer_and_single_file(project, tmp_path):
    data = as_json("inspect", str(project), "--eval", "--show", "2")
    assert data["summary"]["view"] == "eval" and data["rows"][0]["prompt"] == "1+2="
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
    assert "reward 1.500" in text and "adv +0.707" in text
    spans = re.findall(r'<span class="tok" style="background:(#[0-9a-f]{6})" title="([^"]*)">([^<]*)</span>', text)
    assert [s[2] for s in spans] == ["5", "&lt;eos&gt;", "4", "&lt;eos&gt;"]  # one coloured span per token
    assert spans[0][1] == "id 10, sampler_logprobs = -0.5000"
    assert len({s[0] for s in spans}) > 1  # different log-probs, different colours
    assert "Statistics" in text and "Artifacts" in text


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
                                                 "completion_b": "4", "reward_a": 0.0, "reward_b": 1.5}]
    assert [e["prompt_id"] for e in flips["examples_right_to_wrong"]] == [3]
    out = ok("diff", str(a), str(b)).stdout
    assert "wrong -> right" in out and "2+2=" in out and "eval accuracy" in out
    none = json.loads(ok("diff", str(a), str(b), "--json", "--show", "0").stdout)
    assert none["flips"]["examples_wrong_to_right"] == [] and none["flips"]["wrong_to_right"] == 1
    page = tmp_path / "diff.html"
    ok("diff", str(a), str(b), "--html", str(page))
    assert "wrong → right" in page.read_text() and "<td>2+2=</td>" in page.read_text()


def test_diff_bad_sides_exit_2(two_iterations, tmp_path):
    a, _ = two_iterations
    fails("diff", str(a), "iteration-9", "--repo", str(tmp_path), message="not a git repository")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    fails("diff", str(a), "iteration-9", "--repo", str(tmp_path),
          message="neither a directory nor a git revision")
    fails("diff", str(a), "3", "--repo", str(tmp_path), message="no iteration-* tags yet")
    fails("diff", str(a), str(a), "--html", str(tmp_path / "no/dir.html"), message="does not exist")
