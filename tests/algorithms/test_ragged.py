"""rlpipe.algorithms.ragged: flat token math, by hand and bit for bit against the padded computation.

The padded references below are the formulas the advantage stage used before it went flat (numpy on
[B, T] arrays padded to the longest row); the stage promises the same bits, so equality is exact.
"""
from __future__ import annotations

import numpy as np
import pytest

from rlpipe.algorithms import ragged
from rlpipe.algorithms.ragged import Layout


def test_layout_from_lengths_and_back_to_dense():
    layout = Layout.from_lengths([2, 0, 3])
    assert layout.offsets.tolist() == [0, 2, 2, 5] and layout.width == 3 and layout.num_tokens == 5
    np.testing.assert_array_equal(layout.broadcast(np.array([7.0, 8.0, 9.0])), [7, 7, 9, 9, 9])
    np.testing.assert_array_equal(layout.to_dense(np.arange(1.0, 6.0)), [[1, 2, 0], [0, 0, 0], [3, 4, 5]])
    with pytest.raises(ValueError, match="shorter than the longest row"):
        Layout.from_lengths([4], width=3)
    with pytest.raises(ValueError, match=">= 0"):
        Layout.from_lengths([1, -1])


def test_first_and_last_valid_token_by_hand():
    layout = Layout.from_lengths([3, 0, 2, 2])
    mask = np.array([0, 1, 1, 0, 0, 1, 0], bool)  # row 0: tokens 1, 2; row 2: none; row 3: token 5
    assert ragged.last_valid_token(mask, layout).tolist() == [2, -1, -1, 5]
    assert ragged.first_valid_token(mask, layout).tolist() == [1, -1, -1, 5]


def test_reward_to_go_and_gae_by_hand():
    # row 0: rewards [0, 1, 2] with its middle token masked; row 1: [3]
    layout = Layout.from_lengths([3, 1])
    mask = np.array([1, 0, 1, 1], bool)
    rewards = np.array([0.0, 99.0, 2.0, 3.0])
    np.testing.assert_array_equal(ragged.reward_to_go(rewards, mask, layout), [2.0, 0.0, 2.0, 3.0])
    values = np.array([0.5, 99.0, 0.25, 1.0])
    adv, ret = ragged.gae(rewards, values, mask, layout, gamma=1.0, lam=1.0)
    # row 0 skips its masked token: delta_2 = 2 - 0.25 = 1.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = 1.5
    np.testing.assert_allclose(adv, [1.5, 0.0, 1.75, 2.0])
    np.testing.assert_allclose(ret, [2.0, 0.0, 2.0, 3.0])


def test_row_sums_handle_empty_rows_and_chunks(monkeypatch):
    monkeypatch.setattr(ragged, "ROW_SUM_CHUNK_ELEMENTS", 4)  # two rows of width 2 a block
    layout = Layout.from_lengths([2, 0, 1, 2, 1])
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    np.testing.assert_array_equal(ragged.row_sums(x, layout), [3.0, 0.0, 3.0, 9.0, 6.0])


# ---------------------------------------------------------------- bit for bit against the padded formulas


def padded(x_N, layout):
    return layout.to_dense(np.asarray(x_N, dtype=np.float64))


def dense_reward_to_go(r_BT, m_BT):
    r = np.where(m_BT, r_BT, 0.0)
    return np.where(m_BT, np.cumsum(r[:, ::-1], axis=1)[:, ::-1], 0.0)


