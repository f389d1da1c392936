"""rlpipe.data.io: round trips, byte-determinism, every kind of bad input rejected by name, atomic writes.

The frames here are written by hand so that each expected value can be read off the test.
"""
from __future__ import annotations

import io as stdio
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from rlpipe.data import io
from rlpipe.data.schema import (
    ADVANTAGES,
    ARTIFACTS,
    EVAL_ROLLOUTS,
    METADATA_KEY,
    PREFERENCES,
    PROMPTS,
    REF_LOGPROBS,
    ROLLOUTS,
    SCHEMA_VERSION,
    SCORES,
    TOKEN_FLOATS,
    TRAIN_TOKEN_STATS,
    VALUES,
    ArtifactSchema,
)
from rlpipe.errors import ArtifactError
from rlpipe.stages.generate import single_turn_columns

# ----------------------------------------------------------------------------------------------
# Hand-made valid frames (rows deliberately not in key order: the writer must sort them)
# ----------------------------------------------------------------------------------------------
# Four samples: prompts 0 and 1, G = 2, with completion lengths 3, 1, 2, 3.
KEYS = {"prompt_id": [1, 0, 1, 0], "sample_idx": [0, 1, 1, 0]}
LENGTHS = [2, 1, 3, 3]


def prompts_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "prompt_id": [1, 0],
            "prompt": ["2+3=", "1+1="],
            "prompt_token_ids": [[8, 9], [5, 6, 7]],
            "answer": [None, "2"],
            "metadata": ['{"k": 1}', "{}"],
        },
        schema=PROMPTS.polars_schema(),
    )


SINGLE_TURN_INPUTS = ("prompt_id", "sample_idx", "policy_version", "sample_seed", "prompt_token_ids",
                      "completion_token_ids", "completion_text", "completion_length", "sampler_logprobs",
                      "finish_reason", "truncated")


def rollouts_frame() -> pl.DataFrame:
    """Single-turn rollouts: the multi-turn columns hold their trivial values (generate.single_turn_columns)."""
    return single_turn_columns(pl.DataFrame(
        {
            **KEYS,
            "policy_version": [0, 0, 0, 0],
            "sample_seed": [11, 2, 12, 1],
            "prompt_token_ids": [[8, 9], [5, 6, 7], [8, 9], [5, 6, 7]],
            "completion_token_ids": [[3, 1], [2], [4, 4, 1], [2, 2, 2]],
            "completion_text": ["5", "", "55", "222"],
            "completion_length": LENGTHS,
            "sampler_logprobs": [[-0.5, -0.25], [-1.0], [-0.125, -2.0, -0.75], [-1.5, -0.5, -3.0]],
            "finish_reason": ["stop", "stop", "stop", "length"],
            "truncated": [False, False, False, True],
        },
        schema={k: v for k, v in ROLLOUTS.polars_schema().items() if k in SINGLE_TURN_INPUTS},
    ), tokenizer_hash="0123456789abcdef").select(ROLLOUTS.column_names)


def scores_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            **KEYS,
            "reward": [1.5, 0.0, 0.0, 0.5],  # (1, 1) errored: the fallback reward 0.0
            "correct": [True, False, None, False],
            "score_error": [None, None, "ValueError: bad", None],
            "reward_digit_match": [1.0, 0.0, None, 1.0],
            "reward_exact_answer": [1.0, 0.0, None, 0.0],
        },
        schema=SCORES.polars_schema(["reward_exact_answer", "reward_digit_match"]),
    )


def ref_logprobs_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            **KEYS,
            "reference_version": [0, 0, 0, 0],
            "ref_logprobs": [[-0.5, -0.5], [-1.25], [-0.25, -2.0, -1.0], [-1.0, -0.5, -2.5]],
        },
        schema=REF_LOGPROBS.polars_schema(),
    )


def values_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {**KEYS, "values": [[0.5, 0.25], [0.0], [0.5, 0.5, 0.5], [1.0, 0.75, 0.5]]},
        schema=VALUES.polars_schema(),
    )


def advantages_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            **KEYS,
            "advantage": [0.5, -0.5, -0.5, 0.5],
            "token_advantages": [[0.5, 0.5], [-0.5], [-0.5, -0.5, -0.5], [0.5, 0.5, 0.5]],
            "returns": [None, None, None, None],
            "group_size": [2, 2, 2, 2],
            "group_reward_mean": [0.75, 0.25, 0.75, 0.25],
            "group_reward_std": [1.0, 0.25, 1.0, 0.25],
            "filtered_reason": [None, None, "truncated", None],
        },
        schema=ADVANTAGES.polars_schema(),
    )


def train_token_stats_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            **KEYS,
            "old_logprobs": [[-0.5, -0.25], [-1.0], [-0.125, -2.0, -0.75], [-1.5, -0.5, -3.0]],
            "entropy": [[1.0, 0.5], [2.0], [0.25, 0.25, 0.25], [1.5, 1.5, 1.5]],
            "new_logprobs": [[-0.25, -0.25], [-1.5], [-0.125, -1.0, -0.75], [-1.0, -0.5, -2.0]],
        },
        schema=TRAIN_TOKEN_STATS.polars_schema(),
    )


def eval_rollouts_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            **KEYS,
            "policy_version": [1, 1, 1, 1],
            "completion_token_ids": [[3, 1], [2], [4, 4, 1], [2, 2, 2]],
            "completion_text": ["5", "", "55", "222"],
            "completion_length": LENGTHS,
            "truncated": [False, False, False, True],
            "finish_reason": ["stop", "stop", "stop", "length"],
            "policy_mask": [[True, True], [True], [True, True, True], [True, True, True]],
            "num_turns": [1, 1, 1, 1],
            "turn_starts": [[0], [0], [0], [0]],
            "tool_calls": [[], [], [], []],
            "num_tool_calls": [0, 0, 0, 0],
            "reward": [1.0, 0.0, 0.5, 0.0],
            "correct": [True, False, None, False],
        },
        schema=EVAL_ROLLOUTS.polars_schema(),
    )


