"""rlpipe.reports.inspect on a hand-made iteration (tests/inspect_project.py): every number computed by hand."""
import math

import polars as pl
import pytest

from rlpipe.data.decode import fallback_pieces
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import EVAL_ROLLOUTS, PROMPTS, ROLLOUTS, SCORES
from rlpipe.errors import ArtifactError
from rlpipe.reports.inspect import inspect_data, joined_frame, load
from tests.inspect_project import make_project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("inspect") / "proj")


def test_joins_every_artifact_on_the_keys(project):
    frame, warnings = joined_frame(load(project))
    assert warnings == []
    assert frame.height == 6
    assert frame.select("prompt_id", "sample_idx").rows() == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    for col in ("reward", "ref_logprobs", "token_advantages", "old_logprobs", "prompt", "answer", "log_ratio",
                "sampler_mismatch", "ref_log_ratio", "seq_kl_ref", "seq_mismatch_max", "seq_entropy", "seq_logprob"):
        assert col in frame.columns, col
    assert frame["prompt"].to_list() == ["1+1="] * 2 + ["2+3="] * 2 + ["4+4="] * 2
    # row (1, 1): old = sampler - 0.1 on its first token -> the largest |old - sampler| is 0.1
    assert frame["seq_mismatch_max"].to_list()[3] == pytest.approx(0.1, abs=1e-6)
    assert frame["seq_kl_ref"].to_list() == pytest.approx([0.5] * 6, abs=1e-6)  # ref = sampler - 0.5
    assert frame["seq_logprob"].to_list()[0] == pytest.approx(-0.1 + -0.2, abs=1e-6)


def test_summary_statistics_by_hand(project):
    s = inspect_data(project)["summary"]
    assert (s["rows_selected"], s["rows_total"]) == (6, 6)
    assert [a["role"] for a in s["artifacts"]] == ["rollouts", "scores", "ref_logprobs", "advantages",
                                                     "token_stats", "prompts"]
    assert s["artifacts"][0]["columns"]["completion_token_ids"] == "List(Int32)"
    # rewards 1.5, 1.5, 1.5, 0, 0, 1.5: mean 1.0; deviations +-0.5 (x4) and -1 (x2): sample var 3/5
    assert s["reward"]["mean"] == pytest.approx(1.0)
    assert s["reward"]["std"] == pytest.approx(math.sqrt(0.6))
    assert s["components"]["exact_answer"]["mean"] == pytest.approx(4 / 5)  # the errored row is null
    assert s["accuracy"] == pytest.approx(4 / 5)  # 4 of the 5 judged rows
    assert s["groups"]["count"] == 3
    assert s["groups"]["zero_variance_share"] == pytest.approx(1 / 3)  # group 0: 1.5, 1.5
    assert s["groups"]["correct_per_group"] == [{"correct": 1, "of": 2, "groups": 2},
                                                {"correct": 2, "of": 2, "groups": 1}]
    assert s["filtered"] == {"zero_variance_group": 2}
    assert s["truncation_rate"] == pytest.approx(1 / 6)
    assert s["length"]["histogram"] == [{"from": 2, "to": 2, "count": 6}]
    assert s["scorer_errors"] == {"ValueError": 1}
    assert s["logprob_mismatch"]["mean_abs"] == pytest.approx(0.1 / 12, abs=1e-6)
    assert s["logprob_mismatch"]["tokens"] == 12
    # r = log pi_sampler - log pi_ref = 0.5 on every token: k1 = 0.5, k3 = exp(-r) + r - 1
    assert s["kl_ref"]["k1"] == pytest.approx(0.5, abs=1e-6)
    assert s["kl_ref"]["k3"] == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-6)
    assert s["entropy_mean"] == pytest.approx(1.0)
    assert s["train_log_ratio_mean"] == pytest.approx(0.05, abs=1e-6)


def test_where_sort_and_rows(project):
    data = inspect_data(project, where="reward > 0 AND NOT truncated", sort="advantage", descending=True, show=2,
                        color_by="advantage")
    assert data["summary"]["rows_selected"] == 4
    assert [(r["prompt_id"], r["sample_idx"]) for r in data["rows"]] == [(1, 0), (2, 1)]
    row = data["rows"][0]
    assert row["prompt"] == "2+3=" and row["answer"] == "5"
    assert row["tokens"] == ["5", "<eos>"]  # decoded with the model directory's tokenizer.json
    assert data["color_by"] == "token_advantages"
    assert row["per_token"]["token_advantages"] == pytest.approx([0.7071, 0.7071], abs=1e-4)
    assert data["groups"]["1"]["size"] == 2 and data["groups"]["1"]["num_correct"] == 1


