"""Each stage entry point on good and bad inputs: clear error naming the culprit, exit 2, nothing written."""
from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import sys
import textwrap
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlpipe.data.io import read_artifact
from rlpipe.data.schema import PROMPTS, SCHEMA_VERSION, SCORES
from tests.e2e.conftest import REPO, edit_params

pytestmark = pytest.mark.slow


def stage_app(name: str):
    spec = importlib.util.spec_from_file_location(f"stage_{name}", REPO / "stages" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app


def invoke(stage: str, args: list[str]):
    result = CliRunner().invoke(stage_app(stage), args)
    return result.exit_code, result.output  # click >= 8.2 mixes stderr into output


@pytest.fixture()
def ws(reproduced, tmp_path) -> Path:
    """A scratch dir with a copy of the reproduced project's params and artifacts."""
    shutil.copytree(reproduced / "artifacts", tmp_path / "artifacts")
    shutil.copy(reproduced / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def generate_args(ws: Path, **over: str) -> list[str]:
    args = {"--params": ws / "params.yaml", "--prompts": ws / "artifacts/prepare/train_prompts.parquet",
            "--policy": ws / "artifacts/prepare/model", "--out": ws / "out/rollouts.parquet",
            "--metrics": ws / "out/generate.json"}
    args.update({k: ws / v for k, v in over.items()})
    return [str(x) for kv in args.items() for x in kv]


def score_args(ws: Path, **over: str) -> list[str]:
    args = {"--params": ws / "params.yaml", "--rollouts": ws / "artifacts/generate/rollouts.parquet",
            "--prompts": ws / "artifacts/prepare/train_prompts.parquet", "--out": ws / "out/scores.parquet",
            "--metrics": ws / "out/score.json"}
    args.update({k: ws / v for k, v in over.items()})
    return [str(x) for kv in args.items() for x in kv]


def test_generate_ok_then_missing_prompt_file(ws):
    code, out = invoke("generate", generate_args(ws))
    assert code == 0, out
    code, out = invoke("generate", generate_args(ws, **{"--prompts": "nope.parquet", "--out": "out/r2.parquet"}))
    assert code == 2 and "nope.parquet" in out and "not found" in out
    assert not (ws / "out/r2.parquet").exists()


def test_generate_rejects_missing_column(ws):
    frame = pl.read_parquet(ws / "artifacts/prepare/train_prompts.parquet").drop("prompt_token_ids")
    table = frame.to_arrow().replace_schema_metadata(
        {"rlpipe": json.dumps({"artifact": "prompts", "schema_version": SCHEMA_VERSION})})
    pq.write_table(table, ws / "bad.parquet")
    code, out = invoke("generate", generate_args(ws, **{"--prompts": "bad.parquet"}))
    assert code == 2 and "prompt_token_ids" in out and "bad.parquet" in out
    assert not (ws / "out/rollouts.parquet").exists()


def test_generate_rejects_mistyped_column(ws):
    frame = pl.read_parquet(ws / "artifacts/prepare/train_prompts.parquet")
    frame = frame.with_columns(pl.col("prompt_id").cast(pl.String))
    table = frame.to_arrow().replace_schema_metadata(
        {"rlpipe": json.dumps({"artifact": "prompts", "schema_version": SCHEMA_VERSION})})
    pq.write_table(table, ws / "bad.parquet")
    code, out = invoke("generate", generate_args(ws, **{"--prompts": "bad.parquet"}))
    assert code == 2 and "'prompt_id'" in out and "dtype" in out


def test_generate_rejects_missing_model_dir(ws):
    code, out = invoke("generate", generate_args(ws, **{"--policy": "no/such/model"}))
    assert code == 2 and "no/such/model" in out and "model directory not found" in out
    assert not (ws / "out/rollouts.parquet").exists()


def test_generate_rejects_prompt_longer_than_context(ws):
    edit_params(ws / "params.yaml", {"generate.max_new_tokens": 10_000})
    code, out = invoke("generate", generate_args(ws))
    assert code == 2 and "prompt_id" in out and "context" in out
    assert not (ws / "out/rollouts.parquet").exists()


def test_generate_refuses_a_policy_of_another_version(ws):
    """The trained checkpoint (version 1) handed to iteration 0's generate (policy.version 0)."""
    code, out = invoke("generate", generate_args(ws, **{"--policy": "artifacts/train/checkpoint"}))
    assert code == 2 and "checkpoint: holds policy version 1 but params policy.version is 0" in out
    assert not (ws / "out/rollouts.parquet").exists()


def test_unknown_params_key_fails_before_any_work(ws):
    edit_params(ws / "params.yaml", {"generate.temprature": 1.0})
    code, out = invoke("generate", generate_args(ws))
    assert code == 2 and "generate" in out and "temprature" in out and "unknown key" in out


def test_score_unknown_reward_name(ws):
    edit_params(ws / "params.yaml", {"score.rewards": [{"name": "exact_answr", "weight": 1.0, "options": {}}],
                                     "score.accuracy_reward": "exact_answr"})
    code, out = invoke("score", score_args(ws))
    assert code == 2 and "exact_answr" in out and "digit_match" in out  # lists the valid names
    assert not (ws / "out/scores.parquet").exists()


def test_score_user_function_errors_are_per_row(ws, monkeypatch):
    module = ws / "myrewards.py"
    module.write_text(textwrap.dedent("""
        def picky(sample, *, fail_on):
            if sample.completion.startswith(fail_on):
                raise RuntimeError("cannot judge " + sample.completion)
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(ws))
    sys.modules.pop("myrewards", None)
    rollouts = pl.read_parquet(ws / "artifacts/generate/rollouts.parquet")
    first_char = rollouts["completion_text"].str.slice(0, 1).mode().sort()[0]
    failing = int((rollouts["completion_text"].str.slice(0, 1) == first_char).sum())
    rewards = [{"name": "myrewards:picky", "weight": 2.0, "options": {"fail_on": first_char}}]
    edit_params(ws / "params.yaml", {"score.rewards": rewards, "score.accuracy_reward": "myrewards:picky",
                                     "score.fallback_reward": -1.0, "score.max_error_fraction": 1.0})
    code, out = invoke("score", score_args(ws))
    assert code == 0, out
    scores = read_artifact(ws / "out/scores.parquet", SCORES).frame
    errored = scores.filter(pl.col("score_error").is_not_null())
    assert errored.height == failing
    assert errored["reward"].unique().to_list() == [-1.0]
    assert errored["score_error"].str.starts_with("RuntimeError: cannot judge").all()
    assert scores.filter(pl.col("score_error").is_null())["reward_picky"].unique().to_list() == [1.0]
    assert json.loads((ws / "out/score.json").read_text())["errors_by_kind"] == {"RuntimeError": failing}

    edit_params(ws / "params.yaml", {"score.max_error_fraction": 0.0})
    code, out = invoke("score", score_args(ws, **{"--out": "out/s2.parquet"}))
    assert code == 2 and "max_error_fraction" in out and "RuntimeError" in out
    assert not (ws / "out/s2.parquet").exists()


def test_advantage_rejects_scores_with_other_keys(ws):
    scores = read_artifact(ws / "artifacts/score/scores.parquet", SCORES).frame.slice(1)
    from rlpipe.data.io import write_artifact

    write_artifact(scores, ws / "short_scores.parquet", SCORES)
    code, out = invoke("advantage", ["--params", str(ws / "params.yaml"),
                                     "--rollouts", str(ws / "artifacts/generate/rollouts.parquet"),
                                     "--scores", str(ws / "short_scores.parquet"),
                                     "--out", str(ws / "out/adv.parquet"), "--kl-controller", str(ws / "out/kl.json"),
                                     "--metrics", str(ws / "out/a.json")])
    assert code == 2 and "keys do not match" in out and "only in" in out and "rollouts.parquet" in out
    assert not (ws / "out/adv.parquet").exists()


def test_train_rejects_ref_logprobs_of_wrong_length(ws):
    path = ws / "artifacts/reference_logprob/ref_logprobs.parquet"
    table = pq.read_table(path)
    col = table.column("ref_logprobs").to_pylist()
    col[0] = col[0][:-1]
    table = table.set_column(table.schema.get_field_index("ref_logprobs"), "ref_logprobs",
                             pa.array(col, type=table.schema.field("ref_logprobs").type))
    pq.write_table(table, ws / "bad_ref.parquet")
    args = ["--params", ws / "params.yaml", "--rollouts", ws / "artifacts/generate/rollouts.parquet",
            "--scores", ws / "artifacts/score/scores.parquet", "--ref-logprobs", ws / "bad_ref.parquet",
            "--advantages", ws / "artifacts/advantage/advantages.parquet", "--policy", ws / "artifacts/prepare/model",
            "--checkpoint", ws / "out/ckpt", "--token-stats", ws / "out/ts.parquet",
            "--metrics", ws / "out/train.json", "--steps", ws / "out/steps.csv"]
    code, out = invoke("train", [str(a) for a in args])
    assert code == 2 and "ref_logprobs" in out and "completion tokens" in out
    assert not (ws / "out/ckpt").exists() and not (ws / "out/ts.parquet").exists()


def prepare_files(ws: Path, rows: list[dict], **params) -> tuple[int, str]:
    with open(ws / "train.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    shutil.copy(ws / "train.jsonl", ws / "eval.jsonl")
    edit_params(ws / "params.yaml", {"prepare.source": "files", "prepare.files.train": str(ws / "train.jsonl"),
                                     "prepare.files.eval": str(ws / "eval.jsonl"),
                                     "prepare.files.tokenizer_path": str(ws / "artifacts/prepare/model"), **params})
    return invoke("prepare", ["--params", str(ws / "params.yaml"), "--model-dir", str(ws / "out/model"),
                              "--train-prompts", str(ws / "out/train.parquet"),
                              "--eval-prompts", str(ws / "out/eval.parquet"),
                              "--preferences", str(ws / "out/prefs.parquet"), "--metrics", str(ws / "out/p.json")])


def test_prepare_from_user_files(ws):
    code, out = prepare_files(ws, [{"prompt": "12+30=", "answer": "42", "level": 1},
                                   {"prompt": "1+1=", "answer": 2, "level": 2}])
    assert code == 0, out
    frame = read_artifact(ws / "out/train.parquet", PROMPTS).frame
    assert frame["prompt"].to_list() == ["12+30=", "1+1="]
    assert frame["answer"].to_list() == ["42", "2"]
    # every column of the file, the raw prompt and answer included, reaches the rewards (issue 15)
    assert [json.loads(m) for m in frame["metadata"]] == [{"answer": "42", "level": 1, "prompt": "12+30="},
                                                          {"answer": "2", "level": 2, "prompt": "1+1="}]
    assert frame["prompt_token_ids"][1].len() == 5  # <bos> + 4 characters
    assert not (ws / "out/model").exists()


@pytest.mark.parametrize(("rows", "params", "needle"), [
    ([], {}, "empty"),
    ([{"question": "1+1=", "answer": "2"}], {}, "'prompt'"),
    ([{"prompt": "1+1=", "solution": "2"}], {}, "'answer'"),
    ([{"prompt": "1+1=" * 40, "answer": "2"}], {}, "max_prompt_tokens"),
    ([{"prompt": "1+1=", "answer": "2"}], {"prepare.files.tokenizer_path": "/no/such/tok"}, "/no/such/tok"),
])
def test_prepare_rejects_bad_prompt_files(ws, rows, params, needle):
    code, out = prepare_files(ws, rows, **params)
    assert code == 2 and needle in out, out
    assert not (ws / "out/train.parquet").exists()


def test_prepare_applies_the_chat_template(ws):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ws / "artifacts/prepare/model"))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    tok.save_pretrained(str(ws / "tok"))
    code, out = prepare_files(ws, [{"prompt": "12+30", "answer": "42"}],
                              **{"prepare.files.tokenizer_path": str(ws / "tok")})
    assert code == 0, out
    frame = read_artifact(ws / "out/train.parquet", PROMPTS).frame
    assert frame["prompt"].to_list() == ["12+30="]
    assert frame["prompt_token_ids"][0].len() == 6  # template output tokenized without an extra <bos>


# ----------------------------------------------------------------------------------------------
# Inputs from another schema version or another policy (files handed over between machines)
# ----------------------------------------------------------------------------------------------

OUTPUT_OPTIONS = {"--out", "--metrics", "--checkpoint", "--token-stats", "--steps", "--kl-controller",
                  "--critic-checkpoint"}


def stage_args(ws: Path, stage: str, **replace: str) -> list[str]:
    """The stage's dvc.yaml command line on the copied artifacts, writing under ws/out (options in ``replace`` win)."""
    from rlpipe.run.commands import stage_commands

    words = shlex.split(stage_commands(REPO / "dvc.yaml", ws / "params.yaml")[stage])[2:]  # drop `python stages/x.py`
    def is_output(opt: str) -> bool:  # --preferences: prepare's output, train_reward_model's input
        return opt in OUTPUT_OPTIONS or (opt == "--preferences" and stage == "prepare")

    opts = {opt: str(ws / "out" / Path(value).name) if is_output(opt) else str(ws / value)
            for opt, value in zip(words[::2], words[1::2])}
    opts.update(replace)
    return [x for kv in opts.items() for x in kv]


def with_footer(src: str | Path, dest: Path, **changes) -> Path:
    """A copy of an artifact whose rlpipe footer says something else (schema or policy version)."""
    table = pq.read_table(src)
    meta = json.loads(table.schema.metadata[b"rlpipe"])
    pq.write_table(table.replace_schema_metadata({"rlpipe": json.dumps({**meta, **changes})}), dest)
    return dest


def nothing_written(ws: Path) -> bool:
    return not list((ws / "out").rglob("*"))


@pytest.mark.parametrize(("stage", "option"), [
    ("generate", "--prompts"), ("score", "--rollouts"), ("reference_logprob", "--rollouts"),
    ("advantage", "--scores"), ("train", "--ref-logprobs"), ("evaluate", "--prompts")])
def test_every_stage_refuses_an_input_of_schema_version_0(ws, stage, option):
    args = stage_args(ws, stage)
    old = with_footer(args[args.index(option) + 1], ws / "from_old_rlpipe.parquet", schema_version=0)
    code, out = invoke(stage, stage_args(ws, stage, **{option: str(old)}))
    assert code == 2, out
    assert f"from_old_rlpipe.parquet: schema version 0 but this rlpipe reads version {SCHEMA_VERSION}" in out
    assert nothing_written(ws)


def test_train_refuses_rollouts_of_an_earlier_iteration(ws):
    """Iteration 1's train handed iteration 0's rollouts (generate was not re-run after `rlpipe iterate`)."""
    edit_params(ws / "params.yaml", {"iteration": 1, "policy.version": 1})
    code, out = invoke("train", stage_args(ws, "train"))
    assert code == 2 and "rollouts.parquet: sampled by policy version 0, but params policy.version is 1" in out
    assert nothing_written(ws)


def test_train_refuses_rollouts_whose_footer_names_another_policy(ws):
    other = with_footer(ws / "artifacts/generate/rollouts.parquet", ws / "other_run.parquet", policy_version=3)
    code, out = invoke("train", stage_args(ws, "train", **{"--rollouts": str(other)}))
    assert code == 2 and "other_run.parquet: sampled by policy version 3, but params policy.version is 0" in out
    assert nothing_written(ws)


def test_train_refuses_a_policy_other_than_the_sampler(ws):
    """pi_old must be the sampler: the trained checkpoint (version 1) is not the policy of version-0 rollouts."""
    code, out = invoke("train", stage_args(ws, "train", **{"--policy": str(ws / "artifacts/train/checkpoint")}))
    assert code == 2 and "checkpoint: holds policy version 1, but train starts iteration 0 from version 0" in out
    assert nothing_written(ws)