def preferences_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "pair_id": [1, 0],
            "prompt_id": [None, 4],
            "prompt": ["9+9=", "1+2="],
            "prompt_token_ids": [[1, 16, 6, 16, 17], [1, 8, 6, 9, 17]],
            "chosen": ["18", "3"],
            "chosen_token_ids": [[8, 15, 2], [10, 2]],
            "rejected": ["8", "4"],
            "rejected_token_ids": [[15, 2], [11, 2]],
        },
        schema=PREFERENCES.polars_schema(),
    )


FRAMES = {
    "prompts": prompts_frame,
    "preferences": preferences_frame,
    "rollouts": rollouts_frame,
    "scores": scores_frame,
    "ref_logprobs": ref_logprobs_frame,
    "values": values_frame,
    "advantages": advantages_frame,
    "train_token_stats": train_token_stats_frame,
    "eval_rollouts": eval_rollouts_frame,
}


def test_every_artifact_has_a_hand_made_frame():
    assert sorted(FRAMES) == sorted(ARTIFACTS)


def write_raw(df: pl.DataFrame, path: Path, meta: dict | None) -> Path:
    """Write Parquet with pyarrow directly, bypassing write_artifact's checks (as a foreign tool would)."""
    table = df.to_arrow()
    if meta is not None:
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)})
    pq.write_table(table, path)
    return path


def meta_of(schema: ArtifactSchema) -> dict:
    return {"artifact": schema.name, "schema_version": SCHEMA_VERSION}


def only_file(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ----------------------------------------------------------------------------------------------
# Round trip and determinism
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FRAMES))
def test_round_trip(tmp_path, name):
    schema = ARTIFACTS[name]
    df = FRAMES[name]()
    path = tmp_path / f"{name}.parquet"
    returned = io.write_artifact(df, path, schema, metadata={"policy_version": 7, "note": "hand-made"})
    assert returned == path

    art = io.read_artifact(path, schema)

    assert_frame_equal(art.frame, df.sort(list(schema.keys)))
    # The writer sorts by the keys, so the rows come back in key order whatever order went in.
    assert art.frame.select(schema.keys).rows() == sorted(df.select(schema.keys).rows())
    assert art.metadata == {"artifact": name, "schema_version": SCHEMA_VERSION, "policy_version": 7,
                            "note": "hand-made"}
    assert io.read_metadata(path) == art.metadata
    assert art.path == path
    assert only_file(tmp_path) == [f"{name}.parquet"]  # no temp file left beside it


def test_round_trip_without_metadata_and_into_new_directory(tmp_path):
    path = tmp_path / "a" / "b" / "rollouts.parquet"
    io.write_artifact(rollouts_frame(), path, ROLLOUTS)
    assert io.read_artifact(path, ROLLOUTS).metadata == {"artifact": "rollouts", "schema_version": SCHEMA_VERSION}


def test_round_trip_of_an_empty_frame(tmp_path):
    empty = rollouts_frame().clear()
    io.write_artifact(empty, tmp_path / "r.parquet", ROLLOUTS)
    art = io.read_artifact(tmp_path / "r.parquet", ROLLOUTS)
    assert art.frame.height == 0
    assert art.frame.schema == ROLLOUTS.polars_schema()


def test_write_casts_numeric_widths_within_a_kind(tmp_path):
    """A producer may hand Int64 / Float64 (polars' defaults); they are stored as the schema's widths."""
    df = pl.DataFrame(
        {
            "prompt_id": [0, 1],
            "sample_idx": [0, 0],  # Int64, schema says Int32
            "reference_version": [0, 0],
            "ref_logprobs": [[-0.5, -0.25], [-1.0]],  # List(Float64), schema says List(Float32)
        }
    )
    assert df.schema["sample_idx"] == pl.Int64 and df.schema["ref_logprobs"] == pl.List(pl.Float64)
    io.write_artifact(df, tmp_path / "ref.parquet", REF_LOGPROBS)
    frame = io.read_artifact(tmp_path / "ref.parquet", REF_LOGPROBS).frame
    assert frame.schema == REF_LOGPROBS.polars_schema()
    assert frame["ref_logprobs"].to_list() == [[-0.5, -0.25], [-1.0]]  # exact in float32


def test_write_puts_columns_in_canonical_order(tmp_path):
    df = scores_frame()
    shuffled_columns = df.select(list(reversed(df.columns)))
    io.write_artifact(shuffled_columns, tmp_path / "s.parquet", SCORES)
    art = io.read_artifact(tmp_path / "s.parquet", SCORES)
    assert art.frame.columns == ["prompt_id", "sample_idx", "reward", "correct", "score_error",
                                 "reward_digit_match", "reward_exact_answer"]


def test_same_frame_twice_gives_identical_bytes(tmp_path):
    io.write_artifact(rollouts_frame(), tmp_path / "a.parquet", ROLLOUTS, metadata={"x": 1, "a": [1, 2]})
    io.write_artifact(rollouts_frame(), tmp_path / "b.parquet", ROLLOUTS, metadata={"a": [1, 2], "x": 1})
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


@pytest.mark.parametrize("name", ["rollouts", "scores", "prompts"])
def test_row_and_column_order_and_chunking_do_not_change_the_bytes(tmp_path, name):
    schema = ARTIFACTS[name]
    df = FRAMES[name]()
    io.write_artifact(df, tmp_path / "a.parquet", schema)

    shuffled = df.reverse()
    assert shuffled.rows() != df.rows()
    io.write_artifact(shuffled, tmp_path / "b.parquet", schema)

    chunked = pl.concat([df[1:], df[:1]], rechunk=False).select(list(reversed(df.columns)))
    assert chunked.n_chunks() == 2
    io.write_artifact(chunked, tmp_path / "c.parquet", schema)

    a = (tmp_path / "a.parquet").read_bytes()
    assert (tmp_path / "b.parquet").read_bytes() == a
    assert (tmp_path / "c.parquet").read_bytes() == a