def test_prompt_id_shows_the_whole_group(project):
    data = inspect_data(project, prompt_ids=[2])
    assert [(r["sample_idx"], r["tokens"]) for r in data["rows"]] == [(0, ["8", "8"]), (1, ["8", "<eos>"])]
    assert data["rows"][0]["score_error"] == "ValueError: boom"
    with pytest.raises(ArtifactError, match=r"^--prompt-id 99, 98: no such prompt among the selected rows \(3 "
                                            r"prompts, e.g. 0, 1, 2: an iteration samples"):
        inspect_data(project, prompt_ids=[99, 98])


def test_eval_view_reads_the_held_out_rollouts(project):
    data = inspect_data(project, eval_view=True, show=4)
    s = data["summary"]
    assert [a["role"] for a in s["artifacts"]] == ["eval_rollouts", "prompts"]
    assert s["accuracy"] == pytest.approx(0.5)  # True, False, False, True
    # one greedy answer per prompt: lowest reward first, so the two wrong ones (prompts 1, 2) lead
    assert [(r["prompt_id"], r["prompt"], r["correct"]) for r in data["rows"]] == [
        (1, "2+2=", False), (2, "3+3=", False), (0, "1+2=", True), (3, "5+5=", True)]
    assert data["summary"]["selection"]["order"] == "informative_single"


def test_single_file_and_fallback_without_tokenizer(tmp_path):
    root = make_project(tmp_path / "p", with_tokenizer=False)
    data = inspect_data(root / "a/rollouts.parquet", show=6)
    assert data["summary"]["view"] == "rollouts" and data["tokenizer"] is None
    rows = {(r["prompt_id"], r["sample_idx"]): r for r in data["rows"]}
    assert rows[(2, 0)]["tokens"] == ["8", "8"]  # "88", two tokens: one character each
    assert rows[(0, 0)]["tokens"] == ["2", "⟨2⟩"]  # EOS is not in the text: shown as its id
    assert (0, 1) not in rows and rows[(0, 0)]["same_completion"] == [1]  # the same tokens, shown once
    assert fallback_pieces("abc", [5, 6]) == ["⟨5⟩", "⟨6⟩"]


def test_stale_artifact_is_reported_not_joined_silently(tmp_path):
    root = make_project(tmp_path / "p", with_tokenizer=False)
    scores = read_artifact(root / "a/scores.parquet", SCORES).frame
    write_artifact(scores, root / "a/scores.parquet", SCORES, metadata={"policy_version": 7})
    _, warnings = joined_frame(load(root))
    assert any("policy version 7" in w for w in warnings)
    write_artifact(scores.filter(pl.col("prompt_id") != 2), root / "a/scores.parquet", SCORES,
                   metadata={"policy_version": 0})
    frame, warnings = joined_frame(load(root))
    assert any(w.startswith("scores not joined: keys do not match") for w in warnings)
    assert "reward" not in frame.columns


def test_missing_and_bad_inputs(tmp_path):
    with pytest.raises(ArtifactError, match="no such file or directory"):
        load(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="no params.yaml"):
        load(tmp_path)
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ArtifactError, match="not a readable Parquet file"):
        load(tmp_path / "x.parquet")
    root = make_project(tmp_path / "p", with_tokenizer=False)
    (root / "a/rollouts.parquet").unlink()
    with pytest.raises(ArtifactError, match="rollouts.parquet: not found; run `dvc repro`"):
        load(root)


# ---------------------------------------------------------------------------------------------- rows shown

def keys(data):
    return [(r["prompt_id"], r["sample_idx"]) for r in data["rows"]]


