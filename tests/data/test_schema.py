"""rlpipe.data.schema: the contract itself is consistent, and files written under it read back with exactly its dtypes."""
from __future__ import annotations

import polars as pl
import pytest

from rlpipe.data import io
from rlpipe.data.schema import (
    ARTIFACTS,
    ROLLOUTS,
    SCORES,
    TOKEN_FLOATS,
    TOKEN_IDS,
    TOKEN_MASK,
    TOOL_CALL,
    ArtifactSchema,
    get_schema,
)
from rlpipe.errors import ArtifactError

NAMES = sorted(ARTIFACTS)


def test_artifact_registry_is_keyed_by_name():
    assert NAMES == ["advantages", "eval_rollouts", "preferences", "prompts", "ref_logprobs", "rollouts", "scores",
                     "train_token_stats", "values"]
    for name, schema in ARTIFACTS.items():
        assert schema.name == name
        assert get_schema(name) is schema


def test_get_schema_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="unknown artifact 'rollout'; known: advantages, eval_rollouts, preferences, prompts"):
        get_schema("rollout")


@pytest.mark.parametrize("name", NAMES)
def test_keys_are_non_nullable_columns(name):
    schema = ARTIFACTS[name]
    assert schema.keys, "every artifact needs a key"
    for key in schema.keys:
        assert key in schema.column_names
        assert not schema.column_by_name[key].nullable
    assert schema.column_by_name["prompt_id"].dtype == pl.Int64
    if "sample_idx" in schema.keys:
        assert schema.keys == ("prompt_id", "sample_idx")
        assert schema.column_by_name["sample_idx"].dtype == pl.Int32


@pytest.mark.parametrize("name", NAMES)
def test_column_names_are_unique_and_documented(name):
    schema = ARTIFACTS[name]
    assert len(schema.column_names) == len(set(schema.column_names))
    assert set(schema.column_by_name) == set(schema.column_names)
    for col in schema.columns:
        assert col.doc.strip(), f"{name}.{col.name} has no doc"
    assert "logprobs" not in schema.column_names  # log-probs always say whose they are


@pytest.mark.parametrize("name", NAMES)
def test_per_token_columns_are_token_lists(name):
    schema = ARTIFACTS[name]
    for col in schema.columns:
        if col.per_token:
            assert col.dtype in (TOKEN_FLOATS, TOKEN_IDS, TOKEN_MASK), f"{name}.{col.name}: {col.dtype}"
        if col.name.endswith("logprobs"):
            assert col.per_token and col.dtype == pl.List(pl.Float32)
        if col.name.endswith("token_ids"):
            assert col.dtype == pl.List(pl.Int32)


def test_only_scores_has_dynamic_columns():
    assert {n for n, s in ARTIFACTS.items() if s.dynamic_prefix} == {"scores"}
    assert SCORES.dynamic_prefix == "reward_" and SCORES.dynamic_dtype == pl.Float64
    assert SCORES.is_dynamic("reward_exact_answer")
    assert not SCORES.is_dynamic("reward")  # the weighted sum is a fixed column
    assert not ROLLOUTS.is_dynamic("reward_x")


def test_polars_schema_appends_dynamic_columns_sorted():
    got = SCORES.polars_schema(["reward_z", "reward_a"])
    assert got == pl.Schema([("prompt_id", pl.Int64), ("sample_idx", pl.Int32), ("reward", pl.Float64),
                             ("correct", pl.Boolean), ("score_error", pl.String),
                             ("reward_a", pl.Float64), ("reward_z", pl.Float64)])


# ----------------------------------------------------------------------------------------------
# Schema of written files: generated from the schema itself, so a new column is covered automatically
# ----------------------------------------------------------------------------------------------

LENGTHS = [3, 1, 2]  # completion tokens of the three generated rows


def _value(dtype: pl.DataType, row: int, length: int):
    if dtype == pl.List(pl.Int32):
        return [row + t for t in range(length)]
    if dtype == pl.List(pl.Float32):
        return [-0.5 * (t + 1) for t in range(length)]
    if dtype == TOKEN_MASK:
        return [t % 2 == 0 for t in range(length)]
    if dtype == pl.List(pl.String):
        return [f"turn {row}"]
    if dtype == pl.List(pl.Float64):
        return [0.5 * row, None]
    if dtype == pl.List(TOOL_CALL):
        return [{"turn": 0, "name": "add", "arguments": '{"a": 1}', "status": "ok", "result": str(row)}][:row]
    if dtype == pl.Boolean:
        return row % 2 == 0
    if dtype == pl.String:
        return f"text {row}"
    if dtype.is_integer():
        return row
    if dtype.is_float():
        return 0.25 * row
    raise AssertionError(f"no generator for {dtype}")


