"""numpy's sum of a float64 array whose values arrive in pieces, bit for bit.

Why: a streamed stage (advantage at 1B tokens) must whiten over every token of the iteration without holding
them, and the in-memory stage must not copy the valid tokens out to sum them; both give the bytes numpy's sum
of the whole array gives. ``np.sum`` of a contiguous float64 array is a pairwise
sum whose tree depends only on the array's length: a node of n > 128 values splits at n2 = n // 2 rounded
down to a multiple of 8, and any node, summed alone by ``np.sum``, gives the value it has inside the tree.
So the leaves of that tree no longer than ``cap`` are summed by ``np.sum`` as their values arrive, and the
leaves' sums are added along the tree at the end: the same additions in the same order as ``np.sum`` of the
whole array. Memory: ``cap`` values and one float per leaf.
"""
from __future__ import annotations

import numpy as np

BLOCK = 128  # numpy's PW_BLOCKSIZE: a node this long or shorter is summed in one loop, not split


def split_point(n: int) -> int:
    """Where numpy's pairwise sum splits a node of n > BLOCK values: n // 2, down to a multiple of 8."""
    half = n // 2
    return half - half % 8


def leaves(n: int, cap: int) -> list[tuple[int, int]]:
    """The nodes [start, stop) of the pairwise tree over n values that are no longer than ``cap`` while their
    parent is, left to right: they cover [0, n) without overlap."""
    if cap < BLOCK:
        raise ValueError(f"cap must be at least {BLOCK} values, got {cap}")
    out: list[tuple[int, int]] = []
    stack = [(0, n)]
    while stack:
        start, stop = stack.pop()
        if stop - start <= cap:
            out.append((start, stop))
        else:
            mid = start + split_point(stop - start)
            stack += [(mid, stop), (start, mid)]  # left first out of the stack
    return out


class StreamedSum:
    """``np.sum`` of ``n`` float64 values given in order, in pieces of any size (`add`), read at the end (`total`)."""

    def __init__(self, n: int, *, cap: int = 1 << 20):
        self.n, self.cap = n, cap
        self._leaves = leaves(n, cap) if n else []
        self._sums: list[float] = []
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._seen = 0

    def add(self, values: np.ndarray) -> None:
        """The next values of the array (float64, any length)."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        self._seen += values.size
        if self._seen > self.n:
            raise ValueError(f"StreamedSum of {self.n} values was given {self._seen}")
        self._pending.append(values)
        self._pending_size += values.size
        while len(self._sums) < len(self._leaves):
            start, stop = self._leaves[len(self._sums)]
            if self._pending_size < stop - start:
                break
            leaf = self._take(stop - start)
            self._sums.append(np.sum(leaf))

    def _take(self, count: int) -> np.ndarray:
        joined = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        rest = joined[count:]
        self._pending, self._pending_size = ([rest] if rest.size else []), rest.size
        return joined[:count]

    def total(self) -> float:
        """The sum, once all ``n`` values were given: the float ``np.sum`` returns for them together."""
        if self._seen != self.n:
            raise ValueError(f"StreamedSum of {self.n} values was given {self._seen}")
        if self.n == 0:
            return float(np.sum(np.zeros(0)))
        sums = iter(self._sums)
        leaf_set = set(self._leaves)

        def node(start: int, stop: int):
            if (start, stop) in leaf_set:
                return next(sums)
            mid = start + split_point(stop - start)
            return node(start, mid) + node(mid, stop)

        return float(node(0, self.n))