def test_show_picks_informative_distinct_rows_first(project):
    """Groups 1 and 2 have mixed rewards (advantages +-0.7071), group 0 two identical completions (zero variance).

    Round 1 takes the best and the worst of each group in rank order (mixed first; tie on |advantage|
    0.7071 -> prompt_id): (1,0) +0.71, (1,1) -0.71, (2,1) +0.71, (2,0) -0.71, then group 0's one
    distinct completion (0,0), its duplicate (0,1) folded into it: 5 rows for --show 6.
    """
    data = inspect_data(project, show=6)
    assert keys(data) == [(1, 0), (1, 1), (2, 1), (2, 0), (0, 0)]
    assert [r["same_completion"] for r in data["rows"]] == [[], [], [], [], [1]]
    sel = data["summary"]["selection"]
    assert (sel["order"], sel["rows_shown"], sel["show"]) == ("informative", 5, 6)
    assert data["groups"]["0"] == {"prompt_id": 0, "size": 2, "reward_mean": 1.5, "reward_std": 0.0,
                                   "zero_variance": True, "num_correct": 2, "distinct": 1, "shown": 1}
    assert keys(inspect_data(project, show=2)) == [(1, 0), (1, 1)]  # the best and the worst of one group
    assert inspect_data(project, show=3)["groups"]["2"]["shown"] == 1


def test_sort_and_prompt_id_keep_their_own_order(project):
    data = inspect_data(project, sort="sample_idx", show=4)  # a sort asked for: its order, no folding
    assert keys(data) == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert data["summary"]["selection"]["order"] == "sorted"
    assert all(r["same_completion"] == [] for r in data["rows"])
    data = inspect_data(project, prompt_ids=[0])
    assert keys(data) == [(0, 0), (0, 1)] and data["summary"]["selection"]["order"] == "prompt"


def test_where_and_sort_are_recorded(project):
    sel = inspect_data(project, where="reward > 0", sort="reward", descending=True)["summary"]["selection"]
    assert (sel["where"], sel["sort"], sel["descending"], sel["order"], sel["rows_shown"]) == (
        "reward > 0", "reward", True, None, 0)


def test_token_level_estimator_says_why_advantage_is_empty(tmp_path):
    """GAE/REINFORCE++ write no sequence advantage: the summary says so and rows show their token mean."""
    import yaml

    from rlpipe.data.schema import ADVANTAGES

    root = make_project(tmp_path / "p", with_tokenizer=False)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["advantage"]["estimator"] = "gae"
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    adv = read_artifact(root / "a/advantages.parquet", ADVANTAGES)
    tokens = [[0.5, -0.1], [0.2, 0.2], [1.0, 0.0], [-1.0, -0.5], [0.0, 0.0], [0.3, 0.1]]
    write_artifact(adv.frame.with_columns(pl.lit(None, dtype=pl.Float32).alias("advantage"),
                                          pl.Series("token_advantages", tokens, dtype=pl.List(pl.Float32))),
                   root / "a/advantages.parquet", ADVANTAGES, metadata=adv.metadata)
    data = inspect_data(root, prompt_ids=[1])
    s = data["summary"]
    assert s["advantage"]["count"] == 0
    assert "per token only: advantage.estimator gae gives each token its own advantage" in s["advantage_note"]
    assert s["token_advantage"]["mean"] == pytest.approx(sum(map(sum, tokens)) / 12, abs=1e-6)  # 0.7 / 12
    assert [r["token_advantage_mean"] for r in data["rows"]] == pytest.approx([0.5, -0.75])
    assert s["run"]["params"]["advantage.estimator"] == "gae"


def test_run_metadata_names_commit_tags_and_uncommitted_changes(tmp_path):
    import subprocess

    root = make_project(tmp_path / "p", with_tokenizer=False)
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.email=t@x", "-c", "user.name=t", "commit", "-qm", "it")
    git("tag", "iteration-0")
    run = inspect_data(root)["summary"]["run"]
    head = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    assert run["git"] == {"commit": head, "tags": ["iteration-0"], "uncommitted_changes": False}
    assert run["policy_version"] == 0 and "sampling" not in run  # the hand-made footer has no sampling record
    assert run["params"] == {"iteration": 0, "advantage.estimator": "grpo", "policy.path": "model"}
    (root / "params.yaml").write_text((root / "params.yaml").read_text() + "seed: 7\n")
    assert inspect_data(root)["summary"]["run"]["git"]["uncommitted_changes"] is True


