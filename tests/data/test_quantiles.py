import math

import polars as pl

from rlpipe.data.quantiles import QUANTILES, quantile_summary


def test_quantiles_are_values_that_occurred_at_the_nearest_index():
    # 10 sorted values, index round(q * 9): p10 -> 0.9 -> 1, p25 -> 2.25 -> 2, p50 -> 4.5 -> 5 (half up here),
    # p75 -> 6.75 -> 7, p90 -> 8.1 -> 8
    values = pl.Series([10, 9, 8, 7, 6, 5, 4, 3, 2, 1])
    assert quantile_summary(values) == {"p10": 2.0, "p25": 3.0, "p50": 6.0, "p75": 8.0, "p90": 9.0}
    assert [f"p{q}" for q in QUANTILES] == list(quantile_summary(values))


def test_nan_and_null_are_left_out_and_nothing_gives_none():
    # an unscorable reward is NaN (score.fallback_reward: .nan): not a value of the distribution
    assert quantile_summary(pl.Series([0.0, math.nan, None, 1.5])) == {
        "p10": 0.0, "p25": 0.0, "p50": 1.5, "p75": 1.5, "p90": 1.5}  # 2 values: indices 0, 0, 0.5 -> 1, 1, 1
    assert quantile_summary(pl.Series([], dtype=pl.Float64)) == dict.fromkeys(("p10", "p25", "p50", "p75", "p90"))
