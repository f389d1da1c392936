"""The prepare stage's reading of a user's prompt files: every column reaches reward functions."""
from __future__ import annotations

import polars as pl
import pytest

from rlpipe.config import PromptFilesConfig
from rlpipe.errors import ArtifactError
from rlpipe.stages.prepare import read_prompt_rows


def files_config(**kw) -> PromptFilesConfig:
    base = dict(train="", eval="", tokenizer_path="", prompt_column="question", answer_column="solution",
                chat_template="auto", preferences=None)
    return PromptFilesConfig(**{**base, **kw})


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_every_column_of_the_file_is_metadata_the_raw_prompt_included(tmp_path, suffix):
    frame = pl.DataFrame({"question": ["2+2?", "0+7?"], "solution": ["4", "007"], "topic": ["sum", "pad"]})
    path = tmp_path / f"train.{suffix}"
    getattr(frame, f"write_{'ndjson' if suffix == 'jsonl' else suffix}")(path)
    read = read_prompt_rows(path, files_config())
    assert (read.format, read.columns) == ("standard", ["question", "solution", "topic"])
    assert read.rows[1] == {"prompt": "0+7?", "answer": "007",  # CSV columns stay strings: "007" is not 7
                       "metadata": {"question": "0+7?", "solution": "007", "topic": "pad"}}


def test_the_files_own_columns_are_typed_columns_of_the_prompt_table(tmp_path):
    """Every column but the prompt reaches the prompt table typed as the file has it; a name an rlpipe table uses
    gets the prefix user_ (the rollout view joins the prompt table onto them); the JSON metadata is unchanged."""
    from rlpipe.data.io import read_artifact, write_artifact
    from rlpipe.data.schema import PROMPTS
    from rlpipe.stages.prepare import prompt_table
    from rlpipe.tiny.tokenizer import build_char_tokenizer

    frame = pl.DataFrame({"question": ["2+2=", "1+7="], "solution": [4, 8], "difficulty": ["easy", "hard"],
                          "reward": [0.5, None], "tags": [["a"], []]})
    path = tmp_path / "train.parquet"
    frame.write_parquet(path)
    read = read_prompt_rows(path, files_config())
    assert read.user_columns.schema == pl.Schema({"solution": pl.Int64, "difficulty": pl.String,
                                                  "user_reward": pl.Float64, "tags": pl.List(pl.String)})
    table = prompt_table(read.rows, build_char_tokenizer("0123456789+="), max_prompt_tokens=16, chat_template=False,
                         source=str(path), user_columns=read.user_columns)
    write_artifact(table, tmp_path / "prompts.parquet", PROMPTS)
    back = read_artifact(tmp_path / "prompts.parquet", PROMPTS).frame
    assert back.columns == ["prompt_id", "prompt", "prompt_token_ids", "answer", "metadata", "solution", "difficulty",
                            "user_reward", "tags"]
    assert back.row(1, named=True) | {"prompt_token_ids": None} == {
        "prompt_id": 1, "prompt": "1+7=", "prompt_token_ids": None, "answer": "8",
        "metadata": '{"difficulty": "hard", "question": "1+7=", "reward": null, "solution": 8, "tags": []}',
        "solution": 8, "difficulty": "hard", "user_reward": None, "tags": []}
    write_artifact(table, tmp_path / "again.parquet", PROMPTS)
    assert (tmp_path / "again.parquet").read_bytes() == (tmp_path / "prompts.parquet").read_bytes()


def test_an_answer_column_named_answer_is_the_tables_own_and_a_renamed_clash_is_refused(tmp_path):
    path = tmp_path / "train.jsonl"
    pl.DataFrame({"prompt": ["a"], "answer": ["b"], "source": ["x"]}).write_ndjson(path)
    read = read_prompt_rows(path, files_config(prompt_column="prompt", answer_column="answer"))
    assert read.user_columns.columns == ["source"]  # prompt: rendered in `prompt`; answer: the table's `answer`
    pl.DataFrame({"prompt": ["a"], "reward": [1.0], "user_reward": [2.0]}).write_ndjson(path)
    with pytest.raises(ArtifactError, match=r"train.jsonl: column 'reward' is a name rlpipe's tables use, and its "
                                            r"renamed form 'user_reward' is also a column of the file"):
        read_prompt_rows(path, files_config(prompt_column="prompt", answer_column=None))