def test_rev_reads_the_artifacts_committed_at_a_revision(tmp_path):
    """`--rev iteration-0` reads through DVC what was committed then, not the workspace's files."""
    import subprocess
    import sys

    from tests.inspect_project import PATHS, eval_frame

    root = make_project(tmp_path / "p", eval_correct=[True, False, False, True], with_tokenizer=False)
    run = lambda *a: subprocess.run(a, cwd=root, check=True, capture_output=True, text=True)  # noqa: E731
    run("git", "init", "-q")
    run(sys.executable, "-m", "dvc", "init", "-q")
    run("git", "add", "-A")
    run("git", "-c", "user.email=t@x", "-c", "user.name=t", "commit", "-qm", "iteration 0")
    run("git", "tag", "iteration-0")
    write_artifact(eval_frame([False] * 4, 1), root / PATHS["eval_rollouts"], EVAL_ROLLOUTS,
                   metadata={"policy_version": 1})
    assert inspect_data(root, eval_view=True)["summary"]["accuracy"] == 0.0  # the workspace
    old = inspect_data(root, eval_view=True, rev="0", prompt_ids=[3])  # "0" = iteration-0
    assert old["summary"]["accuracy"] == pytest.approx(0.5)
    assert old["summary"]["source"].endswith("@iteration-0") and old["summary"]["run"]["revision"] == "iteration-0"
    assert [a["path"] for a in old["summary"]["artifacts"]] == [f"iteration-0:{PATHS['eval_rollouts']}",
                                                               f"iteration-0:{PATHS['eval_prompts']}"]
    assert old["rows"][0]["completion_text"] == "10" and old["rows"][0]["prompt"] == "5+5="
    with pytest.raises(ArtifactError, match="'iteration-9': not a git revision of .*; iteration tags: iteration-0"):
        inspect_data(root, rev="iteration-9")
    with pytest.raises(ArtifactError, match="give the project directory, not a file"):
        inspect_data(root / PATHS["rollouts"], rev="iteration-0")


def test_length_histogram_keeps_empty_bins_and_k3_is_never_negative():
    import math

    import polars as pl

    from rlpipe.reports.inspect import _length_histogram  # noqa: PLC2701 - the one place that bins
    from rlpipe.reports.token_stats import k3_mean

    bins = _length_histogram(pl.Series("completion_length", [1, 1, 2, 9, 10]), max_bins=5)
    assert bins == [{"from": 1, "to": 2, "count": 3}, {"from": 3, "to": 4, "count": 0},
                    {"from": 5, "to": 6, "count": 0}, {"from": 7, "to": 8, "count": 0},
                    {"from": 9, "to": 10, "count": 2}]
    r = pl.Series([1e-9, -2e-9, 3e-10, 7e-9])  # exp(-r) + r - 1 rounds to tiny negatives here
    assert ((-r).exp() + r - 1).mean() < 0.0  # the formula as written
    assert k3_mean(r) == 0.0
    assert math.isclose(k3_mean(pl.Series([0.5])), math.exp(-0.5) + 0.5 - 1)


def test_least_likely_takes_the_lowest_sampled_log_probs_under_the_bar():
    from rlpipe.reports.inspect import least_likely

    # -1.0 is not below -1; None (an observation token) is never a candidate; ties go to the earlier token
    assert least_likely([-0.1, -7.34, None, -1.0, -2.0, -7.34, -3.0]) == [
        {"position": 1, "logprob": -7.34}, {"position": 5, "logprob": -7.34}, {"position": 6, "logprob": -3.0}]
    assert least_likely([-0.01, -0.5]) == [] and least_likely(None) == []


def test_reward_weights_come_from_params_and_a_changed_weight_is_reported(tmp_path):
    from rlpipe.reports.render import row_header

    data = inspect_data(make_project(tmp_path / "a", reward_weight=1.5), show=6)
    assert data["summary"]["reward_weights"] == {"exact_answer": 1.5}
    assert not any("weighted sum" in w for w in data["summary"]["warnings"])
    rec = next(r for r in data["rows"] if (r["prompt_id"], r["sample_idx"]) == (1, 1))
    assert row_header(rec).startswith("#1  reward 0.000 = 1.5 × exact_answer 0.000  adv -0.707")
    # rewards were 1.5 x exact_answer; params now say 1.0: the 4 rows with exact_answer 1.0 no longer add up
    changed = inspect_data(make_project(tmp_path / "b", reward_weight=1.0))["summary"]["warnings"]
    assert any(w.startswith("4 row(s) have a reward that is not the weighted sum") for w in changed)
    assert "reward_weights" not in inspect_data(make_project(tmp_path / "c"))["summary"]  # params say nothing


