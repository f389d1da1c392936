"""Token math on flat (ragged) arrays: every completion token once, no padding (numpy, float64).

Why flat: a batch padded to its longest completion costs rows x longest. With a long tail (1% of
completions at an 8k cap, the rest near 500 tokens) that is 10-16x the tokens it holds, and the
advantage stage ran out of memory at 67M tokens. Here a per-token array holds exactly N = sum of
the completion lengths entries, in row order (row 0's tokens, then row 1's, ...): the layout of
an Arrow list column's values, so a column is read without a copy per row.

Every function gives the same float64 bits as its padded twin in `rlpipe.algorithms.advantages`
(which now calls it): the same operations in the same order on each token. Two places need care:
a row's sum is taken as numpy sums a zero-padded row (`row_sums`), and reward-to-go starts from
-0.0 on a row with no padding, as numpy's cumsum starts from the row's last element.

Names: `_N` arrays hold one entry per token, `_B` one per row; `mask_N` marks the tokens that
count (valid completion tokens the policy sampled).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlpipe.algorithms.pairwise_sum import StreamedSum

ROW_SUM_CHUNK_ELEMENTS = 1 << 22  # 4M float64 = 32 MiB: the padded block `row_sums` builds at a time
SUM_CHUNK = 1 << 22  # tokens whose valid values `valid_mean_and_squares` copies out at a time


@dataclass(frozen=True)
class Layout:
    """Where each row's tokens sit in the flat arrays: row i owns ``[offsets[i], offsets[i + 1])``.

    ``width``: the padded length the dense twin would use (the longest row, unless a caller pads
    further); only `row_sums` and `reward_to_go` read it, to reproduce numpy's padded arithmetic.
    """

    offsets: np.ndarray  # int64 [B + 1], offsets[0] = 0
    width: int

    @staticmethod
    def from_lengths(lengths_B, width: int | None = None) -> "Layout":
        n_B = np.asarray(lengths_B, dtype=np.int64).reshape(-1)
        if n_B.size and n_B.min() < 0:
            raise ValueError("row lengths must be >= 0")
        offsets = np.zeros(n_B.size + 1, dtype=np.int64)
        np.cumsum(n_B, out=offsets[1:])
        longest = int(n_B.max()) if n_B.size else 0
        if width is not None and width < longest:
            raise ValueError(f"width {width} is shorter than the longest row ({longest})")
        return Layout(offsets, longest if width is None else int(width))

    @staticmethod
    def dense(num_rows: int, width: int) -> "Layout":
        """The layout of a [num_rows, width] array read row by row."""
        return Layout.from_lengths(np.full(num_rows, width, dtype=np.int64), width)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_rows(self) -> int:
        return self.offsets.size - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def broadcast(self, x_B: np.ndarray) -> np.ndarray:
        """One value per row -> the same value at each of the row's tokens."""
        return np.repeat(np.asarray(x_B), self.lengths)

    def to_dense(self, x_N: np.ndarray, width: int | None = None, fill: float = 0.0) -> np.ndarray:
        """[B, width] with each row's tokens first and ``fill`` after them (for tests and small batches)."""
        width = self.width if width is None else width
        out = np.full((self.num_rows, width), fill, dtype=np.asarray(x_N).dtype)
        out[np.arange(width)[None, :] < self.lengths[:, None]] = x_N
        return out


def check_mask(mask_N, num_tokens: int) -> np.ndarray:
    """``mask_N`` as bool; a numeric mask must hold only 0 and 1 (a weight passed by mistake would
    otherwise count as valid)."""
    m = np.asarray(mask_N)
    if m.shape != (num_tokens,):
        raise ValueError(f"mask_N must have shape ({num_tokens},), got {m.shape}")
    if m.dtype != np.bool_:
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("a numeric mask must hold only 0 and 1")
        m = m.astype(bool)
    return m


def valid_tokens(x_N, name: str, mask_N: np.ndarray) -> np.ndarray:
    """float64 copy of a per-token array with the tokens outside the mask set to 0 (NaN there cannot leak);
    NaN or inf at a valid token is an error."""
    x = np.array(x_N, dtype=np.float64)  # one copy (of a float32 input, its only float64 one), zeroed in place
    if x.shape != mask_N.shape:
        raise ValueError(f"{name} has shape {x.shape}, the mask has {mask_N.shape}")
    x[~np.asarray(mask_N, dtype=bool)] = 0.0
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or inf at valid tokens")
    return x


