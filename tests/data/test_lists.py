"""rlpipe.data.lists: list columns as flat arrays and back, per-row views, and TokenIds."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from rlpipe.data.lists import TokenIds, flat_values, list_column, row_arrays


def test_flat_values_reads_rows_in_order_skipping_nulls_and_respecting_slices():
    s = pl.Series("x", [[1.5, 2.0], [], None, [3.0]], dtype=pl.List(pl.Float32))
    assert flat_values(s, np.float64).tolist() == [1.5, 2.0, 3.0]
    assert flat_values(s.slice(1, 3), np.float64).tolist() == [3.0]
    two_chunks = pl.concat([s, pl.Series("x", [[4.0]], dtype=pl.List(pl.Float32))], rechunk=False)
    assert flat_values(two_chunks, np.float32).tolist() == [1.5, 2.0, 3.0, 4.0]
    mask = pl.Series("m", [[True, False], [True]], dtype=pl.List(pl.Boolean))
    assert flat_values(mask, bool).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="'x' has null entries inside its lists"):
        flat_values(pl.Series("x", [[1.0, None]]), np.float64)


def test_list_column_round_trip():
    s = list_column("a", np.array([1, 2, 3], np.float32), np.array([2, 0, 1]), pl.List(pl.Float32))
    assert s.dtype == pl.List(pl.Float32) and s.to_list() == [[1.0, 2.0], [], [3.0]]
    with pytest.raises(ValueError, match="'a': the lengths add up to 2, but 3 values"):
        list_column("a", np.zeros(3, np.float32), np.array([1, 1]), pl.List(pl.Float32))


def test_row_arrays_are_views_one_per_row():
    s = pl.Series("ids", [[5, 6, 7], [], [8]], dtype=pl.List(pl.Int32))
    rows = row_arrays(s, np.int64)
    assert [r.tolist() for r in rows] == [[5, 6, 7], [], [8]]
    assert rows[0].base is not None and rows[0].base is rows[2].base  # one buffer, no copy per row


def test_token_ids_behave_like_the_list_of_ints_they_stand_for():
    ids = TokenIds(np.array([3, 1, 4], dtype=np.int32))
    assert len(ids) == 3 and ids[0] == 3 and type(ids[0]) is int and ids[1:] == [1, 4]
    assert list(ids) == [3, 1, 4] and ids == [3, 1, 4] and ids == (3, 1, 4) and ids != [3, 1]
    assert json.dumps(list(ids)) == "[3, 1, 4]"  # Python ints, not numpy's
    assert repr(ids) == "TokenIds([3, 1, 4])"
    with pytest.raises(TypeError):
        hash(ids)
