"""Loss aggregation: modes by hand, empty masks, and micro-batch split invariance of the gradient."""
import pytest
import torch

from rlpipe.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    TOKEN_MEAN_SCOPES,
    aggregate_loss,
    count_valid,
    loss_normalisers,
)
from rlpipe.algorithms.kl import kl_k3
from rlpipe.algorithms.losses import ppo_clip_loss

NAN = float("nan")


def agg(loss, mask, mode, **totals):
    kwargs = dict(total_tokens=None, total_sequences=None, max_length=None)
    return aggregate_loss(loss, mask, mode=mode, **{**kwargs, **totals})


def test_modes_by_hand_with_nan_padding():
    loss = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, 100.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # 0/1 ints are accepted too
    totals = dict(total_tokens=4, total_sequences=2, max_length=4)
    assert agg(loss, mask, "token-mean", **totals).item() == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5
    assert agg(loss, mask, "seq-mean-token-mean", **totals).item() == pytest.approx((6 / 3 + 4 / 1) / 2)  # 3
    assert agg(loss, mask, "seq-mean-token-sum", **totals).item() == pytest.approx((6 + 4) / 2)  # 5
    assert agg(loss, mask, "seq-mean-token-sum-norm", **totals).item() == pytest.approx((6 + 4) / (4 * 2))  # 1.25
    assert agg(loss, mask, "token-sum", **totals).item() == pytest.approx(1 + 2 + 3 + 4)  # 10: verl's token-sum
    assert agg(loss, mask, "token-sum").item() == pytest.approx(10.0)  # it needs no normaliser


def test_normalisers_are_the_callers():
    loss = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # this micro-batch is one of several: the step has 12 tokens and 5 sequences
    assert agg(loss, mask, "token-mean", total_tokens=12).item() == pytest.approx(6 / 12)
    assert agg(loss, mask, "seq-mean-token-mean", total_sequences=5).item() == pytest.approx(2 / 5)
    assert agg(loss, mask, "seq-mean-token-sum-norm", total_sequences=5, max_length=10).item() == pytest.approx(6 / 50)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_empty_masks_give_zero_not_nan(mode):
    loss = torch.full((2, 3), NAN, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    empty_step = dict(total_tokens=0, total_sequences=0, max_length=3)
    empty_micro_batch = dict(total_tokens=7, total_sequences=2, max_length=3)  # other micro-batches have tokens
    for totals in (empty_step, empty_micro_batch):
        out = agg(loss, mask, mode, **totals)
        assert out.item() == 0.0
        (grad,) = torch.autograd.grad(out, loss)
        assert (grad == 0).all()


def test_unknown_mode_and_missing_normaliser():
    loss, mask = torch.ones(1, 2), torch.ones(1, 2)
    valid = "token-mean.*seq-mean-token-mean.*seq-mean-token-sum.*seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match=valid):
        agg(loss, mask, "mean", total_tokens=2, total_sequences=1, max_length=2)
    with pytest.raises(ValueError, match="total_tokens"):
        agg(loss, mask, "token-mean", total_sequences=1)
    with pytest.raises(ValueError, match="max_length"):
        agg(loss, mask, "seq-mean-token-sum-norm", total_tokens=2, total_sequences=1)


def test_count_valid():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert count_valid(mask) == (3, 2)  # the empty sequence does not count


# ---------------------------------------------------------------------------- micro-batch invariance


def _batch():
    gen = torch.Generator().manual_seed(1)
    B, T, K = 8, 7, 3
    lengths = torch.tensor([7, 1, 3, 0, 5, 2, 6, 4])  # very different lengths, and one empty sequence
    mask = torch.arange(T)[None, :] < lengths[:, None]
    features = torch.randn(B, T, K, generator=gen)
    old = -torch.rand(B, T, generator=gen) * 2
    ref = old + 0.1 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, 1, generator=gen).expand(B, T)
    return mask, features, old, ref, adv


def _loss_BT(theta, features, old, ref, adv, mask):
    """A tiny "policy": log-probs depend on shared parameters theta, so every sequence feeds one gradient."""
    lp = old + 0.3 * (features @ theta)
    loss, _ = ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    return loss + 0.04 * torch.where(mask, kl_k3(lp, ref), 0.0)


