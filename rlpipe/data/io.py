"""Read, write and join artifacts: validated against ``rlpipe.data.schema``, atomic, byte-deterministic.

Why so strict: stages run as separate processes, possibly on separate machines, and a silent
column mix-up (a list one token short, a duplicated key) corrupts training without an error.
Every write and every read checks the contract and names the file and column at fault.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.data.schema import METADATA_KEY, SCHEMA_VERSION, ArtifactSchema
from rlpipe.errors import ArtifactError

PARQUET_COMPRESSION = "zstd"
# Arrow bytes per Parquet row group, about. Why bounded: a reader of some rows (a training rank's share, a
# batch of a streamed stage) decodes whole row groups; pyarrow's default of 1Mi rows makes one group of
# a 67M-token table. Tables smaller than this stay one row group, byte for byte as before.
ROW_GROUP_BYTES = 64 * 2**20
MAX_GROUP_ROWS = 1024 * 1024  # pyarrow's default row group size


@dataclass(frozen=True)
class Artifact:
    """A validated table plus the rlpipe metadata stored in its Parquet footer."""

    frame: pl.DataFrame
    metadata: dict[str, Any]
    path: Path

    def with_frame(self, frame: pl.DataFrame) -> "Artifact":
        """The same artifact (footer, path) over another frame, e.g. one already joined with a second table."""
        return Artifact(frame=frame, metadata=self.metadata, path=self.path)


# ----------------------------------------------------------------------------------------------
# Atomic file system helpers
# ----------------------------------------------------------------------------------------------

def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success rename it into place, on failure remove it.

    Works for files and directories (a checkpoint). The rename is atomic on one file system, so a
    stage killed at any point leaves either the old complete output, or nothing, never a half file.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(final)
    tmp = _temp_sibling(final)
    remove_path(tmp)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        if final.is_dir() and not final.is_symlink():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        remove_path(tmp)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_siblings(final: Path) -> None:
    """Delete temp files/dirs left beside ``final`` by writers that were killed (their pid is gone)."""
    for prefix in (f".{final.name}.tmp-", f".{final.name}.old-"):
        for stale in final.parent.glob(prefix + "*"):
            pid = stale.name[len(prefix):]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                remove_path(stale)


def remove_path(path: Path) -> None:
    """Remove a file, a link or a whole directory tree, whichever ``path`` is; nothing if it is absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically with sorted keys, so equal data gives equal bytes."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


CHECKPOINT_INFO = "rlpipe.json"  # written beside config.json in every checkpoint rlpipe saves


def read_policy_version(model_dir: str | os.PathLike) -> int | None:
    """The policy version rlpipe stored in a checkpoint, or None for a model rlpipe did not write.

    Lives here, not in rlpipe.models.loading, so that `rlpipe iterate` can read it without importing torch.
    """
    f = Path(model_dir) / CHECKPOINT_INFO
    if not f.is_file():
        return None
    return int(json.loads(f.read_text())["policy_version"])


def require_critic_values(values: Artifact) -> Artifact:
    """Refuse a values table the values stage wrote without a critic (for an estimator other than gae): its
    footer's ``critic`` is null. Advantage and train both read the table."""
    if values.metadata.get("critic") is None:
        raise ArtifactError(f"{values.path}: holds no critic values (written for estimator "
                            f"{values.metadata.get('estimator')!r}); re-run the values stage for gae")
    return values


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"{p}: file not found")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{p}: not valid JSON ({e})") from None


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def _kind(dtype: pl.DataType) -> str:
    if dtype.is_integer():
        return "int"
    if dtype.is_float():
        return "float"
    if isinstance(dtype, (pl.List, pl.Array)):  # polars builds an Array when every row has the same length
        return "list[" + _kind(dtype.inner) + "]"
    if isinstance(dtype, pl.Struct):
        return "struct{" + ",".join(f"{f.name}:{_kind(f.dtype)}" for f in dtype.fields) + "}"
    return str(dtype)