def test_different_metadata_gives_different_bytes(tmp_path):
    """The determinism test above can fail: the footer does carry the metadata."""
    io.write_artifact(rollouts_frame(), tmp_path / "a.parquet", ROLLOUTS, metadata={"policy_version": 0})
    io.write_artifact(rollouts_frame(), tmp_path / "b.parquet", ROLLOUTS, metadata={"policy_version": 1})
    assert (tmp_path / "a.parquet").read_bytes() != (tmp_path / "b.parquet").read_bytes()


# ----------------------------------------------------------------------------------------------
# Rejections on write: the message names the file and the column; nothing is written
# ----------------------------------------------------------------------------------------------

def rejected_on_write(df: pl.DataFrame, schema: ArtifactSchema, tmp_path: Path) -> str:
    path = tmp_path / "out.parquet"
    with pytest.raises(ArtifactError) as exc:
        io.write_artifact(df, path, schema)
    msg = str(exc.value)
    assert f"{path} (being written)" in msg
    assert only_file(tmp_path) == []
    return msg


def test_write_rejects_missing_column(tmp_path):
    msg = rejected_on_write(rollouts_frame().drop("finish_reason"), ROLLOUTS, tmp_path)
    assert "missing column(s) ['finish_reason']" in msg
    assert "'rollouts' schema" in msg


def test_write_rejects_extra_column(tmp_path):
    df = rollouts_frame().with_columns(logprobs=pl.col("sampler_logprobs"))
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert "unexpected column(s) ['logprobs']" in msg


def test_write_rejects_float_list_where_int_list_expected(tmp_path):
    df = rollouts_frame().with_columns(pl.col("completion_token_ids").cast(pl.List(pl.Float64)))
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert "column 'completion_token_ids' has dtype List(Float64), expected List(Int32)" in msg


def test_write_does_not_cast_float_into_int_column(tmp_path):
    df = rollouts_frame().with_columns(pl.col("sample_idx").cast(pl.Float64))  # 0.0, 1.0: castable, still refused
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert "column 'sample_idx' has dtype Float64, expected Int32" in msg


def test_write_rejects_string_where_bool_expected(tmp_path):
    df = rollouts_frame().with_columns(pl.col("truncated").cast(pl.String))
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert "column 'truncated' has dtype String, expected Boolean" in msg


def test_write_rejects_null_in_non_nullable_column(tmp_path):
    df = rollouts_frame().with_columns(
        completion_text=pl.when(pl.col("prompt_id") == 0).then(None).otherwise(pl.col("completion_text")))
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert "column 'completion_text' has 2 null value(s) but may not be null" in msg


def test_write_rejects_all_null_key_column(tmp_path):
    df = rollouts_frame().with_columns(sample_idx=pl.lit(None))  # dtype Null
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert "column 'sample_idx' has 4 null value(s)" in msg


def test_write_accepts_nulls_in_nullable_columns(tmp_path):
    io.write_artifact(prompts_frame(), tmp_path / "p.parquet", PROMPTS)
    frame = io.read_artifact(tmp_path / "p.parquet", PROMPTS).frame
    assert frame["answer"].to_list() == ["2", None]


def test_write_rejects_duplicate_keys_showing_an_example(tmp_path):
    df = rollouts_frame()
    dup = pl.concat([df, df.filter((pl.col("prompt_id") == 1) & (pl.col("sample_idx") == 1))])
    msg = rejected_on_write(dup, ROLLOUTS, tmp_path)
    assert "1 duplicate key(s) on ['prompt_id', 'sample_idx'], e.g. {'prompt_id': 1, 'sample_idx': 1}" in msg


def test_write_rejects_per_token_list_one_token_short(tmp_path):
    df = rollouts_frame().with_columns(
        sampler_logprobs=pl.when((pl.col("prompt_id") == 1) & (pl.col("sample_idx") == 1))
        .then(pl.col("sampler_logprobs").list.head(2))
        .otherwise(pl.col("sampler_logprobs")))
    msg = rejected_on_write(df, ROLLOUTS, tmp_path)
    assert ("column 'sampler_logprobs' has 2 entries but 'completion_length' says 3 "
            "at key {'prompt_id': 1, 'sample_idx': 1} (1 row(s) affected)") in msg


def test_write_rejects_completion_token_ids_disagreeing_with_completion_length(tmp_path):
    at_0_1 = (pl.col("prompt_id") == 0) & (pl.col("sample_idx") == 1)
    df = eval_rollouts_frame().with_columns(
        completion_length=pl.when(at_0_1).then(pl.col("completion_length") + 1).otherwise(pl.col("completion_length")))
    msg = rejected_on_write(df, EVAL_ROLLOUTS, tmp_path)
    assert ("column 'completion_token_ids' has 1 entries but 'completion_length' says 2 "
            "at key {'prompt_id': 0, 'sample_idx': 1} (1 row(s) affected)") in msg


def test_write_rejects_per_token_lists_of_different_lengths_without_completion_length(tmp_path):
    df = train_token_stats_frame().with_columns(
        entropy=pl.when(pl.col("prompt_id") == 0).then(pl.col("entropy").list.tail(1)).otherwise(pl.col("entropy")))
    msg = rejected_on_write(df, TRAIN_TOKEN_STATS, tmp_path)
    # prompt 0: sample 0 has 3 tokens, sample 1 has 1 (tail(1) leaves it whole), so only (0, 0) is short.
    assert ("column 'entropy' has 1 entries but 'old_logprobs' says 3 at key {'prompt_id': 0, 'sample_idx': 0} "
            "(1 row(s) affected)") in msg


