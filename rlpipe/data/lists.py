"""Per-token list columns as flat numpy arrays, and back, without a Python object per token.

Why: a list column holds its tokens in one Arrow buffer (values) plus row offsets. Reading it with
``to_list()`` builds a Python list per row and an object per token (~40 bytes a token, 10x Arrow);
reading the values buffer gives the same numbers at their own size, in row order, ready for the
flat token math of `rlpipe.algorithms.ragged`.
"""
from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc


def flat_values(column: pl.Series, dtype: type | np.dtype) -> np.ndarray:
    """Every entry of a list column, rows one after another (null rows contribute nothing)."""
    arrow = column.to_arrow()
    if isinstance(arrow, pa.ChunkedArray):
        arrow = arrow.combine_chunks() if arrow.num_chunks != 1 else arrow.chunk(0)
    values = pc.list_flatten(arrow)
    if values.null_count:
        raise ValueError(f"column {column.name!r} has null entries inside its lists")
    return values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def list_column(name: str, values_N: np.ndarray, lengths_B: np.ndarray, dtype: pl.DataType) -> pl.Series:
    """A list column whose row i holds the next ``lengths_B[i]`` entries of ``values_N``."""
    offsets = np.zeros(len(lengths_B) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths_B, dtype=np.int64), out=offsets[1:])
    if offsets[-1] != len(values_N):
        raise ValueError(f"column {name!r}: the lengths add up to {offsets[-1]}, but {len(values_N)} values were given")
    arrow = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values_N))
    return pl.Series(name, arrow).cast(dtype)
