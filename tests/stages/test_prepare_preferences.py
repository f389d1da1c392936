"""prepare's preference table: tokenized like prompts and rollouts, read from a user's file with clear
errors, empty when there is none, synthetic (train prompts only) for the tiny task."""
import importlib.util
import json
from pathlib import Path

import polars as pl
import pytest
import yaml
from typer.testing import CliRunner

from rlpipe.data.io import read_artifact, read_json, write_artifact
from rlpipe.data.schema import PREFERENCES, PROMPTS
from rlpipe.errors import ArtifactError
from rlpipe.stages.prepare import preference_table, read_preference_rows
from rlpipe.tiny import TASK_ALPHABET, build_char_tokenizer
from tests.shipped import shipped_params

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(TASK_ALPHABET)


def ids(tokenizer, text):
    return tokenizer.convert_tokens_to_ids(list(text))


def test_preference_table_tokenizes_like_prompts_and_stopped_rollouts(tokenizer):
    rows = [{"prompt": "12+3=", "chosen": "15", "rejected": "14", "prompt_id": 7},
            {"prompt": "9+9=", "chosen": "18", "rejected": "8"}]
    frame = preference_table(rows, tokenizer, max_prompt_tokens=16, chat_template=False, source="t")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert frame["pair_id"].to_list() == [0, 1]
    assert frame["prompt_id"].to_list() == [7, None]
    assert frame["prompt_token_ids"][0].to_list() == [bos, *ids(tokenizer, "12+3=")]  # = tokenizer(prompt)
    assert frame["chosen_token_ids"][0].to_list() == [*ids(tokenizer, "15"), eos]
    assert frame["rejected_token_ids"][1].to_list() == [*ids(tokenizer, "8"), eos]
    assert frame["chosen"].to_list() == ["15", "18"]


def test_empty_preference_table_round_trips_with_the_schema(tokenizer, tmp_path):
    frame = preference_table([], tokenizer, max_prompt_tokens=16, chat_template=False, source="t")
    write_artifact(frame, tmp_path / "p.parquet", PREFERENCES)
    back = read_artifact(tmp_path / "p.parquet", PREFERENCES).frame
    assert back.height == 0 and back.schema == PREFERENCES.polars_schema()


def test_too_long_preference_prompt_is_an_error_naming_the_row(tokenizer):
    with pytest.raises(ArtifactError, match="prefs.jsonl: row 1: prompt has 9 tokens, more than "
                                            "prepare.max_prompt_tokens=8"):
        preference_table([{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                          {"prompt": "11+11=11", "chosen": "2", "rejected": "3"}],
                         tokenizer, max_prompt_tokens=8, chat_template=False, source="prefs.jsonl")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_preference_rows_keeps_the_three_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "source": "x"}])
    assert read_preference_rows(path) == [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]


@pytest.mark.parametrize(("rows", "needle"), [
    ([{"prompt": "1+1=", "better": "2", "rejected": "3"}], "no column 'chosen'"),
    ([{"prompt": "1+1=", "chosen": 2, "rejected": "3"}], "column 'chosen' must hold strings"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": None}],
     "column 'rejected' has 1 null value(s), first at row 1"),
])
def test_bad_preference_files_name_file_and_column(tmp_path, rows, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ArtifactError, match=f"{path}: .*" + needle.replace("(", r"\(").replace(")", r"\)")):
        read_preference_rows(path)


def test_empty_preference_file_is_an_error(tmp_path):
    path = tmp_path / "empty.parquet"
    pl.DataFrame({c: pl.Series([], dtype=pl.String) for c in ("prompt", "chosen", "rejected")}).write_parquet(path)
    with pytest.raises(ArtifactError, match="no preference pairs .*prepare.files.preferences: null"):
        read_preference_rows(path)


# ---------------------------------------------------------------- the stage