def test_nullable_per_token_column_may_be_null_but_not_the_wrong_length(tmp_path):
    ok = advantages_frame()  # returns: all null (GRPO)
    io.write_artifact(ok, tmp_path / "ok.parquet", ADVANTAGES)
    assert io.read_artifact(tmp_path / "ok.parquet", ADVANTAGES).frame["returns"].null_count() == 4
    at_0_0 = (pl.col("prompt_id") == 0) & (pl.col("sample_idx") == 0)
    bad = ok.with_columns(returns=pl.when(at_0_0).then(pl.col("token_advantages").list.slice(0, 1))
                          .otherwise(pl.col("token_advantages")))
    (tmp_path / "bad").mkdir()
    msg = rejected_on_write(bad, ADVANTAGES, tmp_path / "bad")
    assert "column 'returns' has 1 entries but 'token_advantages' says 3 at key {'prompt_id': 0, 'sample_idx': 0}" in msg


# ----------------------------------------------------------------------------------------------
# Rejections on read: files a foreign tool, an old rlpipe or a crash could have left
# ----------------------------------------------------------------------------------------------

def rejected_on_read(path: Path, schema: ArtifactSchema) -> str:
    with pytest.raises(ArtifactError) as exc:
        io.read_artifact(path, schema)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: ")
    return msg


def test_read_requires_exact_dtypes(tmp_path):
    """On read there is no cast: an Int64 sample_idx means another writer, which must be fixed."""
    df = rollouts_frame().with_columns(pl.col("sample_idx").cast(pl.Int64))
    path = write_raw(df, tmp_path / "r.parquet", meta_of(ROLLOUTS))
    assert "column 'sample_idx' has dtype Int64, expected Int32" in rejected_on_read(path, ROLLOUTS)


def test_read_rejects_float_list_where_int_list_expected(tmp_path):
    df = rollouts_frame().with_columns(pl.col("prompt_token_ids").cast(pl.List(pl.Float64)))
    path = write_raw(df, tmp_path / "r.parquet", meta_of(ROLLOUTS))
    assert "column 'prompt_token_ids' has dtype List(Float64), expected List(Int32)" in rejected_on_read(path, ROLLOUTS)


def test_read_rejects_missing_and_extra_columns(tmp_path):
    path = write_raw(rollouts_frame().drop("truncated"), tmp_path / "a.parquet", meta_of(ROLLOUTS))
    assert "missing column(s) ['truncated']" in rejected_on_read(path, ROLLOUTS)
    df = rollouts_frame().with_columns(logprobs=pl.col("sampler_logprobs"))
    path = write_raw(df, tmp_path / "b.parquet", meta_of(ROLLOUTS))
    assert "unexpected column(s) ['logprobs']" in rejected_on_read(path, ROLLOUTS)


def test_read_rejects_nulls_duplicates_and_short_lists(tmp_path):
    df = rollouts_frame().with_columns(policy_version=pl.when(pl.col("sample_idx") == 1).then(None)
                                       .otherwise(pl.col("policy_version")))
    path = write_raw(df, tmp_path / "a.parquet", meta_of(ROLLOUTS))
    assert "column 'policy_version' has 2 null value(s)" in rejected_on_read(path, ROLLOUTS)

    df = rollouts_frame().with_columns(sample_idx=pl.lit(0, dtype=pl.Int32))
    path = write_raw(df, tmp_path / "b.parquet", meta_of(ROLLOUTS))
    assert "2 duplicate key(s) on ['prompt_id', 'sample_idx'], e.g. {'prompt_id': 0, 'sample_idx': 0}" in \
        rejected_on_read(path, ROLLOUTS)

    at_0_0 = (pl.col("prompt_id") == 0) & (pl.col("sample_idx") == 0)
    df = rollouts_frame().with_columns(sampler_logprobs=pl.when(at_0_0).then(pl.col("sampler_logprobs").list.head(1))
                                       .otherwise(pl.col("sampler_logprobs")))
    path = write_raw(df, tmp_path / "c.parquet", meta_of(ROLLOUTS))
    assert ("column 'sampler_logprobs' has 1 entries but 'completion_length' says 3 "
            "at key {'prompt_id': 0, 'sample_idx': 0} (1 row(s) affected)") in rejected_on_read(path, ROLLOUTS)


def test_read_rejects_another_artifact_kind(tmp_path):
    path = io.write_artifact(scores_frame(), tmp_path / "scores.parquet", SCORES)
    assert "holds artifact 'scores', expected 'rollouts'" in rejected_on_read(path, ROLLOUTS)


@pytest.mark.parametrize("version", [SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, None, str(SCHEMA_VERSION)])
def test_read_rejects_another_schema_version(tmp_path, version):
    good = io.write_artifact(rollouts_frame(), tmp_path / "good.parquet", ROLLOUTS)
    table = pq.read_table(good)
    meta = json.loads(table.schema.metadata[METADATA_KEY.encode()])
    meta["schema_version"] = version
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), tmp_path / "old.parquet")
    msg = rejected_on_read(tmp_path / "old.parquet", ROLLOUTS)
    assert f"schema version {version} but this rlpipe reads version {SCHEMA_VERSION}" in msg
    assert "re-run the stage that produced it" in msg


def test_read_rejects_a_truncated_file(tmp_path):
    path = io.write_artifact(rollouts_frame(), tmp_path / "r.parquet", ROLLOUTS)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "not a readable Parquet file (truncated or corrupt?)" in rejected_on_read(path, ROLLOUTS)
    with pytest.raises(ArtifactError, match="not a readable Parquet file"):
        io.read_metadata(path)


