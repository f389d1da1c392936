"""`rlpipe view`'s query layer (rlpipe.reports.browse) on the hand-made iteration: every expected row by hand.

Rows (tests/inspect_project.py; the workspace of tests/reports/view_project.py):

    key     text  reward  advantage  truncated  seq_logprob (sum of sampler log-probs)
    (0, 0)  "2"   1.5      0.0       no         -0.1 - 0.2 = -0.3    filtered (zero-variance group)
    (0, 1)  "2"   1.5      0.0       no         -0.3 - 0.2 = -0.5    filtered
    (1, 0)  "5"   1.5      0.7071    no         -0.5 - 0.1 = -0.6
    (1, 1)  "4"   0.5     -0.7071    no         -1.0 - 0.4 = -1.4
    (2, 0)  "88"  0.0     -0.7071    yes        -0.7 - 2.0 = -2.7
    (2, 1)  "8"   1.5      0.7071    no         -0.2 - 0.3 = -0.5
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.data.exprs import ExpressionError
from rlpipe.errors import ArtifactError
from rlpipe.reports import browse
from rlpipe.reports.inspect import inspect_data
from tests.inspect_project import PATHS
from tests.reports.view_project import PROMPT_1_SAMPLE_1


@pytest.fixture(scope="module")
def root(tagged_project):
    return tagged_project


@pytest.fixture(scope="module")
def it(root):
    return browse.open_iteration(root)


def keys(page: dict) -> list[tuple[int, int]]:
    return [(r["prompt_id"], r["sample_idx"]) for r in page["rows"]]


def test_pages_in_key_order_with_counts(it):
    second = browse.page(it, browse.Query(offset=2, limit=2))
    assert keys(second) == [(1, 0), (1, 1)] and (second["matched"], second["total"]) == (6, 6)
    assert [r["completion_text"] for r in second["rows"]] == ["5", "4"]
    assert [r["reward"] for r in second["rows"]] == [1.5, 0.5]
    assert keys(browse.page(it, browse.Query(offset=5, limit=50))) == [(2, 1)]
    assert browse.page(it, browse.Query(offset=6))["rows"] == []
    with pytest.raises(ExpressionError, match="limit must be 1..500"):
        browse.page(it, browse.Query(limit=0))


def test_table_shows_stored_scalar_columns_never_token_lists(it):
    columns = browse.table_columns(it)
    assert list(columns)[:11] == list(browse.LEADING)  # the leading ones, in order
    assert {"reward_exact_answer", "group_reward_std", "filtered_reason", "reference_version"} <= set(columns)
    assert not {"completion_token_ids", "sampler_logprobs", "token_advantages", "seq_logprob"} & set(columns)
    row = browse.page(it, browse.Query(offset=4, limit=1))["rows"][0]
    assert (row["completion_text"], row["completion_text_chars"], row["prompt"], row["answer"]) == ("88", 2, "4+4=",
                                                                                                   "8")


def test_sort_ascending_and_descending_keeps_key_order_on_ties(it):
    up = browse.page(it, browse.Query(sort="reward"))
    assert keys(up) == [(2, 0), (1, 1), (0, 0), (0, 1), (1, 0), (2, 1)]
    down = browse.page(it, browse.Query(sort="reward", descending=True, limit=5))
    assert keys(down) == [(0, 0), (0, 1), (1, 0), (2, 1), (1, 1)] and down["matched"] == 6


@pytest.mark.parametrize(("where", "expected"), [
    ("reward < 1 AND NOT truncated", [(1, 1)]),  # SQL, as inspect takes it
    ('pl.col("completion_text").str.len_chars() == 2', [(2, 0)]),  # a polars expression
    ("seq_logprob < -1", [(1, 1), (2, 0)]),  # a derived column (reads the token lists)
    ("filtered_reason IS NOT NULL", [(0, 0), (0, 1)]),  # a column of another artifact, joined
])
def test_where_is_inspects_where(it, where, expected):
    page = browse.page(it, browse.Query(where=where))
    assert keys(page) == expected and page["matched"] == len(expected)


def test_where_then_sort_then_page(it):
    page = browse.page(it, browse.Query(where="reward > 0", sort="advantage", descending=True, offset=1, limit=2))
    # reward > 0: (0,0) 0.0, (0,1) 0.0, (1,0) 0.7071, (1,1) -0.7071, (2,1) 0.7071 -> by advantage, ties in key order
    assert keys(page) == [(2, 1), (0, 0)] and page["matched"] == 5


@pytest.mark.parametrize(("query", "message"), [
    (browse.Query(where="rewrd < 1"), 'unable to find column "rewrd"; columns: '),
    (browse.Query(where="reward <"), "cannot parse 'reward <' as a SQL expression"),
    (browse.Query(where="completion_text > 3"), "--where 'completion_text > 3': ComputeError: cannot compare string"),
    (browse.Query(where='pl.col("reward").map_elements(abs) > 0'), "attribute 'map_elements' is not allowed"),
    (browse.Query(sort="token_advantages"), "a per-token list column cannot be sorted on"),
    (browse.Query(sort="nope"), "--sort 'nope': no such column"),
])
def test_bad_queries_name_the_problem(it, query, message):
    with pytest.raises(ExpressionError) as caught:
        browse.page(it, query)
    assert message in str(caught.value)


def test_a_missing_column_reads_as_in_rlpipe_inspect(root, it):
    """The same check, so the same words and the same column list as `rlpipe inspect --where`."""
    with pytest.raises(ExpressionError) as ours:
        browse.page(it, browse.Query(where="rewrd < 1"))
    with pytest.raises(ExpressionError) as inspects:
        inspect_data(root, where="rewrd < 1")
    assert str(ours.value) == str(inspects.value)


def test_search_is_literal_and_ignores_case(it):
    assert keys(browse.page(it, browse.Query(search="8"))) == [(2, 0), (2, 1)]
    assert keys(browse.page(it, browse.Query(search="8", where="NOT truncated"))) == [(2, 1)]
    assert browse.page(it, browse.Query(search="+"))["matched"] == 0  # a regex character, searched as text


def test_search_ignores_case_and_shows_the_text_around_the_hit(tmp_path):
    from tests.inspect_project import make_project

    root = make_project(tmp_path / "p", with_tokenizer=False)
    file = root / PATHS["rollouts"]
    table = pq.read_table(file)
    long = "x" * 300 + "Needle" + "y" * 300
    texts = pa.array(["Two", "two", "five", "FOUR", long, "eight"], type=table.schema.field("completion_text").type)
    pq.write_table(table.set_column(table.schema.get_field_index("completion_text"), "completion_text", texts), file)
    it = browse.open_iteration(root)
    assert keys(browse.page(it, browse.Query(search="tWo"))) == [(0, 0), (0, 1)]
    assert keys(browse.page(it, browse.Query(search="four"))) == [(1, 1)]
    # the preview starts 80 characters before the hit (at 300), so the hit is in it
    hit = browse.page(it, browse.Query(search="needle"))["rows"]
    assert [(r["completion_text_from"], r["completion_text_chars"]) for r in hit] == [(220, 606)]
    assert hit[0]["completion_text"] == long[220:460] and "Needle" in hit[0]["completion_text"]
    first = browse.page(it, browse.Query(search="x"))["rows"][0]  # a hit at 0: from the start
    assert first["completion_text_from"] == 0 and first["completion_text"] == long[:240]


def test_a_column_only_this_table_has_is_shown_and_filtered(tmp_path):
    """A user's metadata column (any column the rollouts carry) needs no list of names in the viewer."""
    from tests.inspect_project import make_project

    root = make_project(tmp_path / "p", with_tokenizer=False)
    file = root / PATHS["rollouts"]
    table = pq.read_table(file)
    difficulty = pa.array(["easy", "easy", "hard", "hard", "hard", "hard"], type=pa.large_string())
    pq.write_table(table.append_column("meta_difficulty", difficulty), file)
    it = browse.open_iteration(root)
    assert browse.table_columns(it)["meta_difficulty"] == "String"
    page = browse.page(it, browse.Query(where="meta_difficulty = 'hard' AND reward > 1", sort="meta_difficulty"))
    assert keys(page) == [(1, 0), (2, 1)] and page["rows"][0]["meta_difficulty"] == "hard"


