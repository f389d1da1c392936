"""`rlpipe inspect`'s statistics over tokens (token advantages, sampler mismatch, KL to the reference, entropy,
training's log-ratio): over a whole joined frame, or a batch of rows at a time with the same numbers.

Why both: at 67M-1B completion tokens the joined frame is gigabytes, but each statistic is a count, a maximum or
a mean, and a mean is polars' sum over the count: `rlpipe.algorithms.polars_sum` takes that sum over values given
in pieces bit for bit. So the streamed statistics take two passes over the batches (the counts first, which fix
the sum's tree; then the sums) and print the digits the whole frame gives. One statistic is not streamed: the
spread of the token advantages (GAE, REINFORCE++: the sequence `advantage` is empty), since polars' variance
adds 128-value partial states in an order numpy cannot repeat; its values are kept (4 bytes a policy token).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import polars as pl

from rlpipe.algorithms.polars_sum import PolarsSum


def finite_or_none(x: Any) -> float | None:
    """A float for JSON: None for a missing, NaN or infinite value."""
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def series_stats(s: pl.Series) -> dict[str, float | None]:
    s = s.drop_nulls()
    return {"mean": finite_or_none(s.mean()), "std": finite_or_none(s.std()) if s.len() > 1 else None,
            "min": finite_or_none(s.min()), "max": finite_or_none(s.max()), "count": s.len()}


def policy_values(frame: pl.DataFrame, column: str) -> pl.Series:
    """A per-token column's values, at the policy's tokens only (observation tokens have no log-probs)."""
    if "policy_mask" not in frame.columns:
        return frame[column].explode().drop_nulls()
    both = frame.select(pl.col(column).explode(), pl.col("policy_mask").explode())
    return both.filter(pl.col("policy_mask"))[column].drop_nulls()


def k3_values(log_ratio: pl.Series) -> pl.Series:
    """The k3 KL estimate `exp(-r) + r - 1` per token: >= 0, so never shown negative (near r = 0 the float
    formula rounds to -1e-17 and the like)."""
    return ((-log_ratio).exp() + log_ratio - 1).clip(lower_bound=0.0)


def k3_mean(log_ratio: pl.Series) -> float | None:
    """Mean of the k3 KL estimate over the tokens."""
    return finite_or_none(k3_values(log_ratio).mean())


def token_statistics(frame: pl.DataFrame, *, token_advantages: bool) -> dict[str, Any]:
    """The token statistics of a whole joined frame (its derived columns added), under their summary keys.
    ``token_advantages``: also the token advantages' (the sequence `advantage` column is empty)."""
    cols = set(frame.columns)
    out: dict[str, Any] = {}
    if token_advantages and "token_advantages" in cols:
        out["token_advantage"] = series_stats(policy_values(frame, "token_advantages"))
    if "sampler_mismatch" in cols:
        diff = policy_values(frame, "sampler_mismatch").abs()
        out["logprob_mismatch"] = {"mean_abs": finite_or_none(diff.mean()), "max_abs": finite_or_none(diff.max()),
                                   "tokens": diff.len()}
    if "ref_log_ratio" in cols:
        r = policy_values(frame, "ref_log_ratio")  # log pi_sampler - log pi_ref, on tokens sampled from pi_sampler
        out["kl_ref"] = {"k1": finite_or_none(r.mean()), "k3": k3_mean(r), "tokens": r.len()}
    if "entropy" in cols:
        out["entropy_mean"] = finite_or_none(policy_values(frame, "entropy").mean())
    if "log_ratio" in cols:
        out["train_log_ratio_mean"] = finite_or_none(policy_values(frame, "log_ratio").mean())
    return out


# name -> (the derived or stored per-token column, what is taken of its policy values)
QUANTITIES: dict[str, tuple[str, Callable[[pl.Series], pl.Series]]] = {
    "mismatch": ("sampler_mismatch", pl.Series.abs),
    "kl_k1": ("ref_log_ratio", lambda s: s),
    "kl_k3": ("ref_log_ratio", k3_values),
    "entropy": ("entropy", lambda s: s),
    "log_ratio": ("log_ratio", lambda s: s),
}
TOKEN_COLUMNS = ("policy_mask", "sampler_logprobs", "ref_logprobs", "old_logprobs", "new_logprobs", "entropy",
                 "token_advantages")  # what the statistics and their derived columns read


class StreamedTokenStatistics:
    """`token_statistics` over batches of rows (their derived columns added), in two passes over the same
    batches: `count` each, then `add` each, then `result`."""

    def __init__(self, columns: Iterable[str], *, token_advantages: bool):
        cols = set(columns)
        self.token_advantages = token_advantages and "token_advantages" in cols
        self.names = [name for name, (column, _) in QUANTITIES.items() if column in cols]
        self.counts = dict.fromkeys(self.names, 0)
        self.maxima: list[float | None] = []
        self.sums: dict[str, PolarsSum] = {}
        self.advantages: np.ndarray | None = None
        self._advantage_count = self._filled = 0

    def _values(self, batch: pl.DataFrame, name: str) -> pl.Series:
        column, take = QUANTITIES[name]
        return take(policy_values(batch, column))

    def count(self, batch: pl.DataFrame) -> None:
        """First pass: how many values each statistic has (and the mismatch's maxima)."""
        for name in self.names:
            values = self._values(batch, name)
            self.counts[name] += values.len()
            if name == "mismatch":
                self.maxima.append(values.max())
        if self.token_advantages:
            self._advantage_count += policy_values(batch, "token_advantages").len()

    def _start_sums(self) -> None:
        self.sums = {name: PolarsSum(self.counts[name]) for name in self.names}
        if self.token_advantages:
            self.advantages = np.empty(self._advantage_count, dtype=np.float32)

    def add(self, batch: pl.DataFrame) -> None:
        """Second pass: the values, in the order of the first."""
        if not self.sums:
            self._start_sums()
        for name in self.names:
            self.sums[name].add(self._values(batch, name).to_numpy())
        if self.token_advantages:
            values = policy_values(batch, "token_advantages").to_numpy()
            self.advantages[self._filled:self._filled + values.size] = values
            self._filled += values.size

    def result(self) -> dict[str, Any]:
        """What `token_statistics` gives for the whole frame."""
        if not self.sums:  # no batch at all: the sums of nothing
            self._start_sums()
        mean = {name: finite_or_none(self.sums[name].mean()) for name in self.names}
        out: dict[str, Any] = {}
        if self.token_advantages:
            out["token_advantage"] = series_stats(pl.Series("token_advantages", self.advantages))
        if "mismatch" in mean:
            largest = pl.Series(self.maxima, dtype=pl.Float64).max() if self.maxima else None
            out["logprob_mismatch"] = {"mean_abs": mean["mismatch"], "max_abs": finite_or_none(largest),
                                       "tokens": self.counts["mismatch"]}
        if "kl_k1" in mean:
            out["kl_ref"] = {"k1": mean["kl_k1"], "k3": mean["kl_k3"], "tokens": self.counts["kl_k1"]}
        if "entropy" in mean:
            out["entropy_mean"] = mean["entropy"]
        if "log_ratio" in mean:
            out["train_log_ratio_mean"] = mean["log_ratio"]
        return out