def dense_gae(r_BT, v_BT, m_BT, gamma, lam):
    r, v = np.where(m_BT, r_BT, 0.0), np.where(m_BT, v_BT, 0.0)
    adv = np.zeros(m_BT.shape)
    next_value, next_adv = np.zeros(m_BT.shape[0]), np.zeros(m_BT.shape[0])
    for t in range(m_BT.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = np.where(m_BT[:, t], a, 0.0)
        next_value = np.where(m_BT[:, t], v[:, t], next_value)
        next_adv = np.where(m_BT[:, t], a, next_adv)
    return adv, np.where(m_BT, adv + v, 0.0)


@pytest.fixture(params=[0, 1, 2])
def batch(request):
    """A long-tailed ragged batch: lengths 0..40 and a few at 300, masked spans, a -0.0 reward or two."""
    rng = np.random.default_rng(request.param)
    lengths = rng.integers(0, 40, size=57)
    lengths[rng.integers(0, 57, size=3)] = 300
    layout = Layout.from_lengths(lengths)
    n = layout.num_tokens
    mask = rng.random(n) > 0.2
    x = rng.normal(size=n)
    x[rng.integers(0, n, size=5)] = -0.0
    full = layout.offsets[1:][layout.lengths == layout.width][0] - 1  # last token of a row without padding
    x[full], mask[full] = -0.0, True
    return layout, mask, x, rng.normal(size=n), rng.normal(size=layout.num_rows)


def test_reward_to_go_equals_the_padded_cumsum_bitwise(batch):
    layout, mask, x, _, _ = batch
    expected = dense_reward_to_go(padded(x, layout), padded(mask, layout).astype(bool))
    got = layout.to_dense(ragged.reward_to_go(x, mask, layout))
    assert np.array_equal(got, expected) and np.array_equal(np.signbit(got), np.signbit(expected))


def test_gae_equals_the_padded_recursion_bitwise(batch):
    layout, mask, r, v, _ = batch
    m_BT = padded(mask, layout).astype(bool)
    adv_BT, ret_BT = dense_gae(padded(r, layout), padded(v, layout), m_BT, 0.99, 0.95)
    adv, ret = ragged.gae(r, v, mask, layout, gamma=0.99, lam=0.95)
    assert np.array_equal(layout.to_dense(adv), adv_BT) and np.array_equal(layout.to_dense(ret), ret_BT)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_rewards_and_row_sums_equal_the_padded_ones_bitwise(batch, estimator):
    layout, mask, old, ref, scores = batch
    m_BT = padded(mask, layout).astype(bool)
    kl_N = ragged.token_kl(old, ref, mask, estimator=estimator)
    d = np.where(m_BT, padded(old, layout), 0.0) - np.where(m_BT, padded(ref, layout), 0.0)
    kl_BT = {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-np.clip(d, -20, 20)) - 1.0 + np.clip(d, -20, 20)}[estimator]
    kl_BT = np.where(m_BT, kl_BT, 0.0)
    assert np.array_equal(layout.to_dense(kl_N), kl_BT)
    assert np.array_equal(ragged.row_sums(kl_N, layout), kl_BT.sum(axis=1))
    rewards = ragged.kl_penalized_token_rewards(scores, old, ref, mask, layout, beta=0.05, estimator=estimator)
    expected = -0.05 * kl_BT
    for i in range(layout.num_rows):
        valid = np.nonzero(m_BT[i])[0]
        if valid.size:
            expected[i, valid[-1]] += scores[i]
    assert np.array_equal(layout.to_dense(rewards), expected)


@pytest.mark.parametrize("form", ["std", "unbiased_rsqrt", "population_rsqrt"])
def test_whiten_reads_the_valid_tokens_in_row_order(batch, form):
    layout, mask, x, _, _ = batch
    m_BT = padded(mask, layout).astype(bool)
    x_BT = np.where(m_BT, padded(x, layout), 0.0)
    mean = x_BT[m_BT].mean()  # the padded twin's statistics: the valid tokens row by row
    got = ragged.whiten(x, mask, form=form, eps=1e-8)
    assert np.isclose(got[mask].mean(), 0.0, atol=1e-12)
    squares = float(((x_BT[m_BT] - mean) ** 2).sum())
    scale = {"std": np.sqrt(squares / mask.sum()) + 1e-8, "unbiased_rsqrt": np.sqrt(squares / (mask.sum() - 1) + 1e-8),
             "population_rsqrt": np.sqrt(max(squares / mask.sum(), 1e-8))}[form]
    assert np.array_equal(layout.to_dense(got), np.where(m_BT, (x_BT - mean) / scale, 0.0))


def test_bad_masks_and_non_finite_tokens_are_refused():
    layout = Layout.from_lengths([2])
    with pytest.raises(ValueError, match="only 0 and 1"):
        ragged.reward_to_go([1.0, 2.0], [0.5, 1.0], layout)
    with pytest.raises(ValueError, match=r"mask_N must have shape \(2,\)"):
        ragged.reward_to_go([1.0, 2.0], [1, 1, 1], layout)
    with pytest.raises(ValueError, match="values contains NaN"):
        ragged.gae([0.0, 1.0], [np.nan, 0.0], [1, 1], layout, gamma=1.0, lam=1.0)
    # NaN outside the mask never leaks
    assert ragged.reward_to_go([np.nan, 2.0], [0, 1], layout).tolist() == [0.0, 2.0]
    with pytest.raises(ValueError, match="unknown whitening form"):
        ragged.whiten([1.0], [1], form="z", eps=0.0)