def row_sums(x_N: np.ndarray, layout: Layout) -> np.ndarray:
    """Each row's sum, bit for bit as numpy sums the row zero-padded to ``layout.width``.

    Why padded: numpy adds pairwise in blocks whose boundaries depend on the row's length, so a sum
    over the row's own tokens can differ in the last bit from the padded one the stage always took.
    The padding is built a block of rows at a time (32 MiB), never for the whole batch.
    """
    out = np.zeros(layout.num_rows, dtype=np.float64)
    width = max(layout.width, 1)
    step = max(1, ROW_SUM_CHUNK_ELEMENTS // width)
    columns = np.arange(width)
    for start in range(0, layout.num_rows, step):
        stop = min(start + step, layout.num_rows)
        lengths = layout.lengths[start:stop]
        block = np.zeros((stop - start, width), dtype=np.float64)
        block[columns[None, :] < lengths[:, None]] = x_N[layout.offsets[start]:layout.offsets[stop]]
        out[start:stop] = block.sum(axis=1)
    return out


def token_kl(old_logprobs_N, ref_logprobs_N, mask_N, *, estimator: str) -> np.ndarray:
    """Per-token KL of pi_old from pi_ref on pi_old's samples; 0 outside the mask (see
    `rlpipe.algorithms.advantages.token_kl` for the estimators). Computed in place on one copy: at
    scale every N-sized temporary is a gigabyte."""
    m = np.asarray(mask_N, dtype=bool)
    d = valid_tokens(old_logprobs_N, "old_logprobs", m)
    d -= valid_tokens(ref_logprobs_N, "ref_logprobs", m)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d
        kl *= d
    elif estimator == "k3":
        clipped = np.clip(d, -20.0, 20.0)
        kl = np.negative(clipped)
        np.exp(kl, out=kl)
        kl -= 1.0
        kl += clipped
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: ['k1', 'k2', 'k3']")
    kl[~m] = 0.0
    return kl


def last_valid_token(mask_N: np.ndarray, layout: Layout) -> np.ndarray:
    """Flat index of each row's last token in the mask; -1 for a row with none."""
    index_N = np.where(mask_N, np.arange(mask_N.size), -1)
    out = np.full(layout.num_rows, -1, dtype=np.int64)
    nonempty = layout.lengths > 0
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(index_N, layout.offsets[:-1][nonempty])
    return out


def first_valid_token(mask_N: np.ndarray, layout: Layout) -> np.ndarray:
    """Flat index of each row's first token in the mask; -1 for a row with none."""
    big = np.iinfo(np.int64).max
    index_N = np.where(mask_N, np.arange(mask_N.size), big)
    out = np.full(layout.num_rows, -1, dtype=np.int64)
    nonempty = layout.lengths > 0
    if nonempty.any():
        first = np.minimum.reduceat(index_N, layout.offsets[:-1][nonempty])
        out[nonempty] = np.where(first == big, -1, first)
    return out


def kl_penalized_token_rewards(scores_B, old_logprobs_N, ref_logprobs_N, mask_N, layout: Layout, *, beta: float,
                               estimator: str = "k1") -> np.ndarray:
    """`r_t = -beta * KL_t` at every valid token, plus the sequence score on each row's last valid token
    (a row with none keeps 0 everywhere). Shapes: scores_B [B], the rest [N] -> rewards_N [N]."""
    s_B = np.asarray(scores_B, dtype=np.float64)
    m = check_mask(mask_N, layout.num_tokens)
    if s_B.shape != (layout.num_rows,):
        raise ValueError(f"scores has {s_B.shape[0] if s_B.ndim else 0} rows, the layout has {layout.num_rows}")
    return penalized_rewards(s_B, token_kl(old_logprobs_N, ref_logprobs_N, m, estimator=estimator), m, layout,
                             beta=beta)


def penalized_rewards(scores_B, kl_N: np.ndarray, mask_N: np.ndarray, layout: Layout, *, beta: float) -> np.ndarray:
    """`kl_penalized_token_rewards` from the KL already computed, turned into the rewards in place (the
    advantage stage also sums each row's KL: one N-sized array serves both)."""
    s_B = np.asarray(scores_B, dtype=np.float64)
    m = np.asarray(mask_N, dtype=bool)
    rewards_N = np.multiply(kl_N, -beta, out=kl_N)
    last_B = last_valid_token(m, layout)
    rows_B = np.nonzero(last_B >= 0)[0]
    rewards_N[last_B[rows_B]] += s_B[rows_B]
    return rewards_N


def _rows_by_length(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows longest first, their lengths, and for each distance p from a row's end how many rows reach it."""
    lengths = layout.lengths
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    longest = int(sorted_lengths[0]) if sorted_lengths.size else 0
    # rows with length > p are a prefix of `order`: count them for every p
    reach = np.searchsorted(-sorted_lengths, -np.arange(longest), side="left")
    return order, sorted_lengths, reach


def reward_to_go(token_rewards_N, mask_N, layout: Layout) -> np.ndarray:
    """Undiscounted return `G_t = sum_{t' >= t} r_t'` of every valid token (0 outside the mask).

    Walked from each row's end, all rows at once: one numpy step per position of the longest row,
    so the work is the number of tokens and no padded array is built.
    """
    m = check_mask(mask_N, layout.num_tokens)
    r = valid_tokens(token_rewards_N, "token_rewards", m)
    out = np.zeros(r.shape, dtype=np.float64)
    order, sorted_lengths, reach = _rows_by_length(layout)
    ends = layout.offsets[1:][order]
    # numpy's padded cumsum starts at the row's last element (no addition) when the row fills the width,
    # and at 0 + that element otherwise: -0.0 is the start that adds nothing, +0.0 the padded one
    acc = np.where(sorted_lengths == layout.width, -0.0, 0.0)
    for p in range(reach.size):
        k = reach[p]
        idx = ends[:k] - 1 - p
        acc[:k] = acc[:k] + r[idx]
        out[idx] = acc[:k]
    out[~m] = 0.0
    return out


def check_whitening(form: str, eps: float) -> None:
    if form not in ("std", "unbiased_rsqrt", "population_rsqrt"):
        raise ValueError(f"unknown whitening form {form!r}; valid: ['std', 'unbiased_rsqrt', 'population_rsqrt']")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def whitening_scale(squares: float, n: int, *, form: str, eps: float) -> float | None:
    """What `whiten` divides by, from the valid tokens' summed squared deviations and their count; None
    where every output is 0 (no valid token, one with the unbiased form, or a scale of 0)."""
    if n == 0 or (form == "unbiased_rsqrt" and n == 1):
        return None
    if form == "std":
        scale = np.sqrt(squares / n) + eps
    elif form == "unbiased_rsqrt":
        scale = np.sqrt(squares / (n - 1) + eps)
    else:
        scale = np.sqrt(max(squares / n, eps))
    return None if scale == 0.0 else scale


def valid_mean(x_N: np.ndarray, mask_N: np.ndarray, n: int) -> np.float64:
    """``x_N[mask_N].mean()`` of its ``n`` > 0 valid values, bit for bit, a chunk of tokens at a time
    (`StreamedSum`): no copy of the valid tokens."""
    total = StreamedSum(n)
    for start in range(0, x_N.size, SUM_CHUNK):
        total.add(x_N[start:start + SUM_CHUNK][mask_N[start:start + SUM_CHUNK]])
    return np.float64(total.total()) / n  # np.mean: the pairwise sum over the count


def valid_mean_and_squares(x_N: np.ndarray, mask_N: np.ndarray, n: int) -> tuple[np.float64, float]:
    """`valid_mean` and the valid values' summed squared deviations from it, as numpy takes them over
    ``x_N[mask_N]``, a chunk at a time."""
    mean = valid_mean(x_N, mask_N, n)
    squares = StreamedSum(n)
    for start in range(0, x_N.size, SUM_CHUNK):
        deviations = x_N[start:start + SUM_CHUNK][mask_N[start:start + SUM_CHUNK]]
        deviations -= mean
        np.square(deviations, out=deviations)
        squares.add(deviations)
    return mean, squares.total()


def whiten(x_N, mask_N, *, form: str, eps: float) -> np.ndarray:
    """Centre and scale by the mean and spread of the valid tokens (forms and worked example:
    `rlpipe.algorithms.advantages.whiten`). Shapes: [N] -> [N], 0 outside the mask."""
    check_whitening(form, eps)
    m = np.asarray(mask_N, dtype=bool)
    x = valid_tokens(x_N, "x", m)
    n = int(m.sum())
    if n == 0 or (form == "unbiased_rsqrt" and n == 1):
        return np.zeros(m.shape, dtype=np.float64)
    mean, squares = valid_mean_and_squares(x, m, n)
    scale = whitening_scale(squares, n, form=form, eps=eps)
    if scale is None:  # all valid values equal and eps = 0: nothing to scale
        return np.zeros(m.shape, dtype=np.float64)
    x -= mean  # in place on valid_tokens' copy: the same bits as (x - mean) / scale, without two more arrays
    x /= scale
    x[~m] = 0.0
    return x


def gae(token_rewards_N, values_N, mask_N, layout: Layout, *, gamma: float, lam: float
        ) -> tuple[np.ndarray, np.ndarray]:
    """GAE backwards over each row's valid tokens (masked tokens skipped, not terminal): the recursion of
    `rlpipe.algorithms.advantages.gae_advantages`, walked from every row's end at once.
    Shapes: [N] -> (advantages_N, returns_N), 0 outside the mask."""
    m = check_mask(mask_N, layout.num_tokens)
    r = valid_tokens(token_rewards_N, "token_rewards", m)
    v = valid_tokens(values_N, "values", m)
    adv_N = np.zeros(r.shape, dtype=np.float64)
    order, _, reach = _rows_by_length(layout)
    ends = layout.offsets[1:][order]
    next_value = np.zeros(layout.num_rows)
    next_adv = np.zeros(layout.num_rows)
    for p in range(reach.size):
        k = reach[p]
        idx = ends[:k] - 1 - p
        delta = r[idx] + gamma * next_value[:k] - v[idx]
        adv_t = delta + gamma * lam * next_adv[:k]
        valid = m[idx]
        adv_N[idx] = np.where(valid, adv_t, 0.0)
        next_value[:k] = np.where(valid, v[idx], next_value[:k])
        next_adv[:k] = np.where(valid, adv_t, next_adv[:k])
    returns_N = np.add(adv_N, v, out=v)
    returns_N[~m] = 0.0
    return adv_N, returns_N