def _gradient(mode, splits, *, scope="minibatch"):
    mask, features, old, ref, adv = _batch()
    theta = torch.tensor([0.5, -0.3, 0.8], requires_grad=True)
    step_tokens, step_sequences = count_valid(mask)
    total = 0.0
    for idx in torch.tensor_split(torch.arange(8), splits):
        m = mask[idx]
        tokens, sequences, scale = loss_normalisers(m, scope=scope, step_tokens=step_tokens,
                                                    step_sequences=step_sequences, num_micro_batches=splits)
        loss_BT = _loss_BT(theta, features[idx], old[idx], ref[idx], adv[idx], m)
        out = scale * aggregate_loss(loss_BT, m, mode=mode, total_tokens=tokens, total_sequences=sequences,
                                     max_length=7)
        out.backward()  # gradient accumulation, as in training
        total += out.item()
    return theta.grad.clone(), total


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_micro_batch_split_gives_the_same_gradient(mode):
    full_grad, full_value = _gradient(mode, 1)
    micro_grad, micro_value = _gradient(mode, 4)
    assert full_grad.abs().sum() > 0
    assert torch.allclose(full_grad, micro_grad, rtol=1e-5, atol=1e-7)
    assert micro_value == pytest.approx(full_value, rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_per_micro_batch_normalisation_would_break_invariance(mode):
    # the trap the step-level normalisers avoid: the same split, each part divided by its own counts
    full_grad, _ = _gradient(mode, 1)
    assert torch.allclose(full_grad, _gradient(mode, 1, scope="micro_batch")[0])  # one micro-batch: no difference
    naive_grad, _ = _gradient(mode, 4, scope="micro_batch")
    assert not torch.allclose(full_grad, naive_grad, rtol=1e-3)


# ---------------------------------------------------------------------------- token-mean scope (profiles)


def test_loss_normalisers_by_hand():
    micro_mask = torch.tensor([[1, 1, 0], [0, 0, 0]])  # 2 tokens, 1 non-empty sequence
    step = dict(step_tokens=10, step_sequences=4, num_micro_batches=4)
    assert loss_normalisers(micro_mask, scope="minibatch", **step) == (10, 4, 1.0)
    assert loss_normalisers(micro_mask, scope="micro_batch", **step) == (2, 1, 0.25)


def test_loss_normalisers_reject_unknown_scope_and_zero_micro_batches():
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"\['minibatch', 'micro_batch'\]"):
        loss_normalisers(mask, scope="global", step_tokens=2, step_sequences=1, num_micro_batches=1)
    with pytest.raises(ValueError, match="num_micro_batches"):
        loss_normalisers(mask, scope="micro_batch", step_tokens=2, step_sequences=1, num_micro_batches=0)


# four sequences of lengths 3, 1, 2, 2; the loss is theta * x, so d loss / d theta is the aggregated x
X = [[1.0, 2.0, 3.0], [4.0], [5.0, 6.0], [7.0, 8.0]]


def _scoped_gradient(mode, scope, micro_batch_size):
    """d(step loss)/d theta, accumulated over micro-batches exactly as the training loop does it."""
    x = torch.zeros(4, 3)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    for i, row in enumerate(X):
        x[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    theta = torch.tensor(1.0, requires_grad=True)
    step_tokens, step_sequences = count_valid(mask)
    starts = range(0, 4, micro_batch_size)
    for m0 in starts:
        m = mask[m0 : m0 + micro_batch_size]
        tokens, sequences, scale = loss_normalisers(m, scope=scope, step_tokens=step_tokens,
                                                    step_sequences=step_sequences, num_micro_batches=len(starts))
        loss = scale * aggregate_loss(theta * x[m0 : m0 + micro_batch_size], m, mode=mode, total_tokens=tokens,
                                      total_sequences=sequences, max_length=3)
        loss.backward()
    return theta.grad.item()


def test_minibatch_scope_is_split_invariant_and_micro_batch_scope_is_the_mean_of_micro_batch_means():
    # token-mean over the step: (1+2+3+4+5+6+7+8) / 8 = 36 / 8 = 4.5, however the step is split
    for micro_batch_size in (4, 1, 3):
        assert _scoped_gradient("token-mean", "minibatch", micro_batch_size) == pytest.approx(4.5)
    # micro_batch, one micro-batch: the same 4.5
    assert _scoped_gradient("token-mean", "micro_batch", 4) == pytest.approx(4.5)
    # micro_batch, 4 micro-batches of one sequence: their means 6/3, 4/1, 11/2, 15/2 = 2, 4, 5.5, 7.5,
    # averaged (each scaled by 1/4, as the frameworks divide by gradient-accumulation steps): 19/4 = 4.75
    assert _scoped_gradient("token-mean", "micro_batch", 1) == pytest.approx(4.75)
    # micro-batches of 3 and 1 sequences: (1+2+3+4+5+6)/6 = 3.5 and 7.5 -> (3.5 + 7.5)/2 = 5.5
    assert _scoped_gradient("token-mean", "micro_batch", 3) == pytest.approx(5.5)
    # seq-mean-token-mean: sequence means 2, 4, 5.5, 7.5 -> 19/4 = 4.75 over the step;
    # split 3 + 1: (2 + 4 + 5.5)/3 = 3.8333 and 7.5 -> (3.8333 + 7.5)/2 = 5.6667
    assert _scoped_gradient("seq-mean-token-mean", "minibatch", 3) == pytest.approx(4.75)
    assert _scoped_gradient("seq-mean-token-mean", "micro_batch", 3) == pytest.approx((11.5 / 3 + 7.5) / 2)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("scope", TOKEN_MEAN_SCOPES)
def test_one_micro_batch_gives_the_same_gradient_in_both_scopes(mode, scope):
    assert _scoped_gradient(mode, scope, 4) == pytest.approx(_scoped_gradient(mode, "minibatch", 1))