def _conform(df: pl.DataFrame, schema: ArtifactSchema, source: str, *, allow_cast: bool,
             only: list[str] | None = None) -> pl.DataFrame:
    """Check columns and dtypes; return the frame in canonical column order and dtypes.

    On write, numeric widths are cast to the schema (a producer may hand Int64 where Int32 is
    stored) but never across kinds (float into int). On read, dtypes must match exactly.
    ``only``: the columns a selective read asked for (the keys among them); the others are not checked.
    """
    missing = [c for c in (schema.column_names if only is None else only) if c not in df.columns]
    if missing:
        raise ArtifactError(f"{source}: missing column(s) {missing} required by the {schema.name!r} schema")
    extra = [c for c in df.columns
             if c not in schema.column_by_name and not schema.is_dynamic(c) and not schema.is_user_column(c)]
    if extra:
        allowed = f" (or columns starting with {schema.dynamic_prefix!r})" if schema.dynamic_prefix else ""
        raise ArtifactError(
            f"{source}: unexpected column(s) {extra}; the {schema.name!r} schema has {schema.column_names}{allowed}")
    dynamic = [c for c in df.columns if schema.is_dynamic(c)]
    user = {c: df.schema[c] for c in df.columns if schema.is_user_column(c)}  # typed as the user's file has them
    expected = schema.polars_schema(dynamic, user)
    if only is not None:
        expected = {name: dtype for name, dtype in expected.items() if name in df.columns}
    columns = []
    for name, want in expected.items():
        have = df.schema[name]
        if have != want:
            same_kind = _kind(have) == _kind(want) or have == pl.Null
            if not (allow_cast and same_kind):
                raise ArtifactError(f"{source}: column {name!r} has dtype {have}, expected {want}")
        try:
            columns.append(df[name].cast(want))
        except pl.exceptions.PolarsError as e:
            raise ArtifactError(f"{source}: column {name!r} does not fit dtype {want}: {e}") from None
    out = pl.DataFrame(columns)
    for col in schema.columns:
        if not col.nullable and col.name in out.columns:
            nulls = out[col.name].null_count()
            if nulls:
                raise ArtifactError(f"{source}: column {col.name!r} has {nulls} null value(s) but may not be null")
    _check_unique_keys(out, schema.keys, source)
    _check_per_token_lengths(out, schema, source)
    return out


def _check_unique_keys(df: pl.DataFrame, keys: tuple[str, ...], source: str) -> None:
    dup = df.group_by(list(keys)).len().filter(pl.col("len") > 1)
    if dup.height:
        example = dup.sort(list(keys)).row(0, named=True)
        example.pop("len")
        raise ArtifactError(f"{source}: {dup.height} duplicate key(s) on {list(keys)}, e.g. {example}")


def _check_per_token_lengths(df: pl.DataFrame, schema: ArtifactSchema, source: str) -> None:
    """Every per-token list must have one entry per completion token."""
    cols = [c for c in schema.per_token_columns if c in df.columns]
    if "completion_length" in df.columns:
        reference = "completion_length"
        ref_len = pl.col("completion_length")
        if "completion_token_ids" in df.columns:
            cols = ["completion_token_ids", *cols]
    elif cols:
        reference = cols[0]
        ref_len = pl.col(cols[0]).list.len()
        cols = cols[1:]
    else:
        return
    for c in cols:
        bad = df.filter(pl.col(c).is_not_null() & (pl.col(c).list.len() != ref_len))
        if bad.height:
            row = bad.row(0, named=True)
            key = {k: row[k] for k in schema.keys}
            raise ArtifactError(
                f"{source}: column {c!r} has {len(row[c])} entries but {reference!r} says "
                f"{row[reference] if reference == 'completion_length' else len(row[reference])} "
                f"at key {key} ({bad.height} row(s) affected)")


def validate_frame(df: pl.DataFrame, schema: ArtifactSchema, *, source: str = "<frame>") -> pl.DataFrame:
    """Validate a frame as it would be read (exact dtypes); return it in canonical order."""
    return _conform(df, schema, source, allow_cast=False)


# ----------------------------------------------------------------------------------------------
# Read / write
# ----------------------------------------------------------------------------------------------

def write_artifact(df: pl.DataFrame, path: str | os.PathLike, schema: ArtifactSchema,
                   *, metadata: dict[str, Any] | None = None) -> Path:
    """Validate ``df``, sort it by the keys and write it atomically as Parquet.

    The bytes depend only on the data and ``metadata`` (sorted JSON in the footer), never on time,
    host or row order, so the same inputs and params give byte-identical files.
    """
    path = Path(path)
    out = sorted_by_keys(_conform(df, schema, f"{path} (being written)", allow_cast=True), schema.keys)
    table = _footed_table(out, schema, metadata)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression=PARQUET_COMPRESSION, row_group_size=rows_per_group(table))
    return path