def generated_frame(schema: ArtifactSchema, *, polars_defaults: bool = False,
                    dynamic: list[str] = ()) -> pl.DataFrame:
    """Three valid rows; nullable columns get a null in row 0.

    With ``polars_defaults`` the frame has the dtypes polars infers from Python values (Int64, Float64,
    List(Int64), ...), as a producer would naturally hand them to write_artifact.
    """
    data = {}
    for col in schema.columns:
        values = []
        for row, length in enumerate(LENGTHS):
            if col.name == "prompt_id":
                values.append(row)
            elif col.name == "sample_idx":
                values.append(0)
            elif col.name == "completion_length":
                values.append(length)
            elif col.nullable and row == 0:
                values.append(None)
            else:
                values.append(_value(col.dtype, row, length))
        data[col.name] = values
    for name in dynamic:
        data[name] = [0.5, None, 1.0]
    if polars_defaults:
        return pl.DataFrame(data)
    return pl.DataFrame(data, schema=schema.polars_schema(list(dynamic)))


@pytest.mark.parametrize("name", NAMES)
def test_written_then_read_schema_is_the_canonical_polars_schema(tmp_path, name):
    schema = ARTIFACTS[name]
    path = io.write_artifact(generated_frame(schema), tmp_path / f"{name}.parquet", schema)
    art = io.read_artifact(path, schema)
    assert art.frame.schema == schema.polars_schema()
    assert art.frame.height == 3


@pytest.mark.parametrize("name", NAMES)
def test_polars_default_dtypes_are_stored_as_the_schema_widths(tmp_path, name):
    schema = ARTIFACTS[name]
    df = generated_frame(schema, polars_defaults=True)
    assert df.schema != schema.polars_schema()  # e.g. Int64 prompt_token_ids / sample_idx: a cast is exercised
    path = io.write_artifact(df, tmp_path / f"{name}.parquet", schema)
    assert io.read_artifact(path, schema).frame.schema == schema.polars_schema()


def test_dynamic_reward_columns_are_accepted_and_typed_float64(tmp_path):
    df = generated_frame(SCORES, dynamic=["reward_format", "reward_exact_answer"])
    df = df.with_columns(pl.col("reward_format").cast(pl.Float32))  # a narrower float is widened
    path = io.write_artifact(df, tmp_path / "scores.parquet", SCORES)
    frame = io.read_artifact(path, SCORES).frame
    assert frame.schema == SCORES.polars_schema(["reward_exact_answer", "reward_format"])
    assert frame.schema["reward_format"] == pl.Float64
    assert frame.columns[-2:] == ["reward_exact_answer", "reward_format"]
    assert frame["reward_format"].to_list() == [0.5, None, 1.0]  # null allowed: the row errored


def test_dynamic_reward_column_of_the_wrong_kind_is_rejected(tmp_path):
    df = generated_frame(SCORES).with_columns(reward_flag=pl.lit(True))
    with pytest.raises(ArtifactError, match="column 'reward_flag' has dtype Boolean, expected Float64"):
        io.write_artifact(df, tmp_path / "scores.parquet", SCORES)


def test_other_extra_columns_on_scores_are_rejected_naming_the_prefix(tmp_path):
    df = generated_frame(SCORES, dynamic=["reward_ok"]).with_columns(bonus=pl.lit(1.0))
    with pytest.raises(ArtifactError) as exc:
        io.write_artifact(df, tmp_path / "scores.parquet", SCORES)
    msg = str(exc.value)
    assert "unexpected column(s) ['bonus']" in msg
    assert "(or columns starting with 'reward_')" in msg
    assert not (tmp_path / "scores.parquet").exists()


def test_reward_prefixed_columns_are_not_allowed_elsewhere(tmp_path):
    df = generated_frame(ROLLOUTS).with_columns(reward_exact=pl.lit(1.0))
    with pytest.raises(ArtifactError) as exc:
        io.write_artifact(df, tmp_path / "rollouts.parquet", ROLLOUTS)
    assert "unexpected column(s) ['reward_exact']" in str(exc.value)
    assert "starting with" not in str(exc.value)


def test_schema_doctests_pass():
    """component_column's examples: a reward's name -> its SCORES column."""
    import doctest

    from rlpipe.data import schema

    result = doctest.testmod(schema)
    assert result.attempted >= 2 and result.failed == 0
