"""`StreamedSum` is numpy's sum of the whole array, bit for bit, whatever pieces the values arrive in."""
from __future__ import annotations

import numpy as np
import pytest

from rlpipe.algorithms.pairwise_sum import StreamedSum, leaves, split_point


def test_the_tree_splits_where_numpy_does():
    assert split_point(300) == 144 and split_point(129) == 64 and split_point(1000) == 496
    assert leaves(1000, 504) == [(0, 496), (496, 1000)]  # the right half holds 504
    assert leaves(1000, 300) == [(0, 248), (248, 496), (496, 744), (744, 1000)]
    assert leaves(100, 128) == [(0, 100)]
    with pytest.raises(ValueError, match="cap must be at least 128"):
        leaves(1000, 64)


def test_a_hand_case_where_order_matters():
    """1e16, 1, -1e16 and 1: a left-to-right sum gives 1.0 (1e16 + 1 rounds back to 1e16); numpy's sum of
    these 4 (one loop, one accumulator) gives the same, and so must the streamed sum, piece by piece."""
    values = np.array([1e16, 1.0, -1e16, 1.0])
    s = StreamedSum(4, cap=128)
    for v in values:
        s.add(np.array([v]))
    assert s.total() == np.sum(values) == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_random_arrays_in_random_pieces_give_numpys_sum_exactly(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n = int(rng.integers(0, 200_000))
        values = rng.normal(size=n) * 10.0 ** rng.integers(-8, 9, size=n)  # magnitudes that round differently
        cap = int(rng.choice([128, 1000, 4096, 65536]))
        s = StreamedSum(n, cap=cap)
        cuts = np.sort(rng.integers(0, n + 1, size=int(rng.integers(0, 30))))
        for piece in np.split(values, cuts):
            s.add(piece)
        assert s.total() == np.sum(values), (n, cap)


def test_too_many_or_too_few_values_are_refused():
    s = StreamedSum(3, cap=128)
    s.add(np.ones(2))
    with pytest.raises(ValueError, match="given 2"):
        s.total()
    with pytest.raises(ValueError, match="given 4"):
        s.add(np.ones(2))


@pytest.mark.parametrize("form", ["std", "unbiased_rsqrt", "population_rsqrt"])
def test_whitening_in_pieces_is_ragged_whiten_of_the_whole_bit_for_bit(form):
    from rlpipe.algorithms import ragged
    from rlpipe.algorithms.streamed_sum import whitening

    rng = np.random.default_rng(7)
    for trial in range(30):
        n = int(rng.integers(0, 50_000))
        x = rng.normal(size=n) * 10.0 ** rng.integers(-4, 5, size=n)
        m = rng.random(n) < rng.random()
        if trial % 7 == 0:
            x[~m] = np.nan  # masked-out values never leak
        if trial % 5 == 0:
            x[m] = 3.0  # all valid tokens equal
        cuts = np.sort(rng.integers(0, n + 1, size=int(rng.integers(0, 12))))
        pieces = lambda: zip(np.split(x, cuts), np.split(m, cuts))  # noqa: E731
        eps = float(rng.choice([0.0, 1e-8]))
        w = whitening(pieces, form=form, eps=eps, cap=int(rng.choice([128, 4096])))
        streamed = np.concatenate([w.apply(a, b) for a, b in pieces()] or [np.zeros(0)])
        whole = ragged.whiten(x, m, form=form, eps=eps)
        assert streamed.tobytes() == whole.tobytes(), (trial, n)
