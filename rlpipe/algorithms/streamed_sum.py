"""Whitening over values that arrive in pieces, bit for bit as `rlpipe.algorithms.ragged.whiten` of the whole.

Why: a streamed stage (advantage at 1B tokens) must whiten over every token of the iteration without holding
them, and give the bytes the in-memory stage gives: its sums are numpy's own, taken in pieces
(`rlpipe.algorithms.pairwise_sum`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from rlpipe.algorithms import ragged
from rlpipe.algorithms.pairwise_sum import StreamedSum


@dataclass(frozen=True)
class Whitening:
    """`rlpipe.algorithms.ragged.whiten`'s centre and scale, found over values given in pieces (`whitening`);
    ``scale`` None: every output is 0 (no valid token, one with the unbiased form, or all equal with eps 0)."""

    mean: float
    scale: float | None

    def apply(self, x_N: np.ndarray, mask_N: np.ndarray) -> np.ndarray:
        """This piece whitened, bit for bit the same piece of `ragged.whiten` of the whole array."""
        m = np.asarray(mask_N, dtype=bool)
        if self.scale is None:
            return np.zeros(m.shape, dtype=np.float64)
        x = ragged.valid_tokens(x_N, "x", m)
        x -= self.mean
        x /= self.scale
        x[~m] = 0.0
        return x


def whitening(pieces: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]], *, form: str, eps: float,
              cap: int = 1 << 20) -> Whitening:
    """The centre and scale `ragged.whiten` takes, over every valid token of the (x_N, mask_N) pieces that
    ``pieces()`` yields in order; called twice (the mean, then the squared deviations), so each pass reads
    the pieces again rather than keeping them. Same float operations as `ragged.whiten`."""
    ragged.check_whitening(form, eps)
    n = sum(int(np.count_nonzero(m)) for _, m in pieces())
    if n == 0 or (form == "unbiased_rsqrt" and n == 1):
        return Whitening(0.0, None)
    total = StreamedSum(n, cap=cap)
    for x, m in pieces():
        total.add(ragged.valid_tokens(x, "x", np.asarray(m, dtype=bool))[np.asarray(m, dtype=bool)])
    mean = np.float64(total.total()) / n  # np.mean: the pairwise sum over the count
    squares = StreamedSum(n, cap=cap)
    for x, m in pieces():
        m = np.asarray(m, dtype=bool)
        deviations = ragged.valid_tokens(x, "x", m)[m]
        deviations -= mean
        np.square(deviations, out=deviations)
        squares.add(deviations)
    return whitening_from_sums(float(mean), squares.total(), n, form=form, eps=eps)


def whitening_from_sums(mean: float, squared: float, n: int, *, form: str, eps: float) -> Whitening:
    """`ragged.whiten`'s centre and scale from the valid tokens' mean, their summed squared deviations and
    their count."""
    scale = ragged.whitening_scale(squared, n, form=form, eps=eps)
    return Whitening(float(mean), None if scale is None else float(scale))