def test_look_here_ranks_every_selected_row(project):
    lists = inspect_data(project)["summary"]["look_here"]
    assert set(lists) == {"high_reward_wrong", "longest", "log_ratio", "sampler_mismatch", "truncated"}
    pick = lambda key: [(r["prompt_id"], r["sample_idx"], r["value"]) for r in lists[key]["rows"]]  # noqa: E731
    assert pick("high_reward_wrong") == [(1, 1, 0.0)] and lists["high_reward_wrong"]["total"] == 1
    assert pick("truncated") == [(2, 0, 0.0)]
    # old = sampler except row (1, 1)'s first token, 0.1 lower: its |mismatch| leads, the others are 0
    assert pick("sampler_mismatch")[0][:2] == (1, 1) and pick("sampler_mismatch")[0][2] == pytest.approx(0.1)
    assert [v for _, _, v in pick("log_ratio")] == pytest.approx([0.05] * 5, abs=1e-6)  # new = old + 0.05
    assert lists["longest"]["rows"][0]["command"] == f"rlpipe inspect {project} --prompt-id 0"
    assert lists["truncated"]["rows"][0]["excerpt"] == "88"


def test_look_here_leaves_out_values_that_are_not_numbers():
    from rlpipe.reports.look_here import look_here

    frame = pl.DataFrame({"prompt_id": [0, 1, 2], "sample_idx": [0, 0, 0],
                          "seq_log_ratio_max": [float("nan"), 0.5, None], "reward": [1.0, 2.0, 3.0]})
    (row,) = look_here(frame, command="rlpipe inspect p")["log_ratio"]["rows"]
    assert (row["prompt_id"], row["value"], row["command"]) == (1, 0.5, "rlpipe inspect p --prompt-id 1")


def test_the_prompt_files_columns_filter_sort_and_show_through_the_rollout_view(tmp_path):
    """A user's own prompt columns (typed in the prompt table) reach every joined row: --where, --sort, the rows."""
    root = make_project(tmp_path / "proj", prompt_columns=(
        {"difficulty": ["easy", "hard", "hard"], "level": [1, 3, 2]},
        {"difficulty": ["easy", "easy", "hard", "hard"], "level": [1, 1, 2, 4]}))
    frame, _ = joined_frame(load(root))
    assert frame.schema["difficulty"] == pl.String and frame.schema["level"] == pl.Int64  # typed as the file had them
    assert "metadata" not in frame.columns  # the JSON the rewards read stays in the prompt table
    hard = inspect_data(root, where="difficulty = 'hard'", sort="level", show=4)
    assert hard["summary"]["rows_selected"] == 4  # prompts 1 and 2, two samples each
    assert [(r["prompt_id"], r["prompt_columns"]) for r in hard["rows"]] == [
        (2, {"difficulty": "hard", "level": 2}), (2, {"difficulty": "hard", "level": 2}),
        (1, {"difficulty": "hard", "level": 3}), (1, {"difficulty": "hard", "level": 3})]
    assert hard["summary"]["reward"]["mean"] == pytest.approx((1.5 + 0.0 + 0.0 + 1.5) / 4)  # statistics of those rows
    single = inspect_data(root, eval_view=True, where="level > 1", show=4)  # the eval view joins its own prompts
    assert [r["prompt_id"] for r in single["rows"]] == [2, 3]


def test_the_view_is_one_sql_statement_polars_and_duckdb_run_alike(tmp_path):
    from rlpipe.data.view import scan_view, view_sql, with_prompt_columns

    root = make_project(tmp_path / "proj", prompt_columns=({"difficulty": ["easy", "hard", "hard"]}, {}))
    rollouts, prompts = root / "a/rollouts.parquet", root / "a/train_prompts.parquet"
    viewed = scan_view(rollouts, prompts).collect().sort("prompt_id", "sample_idx")
    rows = read_artifact(rollouts, ROLLOUTS).frame
    assert viewed.columns == [*rows.columns, "prompt", "answer", "difficulty"]
    assert viewed.equals(with_prompt_columns(rows, read_artifact(prompts, PROMPTS).frame))
    assert viewed["difficulty"].to_list() == ["easy", "easy", "hard", "hard", "hard", "hard"]
    duckdb = pytest.importorskip("duckdb")
    sql = view_sql(f"'{rollouts}'", f"'{prompts}'") + " ORDER BY prompt_id, sample_idx"
    assert duckdb.sql(sql).pl().select("prompt_id", "sample_idx", "prompt", "difficulty").rows() == viewed.select(
        "prompt_id", "sample_idx", "prompt", "difficulty").rows()
