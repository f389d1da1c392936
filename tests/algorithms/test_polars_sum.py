"""`PolarsSum` gives polars' own sum and mean of one chunk, bit for bit, whatever the pieces its values come in."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from rlpipe.algorithms.polars_sum import BLOCK, PolarsSum, block_nodes


def test_the_nodes_cover_the_blocks_as_polars_splits_them():
    assert block_nodes(5, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert block_nodes(5, 3) == [(0, 2), (2, 5)]  # 5 blocks split after 2
    assert block_nodes(0, 4) == []


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 70_001])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_pieces_give_polars_sum_and_mean(n, dtype):
    rng = np.random.default_rng(n)
    # values of very different sizes: the order of the additions shows in the last bits
    x = (rng.normal(size=n) * 10.0 ** rng.integers(-6, 7, size=n)).astype(dtype)
    # polars sums a float32 column in float32, but takes its mean over float64: the mean's sum is the one here
    want_sum, want_mean = pl.Series(x.astype(np.float64)).sum(), pl.Series(x).mean()
    for cuts in ([], [n // 3, n // 2], list(range(0, n, 97))):
        total = PolarsSum(n, cap=4 * BLOCK)
        for piece in np.split(x, cuts):
            total.add(piece)
        assert total.total() == want_sum
        assert total.mean() == want_mean or (n == 0 and total.mean() is None and want_mean is None)
    # a plain sequential or numpy sum differs from polars' on these values: the replica is not vacuous
    if n == 70_001:
        assert float(np.sum(x.astype(np.float64))) != want_sum


def test_too_many_or_too_few_values_are_refused():
    total = PolarsSum(3)
    total.add(np.ones(2))
    with pytest.raises(ValueError, match="given 2"):
        total.total()
    with pytest.raises(ValueError, match="given 5"):
        total.add(np.ones(3))