def write_artifact_parts(parts: Iterable[pl.DataFrame], path: str | os.PathLike, schema: ArtifactSchema,
                         *, metadata: dict[str, Any] | None = None) -> Path:
    """Write frames one after another into one artifact, atomically, as `write_artifact` writes one frame.

    Why: under torchrun each rank holds its own rows' results; rank 0 writes them as they arrive, one
    rank's at a time, so no process ever holds the whole table. Each part must be sorted by the keys
    and come after the previous one (the ranks' contiguous shares are).
    """
    path = Path(path)
    last_key, writer = None, None
    with atomic_path(path) as tmp:
        try:
            for part in parts:
                out = _conform(part, schema, f"{path} (being written)", allow_cast=True)
                if not _keys_sorted(out, schema.keys):
                    raise ArtifactError(f"{path}: a part to write is not sorted by its keys {list(schema.keys)}")
                if out.height and last_key is not None and out.select(schema.keys).row(0) <= last_key:
                    raise ArtifactError(f"{path}: parts overlap or are out of order at key {last_key}")
                table = _footed_table(out, schema, metadata)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema, compression=PARQUET_COMPRESSION)
                writer.write_table(table, row_group_size=rows_per_group(table))
                last_key = out.select(schema.keys).row(-1) if out.height else last_key
        finally:
            if writer is not None:
                writer.close()
    return path


def _footed_table(out: pl.DataFrame, schema: ArtifactSchema, metadata: dict[str, Any] | None) -> pa.Table:
    """``out`` as the Arrow table rlpipe writes: the oldest string and list layouts, the footer metadata."""
    meta = {**(metadata or {}), "artifact": schema.name, "schema_version": SCHEMA_VERSION}
    table = out.to_arrow(compat_level=pl.CompatLevel.oldest())
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})


def _keys_sorted(df: pl.DataFrame, keys: tuple[str, ...]) -> bool:
    key_frame = df.select(keys)
    return key_frame.equals(key_frame.sort(list(keys)))


