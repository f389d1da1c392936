"""Under torchrun each rank holds only its share of the iteration: a contiguous block of rows it owns.

Why: every rank reading the whole iteration costs (ranks per node) x the iteration in host memory
(8 ranks x 10 GiB at 67M tokens, 8 x 150 GiB at 1B). A rank reads rows [start, stop) of each table
(`rlpipe.data.io.read_artifact(rows=)`), computes pi_old's log-probs of those rows only and trains
the micro-batches cut from them. What every rank knows of every row is three small numbers
(`RowShare`: trainable, policy tokens, sequence length), enough to draw one process's shuffles and
minibatches and to count a step's tokens and sequences for the loss normalisers. Statistics over all
rows (the 80/20 entropy threshold, the metrics) are combined from per-rank partial results;
`quantile_over_ranks` gives numpy's quantile of the union exactly, without gathering the values.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlpipe.distributed import contiguous_blocks
from rlpipe.errors import ConfigError
from rlpipe.training.objective import TrainingData

Gather = Callable[[Any], list[Any]]  # an object of every rank, in rank order (Dist.gather)


def share_bounds(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of ``rank``: contiguous blocks whose sizes differ by at most one row."""
    if num_rows < world_size:
        raise ConfigError(f"{num_rows} rollout(s) for {world_size} training ranks: every rank needs at least one row "
                          "(run fewer processes, or generate more rollouts)")
    return contiguous_blocks(num_rows, world_size)[rank]


@dataclass(frozen=True)
class RowShare:
    """This rank's rows [start, stop) of the iteration, and what every rank knows of every row."""

    start: int
    stop: int
    trainable: np.ndarray  # bool [N]: the advantage stage kept the row and it has a policy token
    policy_tokens: np.ndarray  # int64 [N]: the tokens of the row that enter the loss
    lengths: np.ndarray  # int64 [N]: prompt + completion tokens (the no-grad batches' budget)

    def mine(self, rows: np.ndarray) -> np.ndarray:
        """The local indices of the global ``rows`` this rank owns, in their order."""
        rows = np.asarray(rows)
        return rows[(rows >= self.start) & (rows < self.stop)] - self.start


def share_rows(data: TrainingData, start: int, stop: int, gather: Gather) -> TrainingData:
    """``data`` (this rank's rows [start, stop)) with its `RowShare`: the per-row numbers of every rank."""
    local = (np.asarray(data.trainable, dtype=bool),
             np.array([data.policy_tokens(i) for i in range(len(data.prompt_token_ids))], dtype=np.int64),
             np.array([len(p) + len(c) for p, c in zip(data.prompt_token_ids, data.completion_token_ids)],
                      dtype=np.int64))
    parts = gather(local)
    trainable, policy_tokens, lengths = (np.concatenate([part[k] for part in parts]) for k in range(3))
    data.rows = RowShare(start, stop, trainable, policy_tokens, lengths)
    return data


def take_share(data: TrainingData, rank: int, world_size: int, gather: Gather) -> TrainingData:
    """This rank's share of a whole iteration's data (the rows it owns), as `share_rows` marks it."""
    start, stop = share_bounds(len(data.prompt_token_ids), rank, world_size)
    sliced = {}
    for field in dataclasses.fields(data):
        value = getattr(data, field.name)
        sliced[field.name] = value[start:stop] if isinstance(value, (list, np.ndarray)) else value
    return share_rows(TrainingData(**sliced), start, stop, gather)


def _order_keys(values: np.ndarray) -> np.ndarray:
    """float64 -> uint64 keys in the same order (negative values flipped whole, positive ones get the sign bit)."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


def _from_key(key: int) -> float:
    bits = np.uint64(key)
    raw = bits & ~np.uint64(1 << 63) if bits >> np.uint64(63) else ~bits
    return float(np.array([raw], dtype=np.uint64).view(np.float64)[0])


def order_statistic_over_ranks(sorted_keys: np.ndarray, k: int, gather: Gather) -> float:
    """The k-th smallest (0-based) value of every rank's values together; each rank passes its own,
    as sorted `_order_keys`. A bisection over the 64-bit keys: 64 small gathers, no values moved."""
    low, high = 0, (1 << 64) - 1
    while low < high:
        mid = (low + high) // 2
        at_most = sum(gather(int(np.searchsorted(sorted_keys, np.uint64(mid), side="right"))))
        if at_most > k:
            high = mid
        else:
            low = mid + 1
    return _from_key(low)


def quantile_over_ranks(values: np.ndarray, q: float, gather: Gather) -> float:
    """``np.quantile`` (linear) of the union of every rank's ``values``, exactly; +inf when all are empty."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    n = sum(gather(len(values)))
    if n == 0:
        return float("inf")
    keys = np.sort(_order_keys(values))
    # numpy's linear method, operation for operation: the virtual index (n - 1) q, its floor, and numpy's
    # lerp between the two order statistics there (from the upper one when the weight is >= 0.5)
    index = (n - 1) * np.float64(q)
    below = np.floor(index)
    a = order_statistic_over_ranks(keys, int(below), gather)
    if int(below) + 1 >= n:
        return a
    b = order_statistic_over_ranks(keys, int(below) + 1, gather)
    gamma, diff = index - below, np.float64(b) - np.float64(a)
    return float(b - diff * (1 - gamma)) if gamma >= 0.5 else float(a + diff * gamma)


def sums_over_ranks(parts: dict[str, float], gather: Gather) -> dict[str, float]:
    """Each key's sum over the ranks (counts and float64 partial sums; min/max keys take the extreme)."""
    every = gather(parts)
    out = {}
    for key in parts:
        column = [p[key] for p in every]
        out[key] = min(column) if key.endswith("_min") else max(column) if key.endswith("_max") else sum(column)
    return out
