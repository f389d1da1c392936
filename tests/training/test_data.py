"""rlpipe.training.data: the trainer's inputs from the joined tables, by hand."""
from __future__ import annotations

import numpy as np
import polars as pl

from rlpipe.data.schema import TOKEN_FLOATS, TOKEN_IDS, TOKEN_MASK
from rlpipe.training.data import training_data


def frame(policy_mask, advantage, token_advantages, filtered=(None, None)) -> pl.DataFrame:
    return pl.DataFrame({
        "prompt_token_ids": pl.Series([[1, 2], [3]], dtype=TOKEN_IDS),
        "completion_token_ids": pl.Series([[4, 5, 6], [7]], dtype=TOKEN_IDS),
        "sampler_logprobs": pl.Series([[-0.5, -0.25, -1.0], [-2.0]], dtype=TOKEN_FLOATS),
        "ref_logprobs": pl.Series([[-0.75, -0.25, -1.5], [-1.0]], dtype=TOKEN_FLOATS),
        "policy_mask": pl.Series(policy_mask, dtype=TOKEN_MASK),
        "advantage": pl.Series(advantage, dtype=pl.Float32),
        "token_advantages": pl.Series(token_advantages, dtype=TOKEN_FLOATS),
        "filtered_reason": pl.Series(list(filtered), dtype=pl.String),
    })


def test_single_turn_rows_become_per_row_arrays():
    data = training_data(frame([[True] * 3, [True]], [0.5, -0.5], [[0.5] * 3, [-0.5]], filtered=(None, "truncated")))
    assert [p.tolist() for p in data.prompt_token_ids] == [[1, 2], [3]]
    assert [c.tolist() for c in data.completion_token_ids] == [[4, 5, 6], [7]]
    assert [r.tolist() for r in data.ref_logprobs] == [[-0.75, -0.25, -1.5], [-1.0]]
    assert data.sampler_logprobs[0].dtype == np.float32 and data.sampler_logprobs[1].tolist() == [-2.0]
    assert data.policy_mask is None  # every token is the policy's
    assert data.sequence_advantages.tolist() == [0.5, -0.5] and data.trainable.tolist() == [True, False]
    assert data.old_values is None and data.returns is None


def test_multi_turn_masks_and_token_level_advantages():
    # row 0: its middle token is an observation; token-level estimator: A_i is the mean of the token advantages
    data = training_data(frame([[True, False, True], [False]], [None, None], [[1.0, 0.0, 0.5], [0.0]]))
    assert [m.tolist() for m in data.policy_mask] == [[True, False, True], [False]]
    assert data.sequence_advantages.tolist() == [0.5, 0.0]
    assert data.trainable.tolist() == [True, False]  # row 1 has no policy token to train
    assert data.policy_tokens(0) == 2
