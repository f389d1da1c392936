"""`rlpipe validate FILE`: exit 0 with the artifact's name and size, or exit 2 with the column at fault."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.data.io import write_artifact
from rlpipe.data.schema import METADATA_KEY, REF_LOGPROBS, SCHEMA_VERSION, SCORES

runner = CliRunner()


def ref_logprobs_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "prompt_id": [0, 0, 1],
            "sample_idx": [0, 1, 0],
            "reference_version": [0, 0, 0],
            "ref_logprobs": [[-0.5, -1.0], [-0.25], [-2.0, -0.5, -0.125]],
        },
        schema=REF_LOGPROBS.polars_schema(),
    )


def write_raw(df: pl.DataFrame, path: Path, meta: dict) -> Path:
    """A file another tool wrote: correct rlpipe footer, contents never checked."""
    pq.write_table(df.to_arrow().replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), path)
    return path


def validate(path: Path):
    return runner.invoke(app, ["validate", str(path)])


def test_valid_file(tmp_path):
    path = write_artifact(ref_logprobs_frame(), tmp_path / "ref.parquet", REF_LOGPROBS)
    result = validate(path)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{path}: valid 'ref_logprobs' artifact (schema v{SCHEMA_VERSION}), 3 rows, 4 columns\n"


def test_valid_file_with_dynamic_columns(tmp_path):
    df = pl.DataFrame({"prompt_id": [0, 1], "sample_idx": [0, 0], "reward": [1.0, 0.0], "correct": [True, None],
                       "score_error": [None, None], "reward_exact_answer": [1.0, 0.0]})
    path = write_artifact(df, tmp_path / "scores.parquet", SCORES)
    result = validate(path)
    assert result.exit_code == 0, result.output
    assert "valid 'scores' artifact" in result.stdout and "2 rows, 6 columns" in result.stdout


def test_wrong_dtype_column_exits_2_naming_the_column(tmp_path):
    df = ref_logprobs_frame().with_columns(pl.col("ref_logprobs").cast(pl.List(pl.Float64)))
    path = write_raw(df, tmp_path / "ref.parquet", {"artifact": "ref_logprobs", "schema_version": SCHEMA_VERSION})
    result = validate(path)
    assert result.exit_code == 2
    assert result.stderr == (f"rlpipe: error: {path}: column 'ref_logprobs' has dtype List(Float64), "
                             "expected List(Float32)\n")
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda df: df.rename({"ref_logprobs": "logprobs"}), "missing column(s) ['ref_logprobs']"),
        (lambda df: df.with_columns(logprobs=pl.col("ref_logprobs")), "unexpected column(s) ['logprobs']"),
        (lambda df: df.with_columns(sample_idx=pl.lit(0, dtype=pl.Int32)),
         "duplicate key(s) on ['prompt_id', 'sample_idx'], e.g. {'prompt_id': 0, 'sample_idx': 0}"),
        (lambda df: df.with_columns(reference_version=pl.lit(None, dtype=pl.Int64)),
         "column 'reference_version' has 3 null value(s)"),
    ],
)
def test_invalid_contents_exit_2(tmp_path, change, fragment):
    path = write_raw(change(ref_logprobs_frame()), tmp_path / "ref.parquet",
                     {"artifact": "ref_logprobs", "schema_version": SCHEMA_VERSION})
    result = validate(path)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"rlpipe: error: {path}: ")
    assert fragment in result.stderr


def test_unknown_artifact_name_exits_2(tmp_path):
    path = write_raw(ref_logprobs_frame(), tmp_path / "x.parquet", {"artifact": "logits", "schema_version": 1})
    result = validate(path)
    assert result.exit_code == 2
    assert "unknown artifact 'logits'; known: advantages, " in result.stderr


def test_old_schema_version_exits_2(tmp_path):
    path = write_raw(ref_logprobs_frame(), tmp_path / "x.parquet",
                     {"artifact": "ref_logprobs", "schema_version": SCHEMA_VERSION + 1})
    result = validate(path)
    assert result.exit_code == 2
    assert f"schema version {SCHEMA_VERSION + 1} but this rlpipe reads version {SCHEMA_VERSION}" in result.stderr


def test_missing_truncated_and_foreign_files_exit_2(tmp_path):
    missing = tmp_path / "missing.parquet"
    result = validate(missing)
    assert (result.exit_code, result.stderr) == (2, f"rlpipe: error: {missing}: file not found\n")

    truncated = write_artifact(ref_logprobs_frame(), tmp_path / "t.parquet", REF_LOGPROBS)
    truncated.write_bytes(truncated.read_bytes()[:100])
    result = validate(truncated)
    assert result.exit_code == 2 and "not a readable Parquet file" in result.stderr

    foreign = tmp_path / "foreign.parquet"
    ref_logprobs_frame().write_parquet(foreign)
    result = validate(foreign)
    assert result.exit_code == 2 and "no rlpipe metadata in the Parquet footer" in result.stderr


def test_missing_argument_is_a_usage_error():
    result = runner.invoke(app, ["validate"])
    assert result.exit_code == 2
    assert "Missing argument 'path'" in result.output