def test_one_sample_with_its_token_lists(it):
    row = browse.sample_row(it, 1, 1)
    assert row.height == 1 and row["completion_token_ids"].to_list() == [[9, 2]]  # "4" then EOS
    assert row["ref_logprobs"].to_list()[0] == pytest.approx([-1.5, -0.9])
    with pytest.raises(LookupError, match=r"no sample \(prompt_id 1, sample_idx 7\)"):
        browse.sample_row(it, 1, 7)


def test_one_prompt_across_tagged_iterations(root, it, tmp_path):
    assert browse.iteration_revisions(root) == ["iteration-0", "iteration-1"]
    assert browse.workspace_tag(root) is None  # scores changed since iteration-1: the workspace is new
    opened = [(tag, browse.open_iteration(root, rev=tag, workdir=tmp_path / "work"))
              for tag in browse.iteration_revisions(root)] + [("workspace", it), ("gone", "iteration-7: not found")]
    history = browse.prompt_history(opened, 1)
    assert [h["iteration"] for h in history] == ["iteration-0", "iteration-1", "workspace", "gone"]
    for h in history[:3]:
        assert [(r["sample_idx"], r["reward"], r["completion_text"]) for r in h["rows"]] == [
            (0, 1.5, "5"), (1, PROMPT_1_SAMPLE_1[h["iteration"]], "4")]
        assert h["policy_version"] == 0 and h["note"] is None
    assert history[0]["columns"] == {"sample_idx": "Int32", "reward": "Float64", "correct": "Boolean",
                                     "advantage": "Float32", "completion_length": "Int32", "finish_reason": "String",
                                     "completion_text": "String"}
    assert history[3] == {"iteration": "gone", "policy_version": None, "columns": {}, "rows": [],
                          "note": "iteration-7: not found"}
    absent = browse.prompt_history(opened[:1], 9)[0]
    assert absent["rows"] == [] and absent["note"] == "prompt 9 was not sampled in this iteration"