def test_read_rejects_corrupt_data_pages_behind_an_intact_footer(tmp_path):
    n = 2000  # enough rows that the data pages, not the footer, make up the first half of the file
    df = pl.DataFrame({"prompt_id": range(n), "sample_idx": [0] * n, "reference_version": [0] * n,
                       "ref_logprobs": [[-float(i), -0.5] for i in range(n)]})
    path = io.write_artifact(df, tmp_path / "r.parquet", REF_LOGPROBS)
    data = bytearray(path.read_bytes())
    data[4: len(data) // 2] = b"\xab" * (len(data) // 2 - 4)  # keep the leading magic and the footer
    path.write_bytes(bytes(data))
    assert io.read_metadata(path)["artifact"] == "ref_logprobs"  # the footer alone still reads
    assert "not a readable Parquet file (truncated or corrupt?)" in rejected_on_read(path, REF_LOGPROBS)


def test_read_rejects_an_empty_file(tmp_path):
    path = tmp_path / "r.parquet"
    path.write_bytes(b"")
    assert "not a readable Parquet file (truncated or corrupt?)" in rejected_on_read(path, ROLLOUTS)


def test_read_rejects_a_missing_file(tmp_path):
    path = tmp_path / "nope.parquet"
    assert rejected_on_read(path, ROLLOUTS) == f"{path}: file not found"
    with pytest.raises(ArtifactError, match="file not found"):
        io.read_metadata(tmp_path)  # a directory is not an artifact either


def test_read_rejects_parquet_without_rlpipe_metadata(tmp_path):
    path = tmp_path / "r.parquet"
    rollouts_frame().write_parquet(path)
    assert "no rlpipe metadata in the Parquet footer" in rejected_on_read(path, ROLLOUTS)


@pytest.mark.parametrize("footer", ["artifact=rollouts", "[1, 2]"])
def test_read_rejects_rlpipe_metadata_that_is_not_a_json_object(tmp_path, footer):
    path = tmp_path / "r.parquet"
    table = rollouts_frame().to_arrow().replace_schema_metadata({METADATA_KEY: footer})
    pq.write_table(table, path)
    assert "not a JSON object" in rejected_on_read(path, ROLLOUTS)


def test_write_accepts_per_token_columns_polars_built_as_fixed_size_arrays(tmp_path):
    """Completions of one length (a model that never stops early) make polars build Array(Float32, n) columns;
    they are stored as the schema's List(Float32), and read back equal."""
    import numpy as np

    df = pl.DataFrame({"prompt_id": [0, 0], "sample_idx": [0, 1], "reference_version": [0, 0]},
                      schema_overrides={"sample_idx": pl.Int32}).with_columns(
        pl.Series("ref_logprobs", np.array([[-1.0, -2.0], [-3.0, -4.0]], dtype=np.float32)))
    assert isinstance(df.schema["ref_logprobs"], pl.Array)
    art = io.read_artifact(io.write_artifact(df, tmp_path / "ref.parquet", REF_LOGPROBS), REF_LOGPROBS)
    assert art.frame.schema["ref_logprobs"] == pl.List(pl.Float32)
    assert art.frame["ref_logprobs"].to_list() == [[-1.0, -2.0], [-3.0, -4.0]]


def test_write_rejects_int_that_does_not_fit_the_schema_width(tmp_path):
    df = ref_logprobs_frame().with_columns(pl.col("sample_idx").cast(pl.Int64) + 2**40)
    msg = rejected_on_write(df, REF_LOGPROBS, tmp_path)
    assert "sample_idx" in msg


# ----------------------------------------------------------------------------------------------
# join_on_keys
# ----------------------------------------------------------------------------------------------

def written(tmp_path: Path, name: str, df: pl.DataFrame) -> io.Artifact:
    schema = ARTIFACTS[name]
    return io.read_artifact(io.write_artifact(df, tmp_path / f"{name}.parquet", schema), schema)


def test_join_on_keys_returns_joined_frame_sorted_by_keys(tmp_path):
    roll = written(tmp_path, "rollouts", rollouts_frame())
    ref = written(tmp_path, "ref_logprobs", ref_logprobs_frame())
    ref = io.Artifact(frame=ref.frame.reverse(), metadata=ref.metadata, path=ref.path)  # order must not matter

    joined = io.join_on_keys(roll, ref)

    assert joined.columns == [*ROLLOUTS.column_names, "reference_version", "ref_logprobs"]
    assert joined.select("prompt_id", "sample_idx").rows() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert joined["ref_logprobs"].to_list() == [[-1.0, -0.5, -2.5], [-1.25], [-0.5, -0.5], [-0.25, -2.0, -1.0]]
    assert joined["completion_length"].to_list() == [3, 1, 2, 3]


def test_join_on_keys_brings_only_the_named_columns(tmp_path):
    roll = written(tmp_path, "rollouts", rollouts_frame())
    adv = written(tmp_path, "advantages", advantages_frame())
    joined = io.join_on_keys(roll, adv, columns=["token_advantages", "filtered_reason"])
    assert joined.columns == [*ROLLOUTS.column_names, "token_advantages", "filtered_reason"]
    assert joined["filtered_reason"].to_list() == [None, None, None, "truncated"]


def test_join_on_keys_rejects_keys_only_on_the_left(tmp_path):
    roll = written(tmp_path, "rollouts", rollouts_frame())
    ref = written(tmp_path, "ref_logprobs",
                  ref_logprobs_frame().filter(~((pl.col("prompt_id") == 1) & (pl.col("sample_idx") == 1))))
    with pytest.raises(ArtifactError) as exc:
        io.join_on_keys(roll, ref)
    msg = str(exc.value)
    assert f"keys do not match between {roll.path} and {ref.path}" in msg
    assert f"1 key(s) only in {roll.path}, e.g. {{'prompt_id': 1, 'sample_idx': 1}}" in msg
    assert f"only in {ref.path}" not in msg


def test_join_on_keys_rejects_keys_only_on_the_right(tmp_path):
    roll = written(tmp_path, "rollouts", rollouts_frame().filter(pl.col("prompt_id") == 1))
    ref = written(tmp_path, "ref_logprobs", ref_logprobs_frame())
    with pytest.raises(ArtifactError) as exc:
        io.join_on_keys(roll, ref)
    msg = str(exc.value)
    assert f"keys do not match between {roll.path} and {ref.path}" in msg
    assert f"2 key(s) only in {ref.path}, e.g. {{'prompt_id': 0, 'sample_idx': " in msg


def test_join_on_keys_rejects_per_token_length_mismatch(tmp_path):
    roll = written(tmp_path, "rollouts", rollouts_frame())
    # Valid on its own (ref_logprobs has no completion_length), wrong against the rollouts: (1, 1) one short.
    short = ref_logprobs_frame().with_columns(
        ref_logprobs=pl.when((pl.col("prompt_id") == 1) & (pl.col("sample_idx") == 1))
        .then(pl.col("ref_logprobs").list.head(2)).otherwise(pl.col("ref_logprobs")))
    ref = written(tmp_path, "ref_logprobs", short)
    with pytest.raises(ArtifactError) as exc:
        io.join_on_keys(roll, ref)
    assert str(exc.value) == (
        f"{ref.path}: column 'ref_logprobs' has 2 entries but the rollout has 3 completion tokens at key "
        "{'prompt_id': 1, 'sample_idx': 1} (1 row(s) affected)")


def test_join_of_tables_in_key_order_shares_the_columns_and_equals_the_join(tmp_path):
    roll = written(tmp_path, "rollouts", rollouts_frame())
    ref = written(tmp_path, "ref_logprobs", ref_logprobs_frame())
    aligned = io.join_on_keys(roll, ref, columns=["ref_logprobs"])  # both written sorted: side by side
    shuffled = io.join_on_keys(roll, ref.with_frame(ref.frame.reverse()), columns=["ref_logprobs"])  # a real join
    assert_frame_equal(aligned, shuffled)
    assert aligned["prompt_id"].flags["SORTED_ASC"] and shuffled["prompt_id"].flags["SORTED_ASC"]
    # the same keys in another order on both sides: joined and sorted, not put side by side
    few = roll.frame.select("prompt_id", "sample_idx", "completion_length")
    unsorted = io.join_on_keys(roll.with_frame(few.reverse()), ref.with_frame(ref.frame.reverse()),
                               columns=["ref_logprobs"])
    assert_frame_equal(unsorted, aligned.select(unsorted.columns))


def test_read_only_some_columns(tmp_path):
    path = io.write_artifact(rollouts_frame(), tmp_path / "r.parquet", ROLLOUTS, metadata={"policy_version": 3})
    art = io.read_artifact(path, ROLLOUTS, columns=["sampler_logprobs", "completion_length"])
    assert art.frame.columns == ["prompt_id", "sample_idx", "completion_length", "sampler_logprobs"]
    assert art.metadata["policy_version"] == 3
    assert art.frame["sampler_logprobs"].to_list() == [[-1.5, -0.5, -3.0], [-1.0], [-0.5, -0.25],
                                                       [-0.125, -2.0, -0.75]]
    with pytest.raises(ArtifactError, match=r"r.parquet: missing column\(s\) \['nope'\] required by the 'rollouts'"):
        io.read_artifact(path, ROLLOUTS, columns=["nope"])


def test_a_selective_read_still_checks_what_it_reads(tmp_path):
    bad = rollouts_frame().with_columns(pl.col("sampler_logprobs").list.head(1))  # one entry where 2-3 are due
    path = write_raw(bad, tmp_path / "r.parquet", meta_of(ROLLOUTS))
    with pytest.raises(ArtifactError, match="column 'sampler_logprobs' has 1 entries but 'completion_length' says"):
        io.read_artifact(path, ROLLOUTS, columns=["sampler_logprobs", "completion_length"])
    io.read_artifact(path, ROLLOUTS, columns=["completion_text"])  # the broken column is not read: no complaint


def test_validate_file_checks_every_batch_and_keys_across_batches(tmp_path):
    good = io.write_artifact(rollouts_frame(), tmp_path / "good.parquet", ROLLOUTS)
    meta, rows, columns = io.validate_file(good, ROLLOUTS, batch_rows=1)
    assert (meta["artifact"], rows, columns) == ("rollouts", 4, len(ROLLOUTS.column_names))
    # a key repeated in another batch of one row
    frame = rollouts_frame()
    dup = write_raw(pl.concat([frame, frame.head(1)]), tmp_path / "dup.parquet", meta_of(ROLLOUTS))
    with pytest.raises(ArtifactError, match=r"dup.parquet: 1 duplicate key\(s\) on \['prompt_id', 'sample_idx'\]"):
        io.validate_file(dup, ROLLOUTS, batch_rows=1)
    # the last row's list one entry short: found in its own batch
    short = frame.with_columns(pl.when(pl.col("sample_idx") == 1).then(pl.col("sampler_logprobs").list.head(0))
                               .otherwise(pl.col("sampler_logprobs")).alias("sampler_logprobs"))
    bad = write_raw(short, tmp_path / "short.parquet", meta_of(ROLLOUTS))
    with pytest.raises(ArtifactError, match="column 'sampler_logprobs' has 0 entries"):
        io.validate_file(bad, ROLLOUTS, batch_rows=1)
    empty = io.write_artifact(frame.head(0), tmp_path / "empty.parquet", ROLLOUTS)
    assert io.validate_file(empty, ROLLOUTS)[1] == 0


def test_a_streamed_read_holds_a_row_group_not_the_file(tmp_path):
    """pyarrow's pre-buffering kept every column chunk read until the file was closed: a streamed read of
    32 row groups then held all of them (validate at 1B tokens: 6.7 GiB). Now about one row group."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    rows, length = 256, 512
    frame = pl.DataFrame({"prompt_id": np.repeat(np.arange(rows // 16), 16),
                          "sample_idx": np.tile(np.arange(16), rows // 16),
                          "values": rng.normal(size=(rows, length)).astype(np.float32).tolist()},
                         schema={"prompt_id": pl.Int64, "sample_idx": pl.Int32, "values": TOKEN_FLOATS})
    parts = [frame.with_columns(pl.col("prompt_id") + rows // 16 * k) for k in range(32)]  # one row group each
    path = io.write_artifact_parts(parts, tmp_path / "values.parquet", VALUES,
                                   metadata={"policy_version": 0, "critic": "c"})
    parquet = pq.ParquetFile(path)
    assert parquet.num_row_groups == 32
    group_bytes = parquet.read_row_group(0).nbytes  # 0.5 MiB of floats
    stream = io.stream_artifact(path, VALUES, batch_rows=64)
    peak = 0
    for _ in stream.batches:
        peak = max(peak, pa.total_allocated_bytes())
    assert peak < 6 * group_bytes, f"{peak / 2**20:.1f} MiB held for row groups of {group_bytes / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------------
# Atomic writes
# ----------------------------------------------------------------------------------------------

def test_atomic_path_failure_keeps_previous_file_and_leaves_no_temp(tmp_path):
    final = tmp_path / "out.bin"
    final.write_bytes(b"old complete content")
    with pytest.raises(RuntimeError, match="boom"):
        with io.atomic_path(final) as tmp:
            assert tmp.parent == final.parent and tmp != final
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert final.read_bytes() == b"old complete content"
    assert only_file(tmp_path) == ["out.bin"]


def test_atomic_path_failure_without_previous_file_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with io.atomic_path(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert only_file(tmp_path) == []


def test_atomic_path_success_replaces_file(tmp_path):
    final = tmp_path / "out.bin"
    final.write_bytes(b"old")
    with io.atomic_path(final) as tmp:
        tmp.write_bytes(b"new")
        assert final.read_bytes() == b"old"  # readers see the old file until the rename
    assert final.read_bytes() == b"new"
    assert only_file(tmp_path) == ["out.bin"]


def test_atomic_path_replaces_a_directory(tmp_path):
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "old_weights.bin").write_bytes(b"old")
    (ckpt / "config.json").write_text("{}")
    with io.atomic_path(ckpt) as tmp:
        tmp.mkdir()
        (tmp / "new_weights.bin").write_bytes(b"new")
        assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "old_weights.bin"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["new_weights.bin"]
    assert (ckpt / "new_weights.bin").read_bytes() == b"new"
    assert only_file(tmp_path) == ["checkpoint"]  # neither the temp nor the old directory remains


def test_atomic_path_directory_failure_keeps_old_directory(tmp_path):
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "weights.bin").write_bytes(b"old")
    with pytest.raises(OSError):
        with io.atomic_path(ckpt) as tmp:
            tmp.mkdir()
            (tmp / "weights.bin").write_bytes(b"ne")
            raise OSError("disk full")
    assert [p.name for p in ckpt.iterdir()] == ["weights.bin"]
    assert (ckpt / "weights.bin").read_bytes() == b"old"
    assert only_file(tmp_path) == ["checkpoint"]


def test_atomic_path_clears_a_stale_temp_of_the_same_process(tmp_path):
    final = tmp_path / "out.bin"
    stale = final.with_name(f".out.bin.tmp-{os.getpid()}")
    stale.mkdir()  # e.g. an earlier failed directory write
    (stale / "junk").write_bytes(b"x")
    with io.atomic_path(final) as tmp:
        assert not tmp.exists()
        tmp.write_bytes(b"new")
    assert only_file(tmp_path) == ["out.bin"]


def test_write_artifact_failing_mid_write_keeps_the_old_artifact(tmp_path, monkeypatch):
    path = io.write_artifact(rollouts_frame(), tmp_path / "r.parquet", ROLLOUTS)
    before = path.read_bytes()

    real = pq.write_table
    monkeypatch.setattr(pq, "write_table", lambda table, where, **kw: _half(real, table, where, **kw))
    with pytest.raises(OSError, match="No space left"):
        io.write_artifact(rollouts_frame().head(2), path, ROLLOUTS)
    assert path.read_bytes() == before
    assert io.read_artifact(path, ROLLOUTS).frame.height == 4
    assert only_file(tmp_path) == ["r.parquet"]


def _half(real, table, where, **kwargs):
    buf = stdio.BytesIO()
    real(table, buf, **kwargs)
    Path(where).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    raise OSError("No space left on device")


# The child writes half of a real Parquet file to the temp path, says so, and waits to be SIGKILLed:
# no Python cleanup (finally / except) can run, exactly like an OOM kill or a pulled plug.
KILLED_WRITER = textwrap.dedent("""
    import io as stdio, sys, time
    from pathlib import Path
    import polars as pl
    import pyarrow.parquet as pq
    from rlpipe.data.io import write_artifact
    from rlpipe.data.schema import ROLLOUTS
    from rlpipe.stages.generate import single_turn_columns

    n = 5000
    df = single_turn_columns(pl.DataFrame({
        "prompt_id": list(range(n)), "sample_idx": [0] * n, "policy_version": [0] * n,
        "sample_seed": list(range(n)), "prompt_token_ids": [[1, 2, 3]] * n,
        "completion_token_ids": [[4, 5]] * n, "completion_text": ["xy"] * n, "completion_length": [2] * n,
        "sampler_logprobs": [[-0.5, -1.0]] * n, "finish_reason": ["stop"] * n, "truncated": [False] * n,
    }))
    real = pq.write_table

    def slow_write(table, where, **kwargs):
        buf = stdio.BytesIO()
        real(table, buf, **kwargs)
        with open(where, "wb") as fh:
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            fh.flush()
        print("HALF-WRITTEN", where, flush=True)
        time.sleep(60)
        Path(where).write_bytes(buf.getvalue())

    pq.write_table = slow_write
    write_artifact(df, sys.argv[1], ROLLOUTS)
""")


def kill_writer_mid_write(path: Path) -> Path:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("HALF-WRITTEN "), line
        temp = Path(line.split(" ", 1)[1].strip())
        assert temp.parent == path.parent and temp.stat().st_size > 0  # the write really was under way
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return temp


def test_killed_writer_leaves_no_artifact(tmp_path):
    path = tmp_path / "rollouts.parquet"
    kill_writer_mid_write(path)
    assert not path.exists()
    with pytest.raises(ArtifactError, match="file not found"):
        io.read_artifact(path, ROLLOUTS)


def test_killed_writer_leaves_the_old_artifact_intact(tmp_path):
    path = io.write_artifact(rollouts_frame(), tmp_path / "rollouts.parquet", ROLLOUTS, metadata={"policy_version": 0})
    before = path.read_bytes()
    kill_writer_mid_write(path)
    assert path.read_bytes() == before
    art = io.read_artifact(path, ROLLOUTS)
    assert art.frame.height == 4 and art.metadata["policy_version"] == 0
    # A rerun (another pid) writes over it cleanly.
    io.write_artifact(rollouts_frame().head(2), path, ROLLOUTS)
    assert io.read_artifact(path, ROLLOUTS).frame.height == 2


# ----------------------------------------------------------------------------------------------
# JSON beside the artifacts
# ----------------------------------------------------------------------------------------------

def test_write_json_sorted_keys_and_trailing_newline(tmp_path):
    path = tmp_path / "m" / "metrics.json"
    io.write_json(path, {"b": 1, "a": {"d": [1, 2.5], "c": None}})
    assert path.read_text() == '{\n  "a": {\n    "c": null,\n    "d": [\n      1,\n      2.5\n    ]\n  },\n  "b": 1\n}\n'
    assert io.read_json(path) == {"a": {"c": None, "d": [1, 2.5]}, "b": 1}
    again = tmp_path / "again.json"
    io.write_json(again, {"a": {"c": None, "d": [1, 2.5]}, "b": 1})
    assert again.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_write_json_rejects_non_finite_and_keeps_old_file(tmp_path, bad):
    path = tmp_path / "metrics.json"
    io.write_json(path, {"loss": 1.0})
    with pytest.raises(ValueError, match="not JSON compliant"):
        io.write_json(path, {"loss": bad})
    assert path.read_text() == '{\n  "loss": 1.0\n}\n'
    assert only_file(tmp_path) == ["metrics.json"]


def test_read_json_errors_name_the_file(tmp_path):
    with pytest.raises(ArtifactError, match=r"missing\.json: file not found"):
        io.read_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,')
    with pytest.raises(ArtifactError, match=r"bad\.json: not valid JSON"):
        io.read_json(bad)


def test_killed_writer_leftovers_are_cleaned_by_the_next_write(tmp_path):
    """A SIGKILLed writer leaves `.name.tmp-<pid>`; the next write of the same path removes it."""
    import subprocess
    import sys

    target = tmp_path / "out.json"
    child = subprocess.run([sys.executable, "-c", (
        "import os, pathlib\n"
        "from rlpipe.data.io import atomic_path\n"
        f"with atomic_path({str(target)!r}) as tmp:\n"
        "    tmp.write_text('half')\n"
        "    os.kill(os.getpid(), 9)\n")])
    assert child.returncode == -9
    leftovers = list(tmp_path.glob(".out.json.tmp-*"))
    assert len(leftovers) == 1 and not target.exists()
    io.write_json(target, {"a": 1})
    assert list(tmp_path.glob(".out.json.*")) == []
    assert json.loads(target.read_text()) == {"a": 1}


def test_parts_written_one_after_another_read_back_as_the_whole_table(tmp_path):
    """`write_artifact_parts` (rank 0 writing each rank's rows as they arrive) gives the table `write_artifact`
    gives: same rows, schema and footer; a read of rows [start, stop) returns exactly those rows."""
    frame = train_token_stats_frame().sort("prompt_id", "sample_idx")  # each rank's share is in key order
    whole = io.write_artifact(frame, tmp_path / "whole.parquet", TRAIN_TOKEN_STATS, metadata={"policy_version": 3})
    parts = io.write_artifact_parts([frame[0:1], frame[1:1], frame[1:4]], tmp_path / "parts.parquet",
                                    TRAIN_TOKEN_STATS, metadata={"policy_version": 3})
    a, b = io.read_artifact(whole, TRAIN_TOKEN_STATS), io.read_artifact(parts, TRAIN_TOKEN_STATS)
    assert_frame_equal(a.frame, b.frame)
    assert a.metadata == b.metadata and a.metadata["policy_version"] == 3
    assert pq.ParquetFile(parts).metadata.num_row_groups == 3
    for start, stop in ((0, 4), (1, 3), (3, 4), (2, 2)):
        got = io.read_artifact(parts, TRAIN_TOKEN_STATS, columns=["entropy"], rows=(start, stop)).frame
        assert_frame_equal(got, a.frame.select("prompt_id", "sample_idx", "entropy")[start:stop])


def test_parts_out_of_key_order_are_refused_and_nothing_is_written(tmp_path):
    frame = train_token_stats_frame().sort("prompt_id", "sample_idx")
    out = tmp_path / "stats.parquet"
    with pytest.raises(ArtifactError, match=r"parts overlap or are out of order"):
        io.write_artifact_parts([frame[2:4], frame[0:2]], out, TRAIN_TOKEN_STATS)
    with pytest.raises(ArtifactError, match=r"not sorted by its keys"):
        io.write_artifact_parts([frame.reverse()], out, TRAIN_TOKEN_STATS)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_large_tables_get_bounded_row_groups_and_a_share_reads_its_rows(tmp_path, monkeypatch):
    """Row groups hold about ROW_GROUP_BYTES of Arrow data (here made tiny), so a reader of rows [start, stop)
    decodes the groups that hold them; the rows read back are exactly those rows."""
    monkeypatch.setattr(io, "ROW_GROUP_BYTES", 2048)
    n = 5000
    frame = pl.DataFrame({"prompt_id": list(range(n)), "sample_idx": [0] * n,
                          "old_logprobs": [[-0.5] * (i % 7) for i in range(n)],
                          "entropy": [[1.0] * (i % 7) for i in range(n)],
                          "new_logprobs": [[-0.25] * (i % 7) for i in range(n)]},
                         schema=TRAIN_TOKEN_STATS.polars_schema())
    path = io.write_artifact(frame, tmp_path / "stats.parquet", TRAIN_TOKEN_STATS)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 5 and {meta.row_group(g).num_rows for g in range(4)} == {1024}
    got = io.read_artifact(path, TRAIN_TOKEN_STATS, rows=(1000, 3100)).frame
    assert_frame_equal(got, frame[1000:3100])
