"""The prepare stage's reading of a user's prompt files: every column reaches reward functions."""
from __future__ import annotations

import polars as pl
import pytest

from rlpipe.config import PromptFilesConfig
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
