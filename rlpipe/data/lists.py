"""Per-token list columns as flat numpy arrays, and back, without a Python object per token.

Why: a list column holds its tokens in one Arrow buffer (values) plus row offsets. Reading it with
``to_list()`` builds a Python list per row and an object per token (~40 bytes a token, 10x Arrow);
reading the values buffer gives the same numbers at their own size, in row order, ready for the
flat token math of `rlpipe.algorithms.ragged`.
"""
from __future__ import annotations

from collections.abc import Sequence

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


def row_arrays(column: pl.Series, dtype: type | np.dtype) -> list[np.ndarray]:
    """One array per row (a null row gives an empty one), each a view into the column's values read once.

    Why views: ``to_list()`` makes a Python object per token (~34 bytes a token where the table holds
    4); a reader that indexes rows pays a hundred bytes a row this way, nothing per token.
    """
    lengths = column.list.len().fill_null(0).to_numpy()
    return np.split(flat_values(column, dtype), np.cumsum(lengths)[:-1])


class TokenIds(Sequence):
    """One row's token ids as a read-only sequence of Python ints, over a view of the column's values.

    Why: a reward may read the ids (the reward model does), most never do; the score stage hands
    every reward this view, so the ids become Python ints only for the rows a reward reads.
    """

    __slots__ = ("_ids",)
    __hash__ = None  # like the list it stands for

    def __init__(self, ids: np.ndarray):
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[index].tolist()
        return int(self._ids[index])

    def __iter__(self):
        return iter(self._ids.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenIds, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"TokenIds({self._ids.tolist()})"
