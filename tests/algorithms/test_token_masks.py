"""The high-entropy ("80/20") token mask, by hand."""
import numpy as np
import pytest

from rlpipe.algorithms.token_masks import high_entropy_threshold, high_entropy_token_mask


def test_threshold_by_hand():
    # sorted [0.1, 0.2, 0.4, 0.5, 0.9]; quantile 0.6 at position 0.6 * 4 = 2.4 -> 0.4 + 0.4 * 0.1 = 0.44
    assert high_entropy_threshold([0.1, 0.4, 0.2, 0.9, 0.5], top_quantile=0.4) == pytest.approx(0.44)
    assert high_entropy_threshold([0.1, 0.4, 0.2], top_quantile=1.0) == pytest.approx(0.1)  # rho 1: keep all
    assert high_entropy_threshold([], top_quantile=0.2) == float("inf")
    with pytest.raises(ValueError, match="top_quantile"):
        high_entropy_threshold([1.0], top_quantile=0.0)


def test_mask_keeps_the_top_fraction_of_valid_tokens_only():
    entropy = np.array([[0.1, 0.4, 0.2, 99.0], [0.9, 0.5, np.nan, np.nan]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    keep = high_entropy_token_mask(entropy, mask, top_quantile=0.4)  # threshold 0.44 from the valid five
    assert keep.tolist() == [[False, False, False, False], [True, True, False, False]]
    assert high_entropy_token_mask(entropy, mask, top_quantile=1.0).tolist() == mask.tolist()