def rows_per_group(table: pa.Table) -> int:
    """Rows per row group for ``table``: about ROW_GROUP_BYTES of its Arrow data each (at least 1,024 rows,
    at most pyarrow's default); the number depends on the data alone, so the bytes stay reproducible."""
    if table.num_rows == 0:
        return MAX_GROUP_ROWS
    per_row = max(table.nbytes / table.num_rows, 1.0)
    return max(1024, min(MAX_GROUP_ROWS, int(ROW_GROUP_BYTES // per_row)))


def sorted_by_keys(df: pl.DataFrame, keys: tuple[str, ...]) -> pl.DataFrame:
    """``df`` sorted by its (unique) keys; the frame itself when it already is, as stages' outputs usually
    are: a sort gathers a copy of every column, gigabytes of token lists at scale."""
    return df if _keys_sorted(df, keys) else df.sort(list(keys))


def count_rows(path: str | os.PathLike) -> int:
    """The rows of a Parquet file, from its footer."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{path}: not a readable Parquet file (truncated or corrupt?): {e}") from None


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The rlpipe footer metadata of a Parquet file, without reading its rows."""
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"{p}: file not found")
    try:
        arrow_schema = pq.read_schema(p)
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{p}: not a readable Parquet file (truncated or corrupt?): {e}") from None
    raw = (arrow_schema.metadata or {}).get(METADATA_KEY.encode())
    if raw is None:
        raise ArtifactError(f"{p}: no rlpipe metadata in the Parquet footer; was it written by rlpipe?")
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise ArtifactError(f"{p}: the rlpipe metadata in the Parquet footer is not a JSON object")
    return meta


def _checked_metadata(p: Path, schema: ArtifactSchema) -> dict[str, Any]:
    """The footer of ``p``, refused when it names another artifact kind or schema version."""
    meta = read_metadata(p)
    if meta.get("artifact") != schema.name:
        raise ArtifactError(f"{p}: holds artifact {meta.get('artifact')!r}, expected {schema.name!r}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(
            f"{p}: schema version {meta.get('schema_version')} but this rlpipe reads version {SCHEMA_VERSION}; "
            "re-run the stage that produced it")
    return meta


def read_artifact(path: str | os.PathLike, schema: ArtifactSchema, *, columns: list[str] | None = None,
                  rows: tuple[int, int] | None = None) -> Artifact:
    """Read and validate an artifact; refuse another artifact kind or schema version.

    ``columns``: read only these (and the keys), and check only them. Why: a stage that needs 7 of the
    rollouts' 19 columns should not hold the token ids and texts it never looks at (at 67M tokens
    those are gigabytes). The frame then holds the keys first and the columns in schema order.
    ``rows``: only rows [start, stop) of the file (a training rank's share, `rlpipe.training.share`),
    read a batch at a time so that the rest of the file is never held.
    """
    p = Path(path)
    meta = _checked_metadata(p, schema)
    only = None if columns is None else list(dict.fromkeys([*schema.keys, *columns]))
    if only is not None:
        stored = pq.read_schema(p).names
        absent = [c for c in only if c not in stored]
        if absent:
            raise ArtifactError(f"{p}: missing column(s) {absent} required by the {schema.name!r} schema")
    try:  # polars' own reader: a third of the peak of pyarrow's read + conversion
        frame = pl.read_parquet(p, columns=only) if rows is None else _read_rows(p, only, *rows)
    except (pl.exceptions.PolarsError, pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{p}: not a readable Parquet file (truncated or corrupt?): {e}") from None
    return Artifact(frame=_conform(frame, schema, str(p), allow_cast=False, only=only), metadata=meta, path=p)


def _read_rows(p: Path, only: list[str] | None, start: int, stop: int) -> pl.DataFrame:
    """Rows [start, stop) of a Parquet file: polars decodes only the row groups that hold them."""
    scan = pl.scan_parquet(p)
    return (scan.select(only) if only is not None else scan).slice(start, stop - start).collect()


@dataclass(frozen=True)
class ArtifactStream:
    """An artifact read a batch of rows at a time: its footer, its row count, and the batches, each
    validated as `read_artifact` validates a whole table. Keys must be unique across batches too:
    the check runs once the last batch was read, so a consumer sees the error before it writes."""

    metadata: dict[str, Any]
    path: Path
    num_rows: int
    batches: Iterator[pl.DataFrame]


def stream_artifact(path: str | os.PathLike, schema: ArtifactSchema, *, columns: list[str] | None = None,
                    batch_rows: int = 65536) -> ArtifactStream:
    """Read an artifact as `read_artifact` does, ``batch_rows`` rows at a time (``columns`` as there).

    Why: the row-local stages and tools (score, `rlpipe validate`) then hold one batch, not the
    iteration, and run on a billion tokens on a machine that cannot hold them; only the key
    columns of every row are kept, for the uniqueness check.
    """
    p = Path(path)
    meta = _checked_metadata(p, schema)
    only = None if columns is None else list(dict.fromkeys([*schema.keys, *columns]))
    try:
        # pre_buffer off: pyarrow's pre-buffering keeps every row group's column chunks it read until the file
        # is closed, so a streamed read of a 1B-token table grew to the file's size (6.7 GiB for `validate`)
        parquet = pq.ParquetFile(p, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{p}: not a readable Parquet file (truncated or corrupt?): {e}") from None
    absent = [c for c in (only or []) if c not in parquet.schema_arrow.names]
    if absent:
        raise ArtifactError(f"{p}: missing column(s) {absent} required by the {schema.name!r} schema")
    return ArtifactStream(meta, p, parquet.metadata.num_rows, _batches(parquet, p, schema, only, batch_rows))


def _batches(parquet: pq.ParquetFile, p: Path, schema: ArtifactSchema, only: list[str] | None,
             batch_rows: int) -> Iterator[pl.DataFrame]:
    keys = []
    try:
        batches = parquet.iter_batches(batch_size=batch_rows, columns=only) if parquet.metadata.num_rows else None
        empty = parquet.schema_arrow.empty_table()
        for batch in batches or [empty.select(only) if only else empty]:
            frame = _conform(pl.from_arrow(batch), schema, str(p), allow_cast=False, only=only)
            keys.append(frame.select(schema.keys))
            yield frame
    except (pa.ArrowInvalid, OSError) as e:
        raise ArtifactError(f"{p}: not a readable Parquet file (truncated or corrupt?): {e}") from None
    _check_unique_keys(pl.concat(keys), schema.keys, str(p))


def validate_file(path: str | os.PathLike, schema: ArtifactSchema, *, batch_rows: int = 8192
                  ) -> tuple[dict[str, Any], int, int]:
    """Check a whole artifact, a batch of rows at a time (`stream_artifact`); return (footer, rows, columns)."""
    stream = stream_artifact(path, schema, batch_rows=batch_rows)
    columns = 0
    for frame in stream.batches:
        columns = frame.width
    return stream.metadata, stream.num_rows, columns


def read_table_file(path: str | os.PathLike, *, name: str | os.PathLike | None = None) -> pl.DataFrame:
    """Read a user's Parquet, JSONL or CSV file (prompt files), with a clear error if unreadable.

    ``name``: what the errors call the file (the user's own path, where ``path`` is a copy of it)."""
    p = Path(path)
    shown = p if name is None else name
    if not p.is_file():
        raise ArtifactError(f"{shown}: file not found")
    if p.stat().st_size == 0:
        raise ArtifactError(f"{shown}: the file is empty")
    try:
        if p.suffix == ".parquet":
            return pl.read_parquet(p)
        if p.suffix in (".jsonl", ".ndjson"):
            return pl.read_ndjson(p)
        if p.suffix == ".csv":
            return pl.read_csv(p, infer_schema=False)  # every column a string: "007" stays "007"
    except Exception as e:  # polars raises several types for malformed files
        raise ArtifactError(f"{shown}: could not be read: {e}") from None
    raise ArtifactError(f"{shown}: unsupported file type {p.suffix!r}; use .parquet, .jsonl or .csv")


# ----------------------------------------------------------------------------------------------
# Joins across artifacts
# ----------------------------------------------------------------------------------------------

def join_on_keys(left: Artifact, right: Artifact, *, keys: tuple[str, ...] = ("prompt_id", "sample_idx"),
                 columns: list[str] | None = None) -> pl.DataFrame:
    """Inner-join two artifacts on their keys; fail loudly if their key sets differ.

    ``columns`` picks the right-hand columns to bring in (default: all non-key columns).
    Per-token columns of the right side are checked against ``completion_length`` of the left.
    """
    rcols = columns if columns is not None else [c for c in right.frame.columns if c not in keys]
    lk = left.frame.select(keys)
    rk = right.frame.select(keys)
    only_left = lk.join(rk, on=list(keys), how="anti")
    only_right = rk.join(lk, on=list(keys), how="anti")
    if only_left.height or only_right.height:
        parts = []
        if only_left.height:
            parts.append(f"{only_left.height} key(s) only in {left.path}, e.g. {only_left.row(0, named=True)}")
        if only_right.height:
            parts.append(f"{only_right.height} key(s) only in {right.path}, e.g. {only_right.row(0, named=True)}")
        raise ArtifactError(f"keys do not match between {left.path} and {right.path}: " + "; ".join(parts))
    joined = _aligned(left.frame, lk, right.frame.select(rcols), rk, keys)
    if joined is None:
        joined = left.frame.join(right.frame.select([*keys, *rcols]), on=list(keys), how="inner").sort(list(keys))
    if "completion_length" in joined.columns:
        for c in rcols:
            if isinstance(joined.schema[c], pl.List):
                bad = joined.filter(pl.col(c).is_not_null() & (pl.col(c).list.len() != pl.col("completion_length")))
                if bad.height:
                    row = bad.row(0, named=True)
                    raise ArtifactError(
                        f"{right.path}: column {c!r} has {len(row[c])} entries but the rollout has "
                        f"{row['completion_length']} completion tokens at key "
                        f"{ {k: row[k] for k in keys} } ({bad.height} row(s) affected)")
    return joined


def _aligned(left: pl.DataFrame, lk: pl.DataFrame, right_columns: pl.DataFrame, rk: pl.DataFrame,
             keys: tuple[str, ...]) -> pl.DataFrame | None:
    """The two sides side by side when their keys already agree row by row in sorted order, else None.

    Why: every artifact is written sorted by its keys, so reading two tables of one iteration gives
    rows in the same order; putting the columns side by side shares their memory, where a join
    gathers a copy of every column and sorting it makes another.
    """
    if right_columns.width and (set(right_columns.columns) & set(left.columns)):
        return None
    if not lk.equals(rk) or not lk.equals(lk.sort(list(keys))):
        return None
    # the flag a sort leaves: polars takes its sorted-groups path in `over` and `group_by`, whose float
    # sums round differently from the hash path, so without it a statistic could move in the last bit
    return left.hstack(right_columns).with_columns(pl.col(keys[0]).set_sorted())