def run_prepare(tmp_path, updates):
    params = yaml.safe_load(shipped_params().read_text())
    for dotted, value in updates.items():
        node = params
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    spec = importlib.util.spec_from_file_location("stage_prepare", REPO / "stages/prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    args = ["--params", tmp_path / "params.yaml", "--model-dir", out / "model", "--train-prompts",
            out / "train.parquet", "--eval-prompts", out / "eval.parquet", "--preferences", out / "prefs.parquet",
            "--metrics", out / "prepare.json"]
    result = CliRunner().invoke(module.app, [str(a) for a in args])
    return result.exit_code, result.output, out


def files_params(tmp_path, tokenizer, preferences):
    tokenizer.save_pretrained(tmp_path / "tok")
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    return {"prepare.source": "files", "prepare.files.train": str(tmp_path / "train.jsonl"),
            "prepare.files.eval": str(tmp_path / "train.jsonl"), "prepare.files.tokenizer_path": str(tmp_path / "tok"),
            "prepare.files.preferences": preferences}


def test_prepare_files_tokenizes_the_users_preferences(tmp_path, tokenizer):
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "3+4=", "chosen": "7", "rejected": "8"},
                                                   {"prompt": "5+5=", "chosen": "10", "rejected": "0"}])
    code, output, out = run_prepare(tmp_path, files_params(tmp_path, tokenizer, str(prefs)))
    assert code == 0, output
    art = read_artifact(out / "prefs.parquet", PREFERENCES)
    assert art.frame["prompt"].to_list() == ["3+4=", "5+5="] and art.frame["prompt_id"].null_count() == 2
    assert art.frame["chosen_token_ids"][1].to_list() == [*ids(tokenizer, "10"), tokenizer.eos_token_id]
    assert art.metadata["source"] == str(prefs)
    assert read_json(out / "prepare.json")["num_preference_pairs"] == 2


def test_prepare_files_without_preferences_writes_an_empty_table(tmp_path, tokenizer):
    code, output, out = run_prepare(tmp_path, files_params(tmp_path, tokenizer, None))
    assert code == 0, output
    assert read_artifact(out / "prefs.parquet", PREFERENCES).frame.height == 0
    assert read_json(out / "prepare.json")["num_preference_pairs"] == 0


def test_prepare_files_with_a_bad_preference_file_fails_naming_it(tmp_path, tokenizer):
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "3+4=", "good": "7", "rejected": "8"}])
    code, output, out = run_prepare(tmp_path, files_params(tmp_path, tokenizer, str(prefs)))
    assert code == 2 and f"{prefs}: no column 'chosen'" in output
    assert not (out / "prefs.parquet").exists()


def test_prepare_tiny_writes_synthetic_pairs_from_train_prompts(tmp_path):
    shrink = {"prepare.tiny.num_train": 40, "prepare.tiny.num_eval": 10, "prepare.tiny.hidden_size": 16,
              "prepare.tiny.num_layers": 1, "prepare.tiny.num_heads": 2, "prepare.tiny.intermediate_size": 32,
              "prepare.tiny.warmstart_steps": 2, "prepare.tiny.warmstart_batch_size": 8,
              "prepare.tiny.num_preference_pairs": 30}
    code, output, out = run_prepare(tmp_path, shrink)
    assert code == 0, output
    prefs = read_artifact(out / "prefs.parquet", PREFERENCES).frame
    train = read_artifact(out / "train.parquet", PROMPTS).frame
    evals = read_artifact(out / "eval.parquet", PROMPTS).frame
    assert prefs.height == 30 and prefs["prompt_id"].n_unique() == 30
    joined = prefs.join(train, on="prompt_id", suffix="_train")
    assert joined.height == 30
    assert joined["prompt"].to_list() == joined["prompt_train"].to_list()
    assert joined["prompt_token_ids"].to_list() == joined["prompt_token_ids_train"].to_list()
    assert joined["chosen"].to_list() == joined["answer"].to_list()
    assert not set(prefs["prompt"]) & set(evals["prompt"])
    first = (out / "prefs.parquet").read_bytes()
    code, output, out = run_prepare(tmp_path, shrink)
    assert code == 0 and (out / "prefs.parquet").read_bytes() == first
