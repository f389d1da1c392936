"""The few quantiles a stage records of a per-row number (reward, length), so a plot can draw its distribution.

Why in the metrics and not only the mean: a mean that holds still can hide a spread that widens (half
the samples collapsing to empty answers while the rest grow longer). `rlpipe iterate` copies these into
the history, and dvc.yaml's quantile-band charts draw p10-p90 and p25-p75 around the median per iteration.
"""
from __future__ import annotations

import polars as pl

QUANTILES = (10, 25, 50, 75, 90)  # percent; the history's columns are <name>_p10 ... <name>_p90


def quantile_summary(values: pl.Series) -> dict[str, float | None]:
    """``{"p10": ..., "p90": ...}`` of the non-null, non-NaN values: the sorted value at index round(q * (n - 1)).

    Why no interpolation: each quantile is a value some sample had (a length stays a whole number of
    tokens, a reward one the reward functions can give). None where there is no value.
    """
    kept = values.cast(pl.Float64).fill_nan(None).drop_nulls()
    return {f"p{q}": (float(kept.quantile(q / 100, "nearest")) if kept.len() else None) for q in QUANTILES}
