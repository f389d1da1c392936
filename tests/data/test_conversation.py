"""TRL's two prompt formats told apart by dtype, message lists checked, and the refusals naming their cause."""
from __future__ import annotations

import doctest
from types import SimpleNamespace

import polars as pl
import pytest

from rlpipe.data import conversation
from rlpipe.data.conversation import (CONVERSATIONAL, STANDARD, checked_messages, column_format, prompt_format,
                                      require_chat_template, same_format)
from rlpipe.errors import ArtifactError, ConfigError

MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))


def test_the_format_follows_the_prompt_columns_dtype():
    assert column_format(pl.String) == STANDARD
    assert column_format(MESSAGES) == CONVERSATIONAL
    # extra message fields (a tool call's name) keep it conversational; a list without role/content does not
    assert column_format(pl.List(pl.Struct({"content": pl.String, "role": pl.String, "name": pl.String}))) \
        == CONVERSATIONAL
    assert column_format(pl.List(pl.Struct({"text": pl.String}))) is None
    assert column_format(pl.List(pl.String)) is None


def test_a_prompt_column_of_another_dtype_is_refused_naming_file_and_column():
    frame = pl.DataFrame({"question": [1, 2]})
    with pytest.raises(ArtifactError, match=r"train.parquet: column 'question' must hold strings \(TRL's standard "
                                            r"format\) or lists of \{role, content\} messages .*has Int64"):
        prompt_format(frame, "question", "train.parquet")


def test_messages_keep_only_the_fields_they_set():
    # polars gives every message the union of the fields: a name on one message is name=None on the others
    value = [{"role": "system", "content": "be brief", "name": None}, {"role": "user", "content": "hi", "name": "ann"}]
    assert checked_messages(value, "f: row 0") == [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hi", "name": "ann"}]


@pytest.mark.parametrize(("value", "needle"), [
    ([], "f: row 3: prompt must be a non-empty list"),
    (None, "f: row 3: prompt must be a non-empty list"),
    ([{"role": "user", "content": None}], "f: row 3: message 0 needs a role and a string content"),
    ([{"role": "user", "content": "a"}, {"role": None, "content": "b"}], "f: row 3: message 1 needs a role"),
])
def test_a_bad_message_list_is_refused_naming_row_and_message(value, needle):
    with pytest.raises(ArtifactError, match=needle):
        checked_messages(value, "f: row 3")


def test_train_and_eval_files_must_share_one_format():
    assert same_format({"t.parquet": CONVERSATIONAL, "e.parquet": CONVERSATIONAL}) == CONVERSATIONAL
    with pytest.raises(ArtifactError, match="t.parquet is conversational, e.jsonl is standard"):
        same_format({"t.parquet": CONVERSATIONAL, "e.jsonl": STANDARD})


def test_conversational_prompts_need_a_chat_template_and_it_on():
    with_template = SimpleNamespace(chat_template="{{ messages }}")
    require_chat_template(with_template, model_dir="m", source="t.parquet")  # fine: nothing raised
    with pytest.raises(ConfigError, match=r"t.parquet holds conversational prompts .* the tokenizer in models/x "
                                          r"has no chat template"):
        require_chat_template(SimpleNamespace(chat_template=None), model_dir="models/x", source="t.parquet")
    with pytest.raises(ConfigError, match="prepare.files.chat_template is 'off'; set it to auto or on"):
        require_chat_template(with_template, model_dir="m", source="t.parquet", mode="off")


def test_doctests_pass():
    from rlpipe.rewards import columns

    for module in (conversation, columns):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
