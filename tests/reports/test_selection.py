"""rlpipe.reports.selection: which rows `inspect --show N` shows first, on frames whose order is worked out by hand."""
import polars as pl

from rlpipe.reports.selection import _alternate, informative_order


def frame(rows):
    """rows: (prompt_id, sample_idx, completion ids, reward, advantage or None)."""
    return pl.DataFrame({"prompt_id": [r[0] for r in rows], "sample_idx": [r[1] for r in rows],
                         "completion_token_ids": [r[2] for r in rows], "reward": [r[3] for r in rows],
                         "advantage": [r[4] for r in rows]},
                        schema={"prompt_id": pl.Int64, "sample_idx": pl.Int32, "completion_token_ids": pl.List(pl.Int32),
                                "reward": pl.Float64, "advantage": pl.Float32})


def keys(df):
    return list(zip(df["prompt_id"].to_list(), df["sample_idx"].to_list()))


def test_alternate_takes_from_both_ends():
    assert _alternate([1, 2, 3, 4, 5]) == [1, 5, 2, 4, 3]
    assert _alternate([1, 2]) == [1, 2] and _alternate([]) == []


def test_zero_variance_groups_go_last_and_identical_completions_fold():
    rows = [  # prompt 0: eight identical completions, one reward: no signal
        *[(0, j, [5, 2], 1.0, 0.0) for j in range(4)],
        # prompt 1: mixed, |adv| up to 1.5; samples 1 and 3 identical
        (1, 0, [6, 2], 1.0, 0.5), (1, 1, [7, 2], 0.0, -1.5), (1, 2, [8, 2], 1.0, 1.0), (1, 3, [7, 2], 0.0, -1.5),
        # prompt 2: mixed but weaker, |adv| up to 0.8
        (2, 0, [9, 2], 1.0, 0.8), (2, 1, [4, 2], 0.0, -0.8),
    ]
    shown, dups = informative_order(frame(rows), 4)
    # prompt 1 first (largest |adv| 1.5): best (1,2) +1.0, worst (1,1) -1.5; then prompt 2's best and worst
    assert keys(shown) == [(1, 2), (1, 1), (2, 0), (2, 1)]
    assert dups[(1, 1)] == [3]
    everything, dups = informative_order(frame(rows))
    # round 1 ends with prompt 0's one distinct completion (its 3 twins folded into it); round 2 adds
    # prompt 1's last distinct completion (1,0)
    assert keys(everything) == [(1, 2), (1, 1), (2, 0), (2, 1), (0, 0), (1, 0)]
    assert dups[(0, 0)] == [1, 2, 3]


def test_without_advantages_the_signal_is_reward_minus_group_mean():
    rows = [(0, 0, [1], 0.0, None), (0, 1, [2], 1.0, None), (0, 2, [3], 0.4, None),
            (1, 0, [1], 0.0, None), (1, 1, [2], 3.0, None)]
    shown, _ = informative_order(frame(rows), 3)
    # group 1: mean 1.5, |signal| 1.5 > group 0's largest (mean 0.4667: 1 - 0.4667 = 0.533)
    assert keys(shown) == [(1, 1), (1, 0), (0, 1)]


def test_a_frame_without_keys_is_only_cut():
    df = pl.DataFrame({"x": [3, 1, 2]})
    shown, dups = informative_order(df, 2)
    assert shown["x"].to_list() == [3, 1] and dups == {}


def test_one_sample_per_prompt_goes_lowest_reward_first():
    rows = [(0, 0, [1], 1.5, None), (1, 0, [2], 0.0, None), (2, 0, [3], 0.5, None), (3, 0, [4], 0.0, None)]
    shown, _ = informative_order(frame(rows), 3)
    assert keys(shown) == [(1, 0), (3, 0), (2, 0)]  # the wrong answers (reward 0) lead, ties by prompt_id