def test_a_revision_is_read_as_it_was(root, tmp_path):
    old = browse.open_iteration(root, rev="0", workdir=tmp_path / "work0")  # "0" = iteration-0
    assert old.label.endswith("@iteration-0") and old.rev == "iteration-0"
    assert browse.page(old, browse.Query(offset=3, limit=1))["rows"][0]["reward"] == 0.0
    assert str(old.files["scores"]).endswith(f"iteration-0/{PATHS['scores']}")  # read out of git by DVC
    cached = old.files["token_stats"]  # the cache's object itself, nothing copied
    assert cached.parent.parent == root / ".dvc" / "cache" / "files" / "md5"
    assert cached.read_bytes() == (root / PATHS["token_stats"]).read_bytes()


def test_bad_targets_are_named(tmp_path, root):
    with pytest.raises(ArtifactError, match="no such file or directory"):
        browse.open_iteration(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="no params.yaml here"):
        browse.open_iteration(tmp_path)
    with pytest.raises(ArtifactError, match="'iteration-9': not a git revision"):
        browse.open_iteration(root, rev="iteration-9")
    with pytest.raises(ArtifactError, match="give the project directory, not a file"):
        browse.open_iteration(root / PATHS["rollouts"], rev="0")
    one = browse.open_iteration(root / PATHS["scores"])  # one artifact alone
    assert (one.base, one.view) == ("scores", "scores")
    assert one.model_dirs == [root / "model", root / "model", root / "ckpt"]  # its project's tokenizer
    assert keys(browse.page(one, browse.Query(sort="reward", limit=2))) == [(2, 0), (1, 1)]
    prompts = browse.open_iteration(root / PATHS["train_prompts"])  # keyed by prompt_id alone
    assert [r["prompt"] for r in browse.page(prompts, browse.Query(sort="prompt_id", descending=True))["rows"]] == [
        "4+4=", "2+3=", "1+1="]
    with pytest.raises(ArtifactError, match="a prompts table has no samples to draw"):
        browse.sample_row(prompts, 0, 0)


def test_eval_view_and_stale_tables_are_said(tmp_path):
    from rlpipe.data.io import read_artifact, write_artifact
    from rlpipe.data.schema import SCORES
    from tests.inspect_project import make_project

    root = make_project(tmp_path / "p", with_tokenizer=False)
    held_out = browse.open_iteration(root, eval_view=True)
    assert (held_out.view, list(held_out.files)) == ("eval", ["eval_rollouts", "prompts"])
    page = browse.page(held_out, browse.Query(where="NOT correct"))
    assert [(r["prompt_id"], r["prompt"], r["completion_text"]) for r in page["rows"]] == [(1, "2+2=", "0"),
                                                                                          (2, "3+3=", "0")]
    assert browse.iteration_warnings(held_out) == []
    scores = read_artifact(root / PATHS["scores"], SCORES)
    write_artifact(scores.frame, root / PATHS["scores"], SCORES, metadata={"policy_version": 3})
    (root / PATHS["token_stats"]).unlink()
    assert browse.iteration_warnings(browse.open_iteration(root)) == [
        f"token_stats: not found ({root / PATHS['token_stats']})",
        f"scores ({root / PATHS['scores']}) is for policy version 3 but rollouts is for 0: stale? run `dvc repro`"]


def test_a_table_of_another_schema_version_is_refused_by_name(tmp_path):
    from tests.inspect_project import make_project

    root = make_project(tmp_path / "p", with_tokenizer=False)
    file = root / PATHS["scores"]
    table = pq.read_table(file)
    footer = table.schema.metadata[b"rlpipe"].replace(b'"schema_version": ', b'"schema_version": 1000')
    pq.write_table(table.replace_schema_metadata({b"rlpipe": footer}), file)
    with pytest.raises(ArtifactError, match=f"{file}: schema version 1000.* but this rlpipe reads version"):
        browse.open_iteration(root)


def test_a_clean_workspace_is_its_tag(tmp_path):
    import subprocess

    from tests.inspect_project import make_project

    root = make_project(tmp_path / "p", with_tokenizer=False)
    assert browse.workspace_tag(root) is None  # not a git repository
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@x", "-c", "user.name=t", "commit", "-qm", "0"],
                 ["tag", "iteration-0"]):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)
    assert browse.workspace_tag(root) == "iteration-0"
