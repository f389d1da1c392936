"""polars' sum of a float column held as one chunk, when its values arrive in pieces, bit for bit.

Why: `rlpipe inspect` reports token means (KL to the reference, sampler mismatch, entropy...) that polars
computes over the whole exploded column, and streaming them must print the same digits. polars sums one chunk
of n values (``polars-compute``'s float sum) as: the first n % 128 values one after another, plus a pairwise
tree over the remaining blocks of 128 (a node of m blocks splits after m // 2 of them), each block summed in
16 stripes. Any node of that tree, summed alone by polars, gives the value it has inside the tree (its length
is a multiple of 128, so it has no leading remainder). So the nodes no longer than ``cap`` values are summed by
polars as their values arrive, and added along the tree at the end. A mean is this sum over the count, as polars
takes it. Memory: ``cap`` values and one float per node.
"""
from __future__ import annotations

import numpy as np
import polars as pl

BLOCK = 128  # polars' PAIRWISE_RECURSION_LIMIT


def block_nodes(blocks: int, cap_blocks: int) -> list[tuple[int, int]]:
    """The nodes [start, stop) (in blocks) of polars' tree over ``blocks`` blocks that are no longer than
    ``cap_blocks`` while their parent is, left to right."""
    out: list[tuple[int, int]] = []
    stack = [(0, blocks)] if blocks else []
    while stack:
        start, stop = stack.pop()
        if stop - start <= cap_blocks:
            out.append((start, stop))
        else:
            mid = start + (stop - start) // 2
            stack += [(mid, stop), (start, mid)]
    return out


class PolarsSum:
    """``pl.Series(values).sum()`` of ``n`` float64 values given in order, in pieces (`add`), read by `total`."""

    def __init__(self, n: int, *, cap: int = 1 << 20):
        if cap < BLOCK:
            raise ValueError(f"cap must be at least {BLOCK} values, got {cap}")
        self.n = n
        self._head = n % BLOCK  # summed one by one, before the tree
        self._nodes = block_nodes(n // BLOCK, cap // BLOCK)
        self._head_sum = -0.0  # Rust's float Sum starts at -0.0
        self._sums: list[float] = []
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._seen = 0

    def add(self, values: np.ndarray) -> None:
        """The next values (any float dtype: each is taken as float64, as polars casts a float32 column)."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        self._seen += values.size
        if self._seen > self.n:
            raise ValueError(f"PolarsSum of {self.n} values was given {self._seen}")
        before = self._seen - values.size
        if before < self._head:
            for v in values[:self._head - before].tolist():
                self._head_sum += v
            values = values[self._head - before:]
        if values.size:
            self._pending.append(values)
            self._pending_size += values.size
        while len(self._sums) < len(self._nodes):
            start, stop = self._nodes[len(self._sums)]
            size = (stop - start) * BLOCK
            if self._pending_size < size:
                break
            self._sums.append(pl.Series(self._take(size)).sum())

    def _take(self, count: int) -> np.ndarray:
        joined = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        rest = joined[count:]
        self._pending, self._pending_size = ([rest] if rest.size else []), rest.size
        return joined[:count]

    def total(self) -> float:
        """The sum, once all ``n`` values were given."""
        if self._seen != self.n:
            raise ValueError(f"PolarsSum of {self.n} values was given {self._seen}")
        sums = iter(self._sums)
        nodes = set(self._nodes)

        def node(start: int, stop: int) -> float:
            if (start, stop) in nodes:
                return next(sums)
            mid = start + (stop - start) // 2
            return node(start, mid) + node(mid, stop)

        tree = node(0, self.n // BLOCK) if self.n >= BLOCK else 0.0
        return tree + self._head_sum

    def mean(self) -> float | None:
        """polars' mean of the values: the sum over the count (None for no value)."""
        return self.total() / self.n if self.n else None
