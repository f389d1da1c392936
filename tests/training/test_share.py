"""A training rank's share: contiguous row blocks, and statistics of all ranks' rows found without moving them."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from rlpipe.errors import ConfigError
from rlpipe.training.share import quantile_over_ranks, share_bounds, sums_over_ranks


def on_ranks(work, world: int) -> list:
    """Run ``work(rank, gather)`` on ``world`` threads whose ``gather`` behaves like Dist.gather."""
    slots, results = [None] * world, [None] * world
    barrier = threading.Barrier(world)

    def gather_of(rank):
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            every = list(slots)
            barrier.wait()
            return every
        return gather

    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, work(r, gather_of(r))))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_shares_are_contiguous_blocks_that_differ_by_at_most_one_row():
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [share_bounds(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError, match=r"3 rollout\(s\) for 4 training ranks"):
        share_bounds(3, 0, 4)


def test_the_quantile_over_ranks_is_numpys_quantile_of_all_values_bit_for_bit():
    """Hand case: H = [0.1, 0.4, 0.2, 0.9, 0.5] split [0.1, 0.4] | [] | [0.2, 0.9, 0.5], rho 0.4 -> 0.44
    (ALGORITHMS.md's 80/20 threshold example); then random splits with ties, negatives and -0.0."""
    parts = [np.array([0.1, 0.4]), np.zeros(0), np.array([0.2, 0.9, 0.5])]
    got = on_ranks(lambda r, gather: quantile_over_ranks(parts[r], 0.6, gather), 3)
    assert got == [pytest.approx(0.44)] * 3 and got[0] == float(np.quantile(np.concatenate(parts), 0.6))
    rng = np.random.default_rng(0)
    for trial in range(60):
        values = rng.exponential(size=int(rng.integers(1, 40))).astype(np.float32).astype(np.float64)
        if trial % 3 == 0:
            values = np.round(values, 1)  # ties
        if trial % 4 == 0:
            values[: len(values) // 2] *= -1
            values[0] = -0.0
        world = int(rng.integers(1, 4))
        split = np.split(values, np.sort(rng.integers(0, len(values) + 1, size=world - 1)))
        q = float(rng.choice([0.0, 0.2, 0.5, 0.8, 1.0, rng.random()]))
        got = on_ranks(lambda r, gather: quantile_over_ranks(split[r], q, gather), world)
        assert got == [float(np.quantile(values, q))] * world, (trial, q)


def test_no_values_anywhere_give_an_infinite_threshold_and_sums_combine_by_key():
    assert on_ranks(lambda r, gather: quantile_over_ranks(np.zeros(0), 0.8, gather), 2) == [np.inf, np.inf]
    parts = [{"count": 2, "sum": 1.5, "diff_max": 0.25, "weight_min": 0.5},
             {"count": 3, "sum": -0.5, "diff_max": 0.75, "weight_min": 0.125}]
    assert on_ranks(lambda r, gather: sums_over_ranks(parts[r], gather), 2) == [
        {"count": 5, "sum": 1.0, "diff_max": 0.75, "weight_min": 0.125}] * 2
