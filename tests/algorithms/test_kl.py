"""KL estimators: hand values, direction of k3, clamps, and the unbiased importance-weighted gradient."""
import math

import pytest
import torch

from rlpipe.algorithms.kl import (
    KL_ESTIMATORS,
    get_kl_estimator,
    importance_weighted_kl,
    kl_k1,
    kl_k2,
    kl_k3,
)


def t(*values, dtype=torch.float64):
    return torch.tensor([list(values)], dtype=dtype)


def test_k1_k2_k3_by_hand():
    lp, ref = t(-1.0), t(-1.5)  # log rho = ref - lp = -0.5
    assert kl_k1(lp, ref).item() == pytest.approx(0.5)
    assert kl_k2(lp, ref).item() == pytest.approx(0.5 * 0.25)
    assert kl_k3(lp, ref).item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)  # 0.10653


def test_k3_is_written_with_ref_over_theta():
    # swapping the fraction gives e^{+0.5} - 1 - 0.5 = 0.1487, not 0.1065
    assert kl_k3(t(-1.0), t(-1.5)).item() == pytest.approx(0.106531, abs=1e-6)
    assert kl_k3(t(-1.5), t(-1.0)).item() == pytest.approx(0.148721, abs=1e-6)


def test_outputs_are_float32_and_k3_nonnegative():
    lp = torch.randn(4, 7, dtype=torch.bfloat16)
    ref = torch.randn(4, 7, dtype=torch.float64)
    for fn in KL_ESTIMATORS.values():
        assert fn(lp, ref).dtype == torch.float32
    assert (kl_k3(lp, ref) >= 0).all()


def test_k1_and_k3_are_unbiased_under_the_policy():
    # exact expectation over a 5-token vocabulary: E_theta[k] = KL(theta || ref) for k1 and k3
    logp = torch.log_softmax(torch.tensor([0.3, -1.0, 2.0, 0.0, -0.5], dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, 0.5, -1.0, 0.2], dtype=torch.float64), -1)
    kl = (logp.exp() * (logp - ref)).sum()
    for fn in (kl_k1, kl_k3):
        assert (logp.exp() * fn(logp, ref).double()).sum().item() == pytest.approx(kl.item(), rel=1e-6)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_extreme_log_ratios_give_finite_values_and_gradients(name):
    lp = torch.tensor([[1000.0, -1000.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1000.0, 1000.0, 0.0]])
    old = torch.tensor([[-1000.0, 1000.0, 0.0]])
    for value in (get_kl_estimator(name)(lp, ref), importance_weighted_kl(lp, old, ref, estimator=name)):
        assert torch.isfinite(value).all()
        assert (value.abs() <= 10.0).all()  # value clamp
        (grad,) = torch.autograd.grad(value.sum(), lp)
        assert torch.isfinite(grad).all()


def test_value_clamps():
    # log rho = -1000 clamped to -20: k1 = 20 -> clamped to 10; k3 at log rho = +20 is e^20 - 21 -> 10
    assert kl_k1(t(1000.0), t(0.0)).item() == 10.0
    assert kl_k3(t(0.0), t(1000.0)).item() == 10.0
    assert kl_k2(t(0.0), t(4.0)).item() == 8.0  # 0.5 * 16, inside the clamp


def test_importance_weighted_kl_by_hand():
    lp, old, ref = t(-1.0), t(-1.2), t(-1.5)
    # weight pi_theta / pi_old = e^{0.2}; k3 = e^{-0.5} - 1 + 0.5
    expected = math.exp(0.2) * (math.exp(-0.5) - 0.5)
    assert importance_weighted_kl(lp, old, ref, estimator="k3").item() == pytest.approx(expected, rel=1e-6)
    # at pi_theta == pi_old the weight is 1 numerically
    assert importance_weighted_kl(lp, lp, ref, estimator="k3").item() == pytest.approx(kl_k3(lp, ref).item())


def _categorical_setup():
    theta = torch.tensor([0.3, -1.0, 2.0, 0.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.log_softmax(torch.tensor([0.0, -0.4, 1.5, 0.3, 0.1], dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, 0.5, -1.0, 0.2], dtype=torch.float64), -1)
    return theta, old, ref


def _expected_grad_under_old(theta, old, ref, *, estimator, detach_weight):
    """E_{x ~ pi_old}[grad D(x)], exactly, by summing over the vocabulary (pi_old does not depend on theta)."""
    logp = torch.log_softmax(theta, -1)
    if detach_weight:
        d = (logp - old).exp().detach() * get_kl_estimator(estimator)(logp, ref)
    else:
        d = importance_weighted_kl(logp, old, ref, estimator=estimator)
    (grad,) = torch.autograd.grad((old.exp() * d.double()).sum(), theta)
    return grad


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_weight_with_gradient_gives_unbiased_gradient_of_reverse_kl(estimator):
    theta, old, ref = _categorical_setup()
    logp = torch.log_softmax(theta, -1)
    (true_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)  # grad KL(theta || ref)
    grad = _expected_grad_under_old(theta, old, ref, estimator=estimator, detach_weight=False)
    torch.testing.assert_close(grad, true_grad, rtol=1e-5, atol=1e-6)


def test_detached_weight_would_give_the_gradient_of_the_other_kl():
    # why the weight must carry gradient: detached, k3 yields grad KL(ref || theta) instead
    theta, old, ref = _categorical_setup()
    logp = torch.log_softmax(theta, -1)
    (forward_kl_grad,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta, retain_graph=True)
    (reverse_kl_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    grad = _expected_grad_under_old(theta, old, ref, estimator="k3", detach_weight=True)
    torch.testing.assert_close(grad, forward_kl_grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grad, reverse_kl_grad, atol=1e-3)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match=r"\['k1', 'k2', 'k3'\]"):
        get_kl_estimator("k4")
    with pytest.raises(ValueError, match="k4"):
        importance_weighted_kl(t(0.0), t(0.0), t(0.0), estimator="k4")


# ---------------------------------------------------------------------------- clamp options (profiles)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_default_clamps_are_bit_identical_to_the_explicit_20_and_10(name):
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 9, generator=gen) * 15  # many log-ratios beyond 20 and values beyond 10
    ref = torch.randn(3, 9, generator=gen) * 15
    old = torch.randn(3, 9, generator=gen) * 15
    fn = get_kl_estimator(name)
    assert torch.equal(fn(lp, ref), fn(lp, ref, log_ratio_clamp=20.0, value_clamp=10.0))
    assert torch.equal(importance_weighted_kl(lp, old, ref, estimator=name),
                       importance_weighted_kl(lp, old, ref, estimator=name, log_ratio_clamp=20.0, value_clamp=10.0))
    # and to the formula as written before the options existed
    log_rho = (ref - lp).clamp(-20.0, 20.0)
    before = {"k1": -log_rho, "k2": 0.5 * log_rho**2, "k3": torch.exp(log_rho) - 1.0 - log_rho}[name]
    assert torch.equal(fn(lp, ref), before.clamp(-10.0, 10.0))


def test_each_clamp_by_hand_and_off():
    # log rho = ref - lp = 25: k1 = -25
    lp, ref = t(0.0), t(25.0)
    assert kl_k1(lp, ref).item() == -10.0  # -25 -> log clamp -20 -> value clamp -10
    assert kl_k1(lp, ref, value_clamp=None).item() == -20.0  # log clamp only (20)
    assert kl_k1(lp, ref, log_ratio_clamp=None).item() == -10.0  # value clamp only (OpenRLHF)
    assert kl_k1(lp, ref, log_ratio_clamp=None, value_clamp=None).item() == -25.0  # neither (TRL)
    # log rho = 3 (inside the log clamp): k3 = e^3 - 1 - 3 = 16.0855 -> value clamp 10
    lp, ref = t(0.0), t(3.0)
    assert kl_k3(lp, ref).item() == 10.0
    assert kl_k3(lp, ref, value_clamp=None).item() == pytest.approx(math.exp(3) - 4, rel=1e-6)  # 16.0855
    assert kl_k3(lp, ref, log_ratio_clamp=1.0, value_clamp=None).item() == pytest.approx(math.exp(1) - 2, rel=1e-6)
    # log rho = -5: k2 = 0.5 * 25 = 12.5 -> 10
    assert kl_k2(t(0.0), t(-5.0)).item() == 10.0
    assert kl_k2(t(0.0), t(-5.0), value_clamp=None).item() == 12.5
    assert kl_k2(t(0.0), t(-5.0), value_clamp=4.0).item() == 4.0


def test_importance_weighted_kl_clamps_by_hand():
    lp, old, ref = t(0.0), t(-3.0), t(-1.0)
    # k3 at log rho = -1: e^-1 - 1 + 1 = e^-1; weight e^{0 - (-3)} = e^3 -> D = e^2 = 7.389 (inside 10)
    assert importance_weighted_kl(lp, old, ref, estimator="k3").item() == pytest.approx(math.exp(2), rel=1e-6)
    assert importance_weighted_kl(lp, old, ref, estimator="k3", value_clamp=5.0).item() == 5.0
    # the log clamp bounds the weight's log-ratio too: e^{min(3, 2)} * e^-1 = e
    out = importance_weighted_kl(lp, old, ref, estimator="k3", log_ratio_clamp=2.0)
    assert out.item() == pytest.approx(math.e, rel=1e-6)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamps", [(20.0, 10.0), (5.0, 2.0), (20.0, None), (None, 10.0)])
def test_extreme_inputs_give_finite_values_with_any_clamp_on(name, clamps):
    log_ratio_clamp, value_clamp = clamps
    lp = torch.tensor([[1000.0, -1000.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1000.0, 1000.0, 0.0]])
    kw = dict(log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp)
    for value in (get_kl_estimator(name)(lp, ref, **kw), importance_weighted_kl(lp, ref, ref, estimator=name, **kw)):
        assert torch.isfinite(value).all()
        if value_clamp is not None:
            assert (value.abs() <= value_clamp).all()
        if log_ratio_clamp is not None:  # the gradient is finite only if exp never overflows
            (grad,) = torch.autograd.grad(value.sum(), lp)
            assert torch.isfinite(grad).all()


def test_without_the_log_clamp_k3_value_is_finite_but_its_gradient_is_not():
    # the OpenRLHF convention: exp(2000) = inf, clamped to 10; backward multiplies 0 by inf
    lp = torch.tensor([[-1000.0]], requires_grad=True)
    value = kl_k3(lp, t(1000.0, dtype=torch.float32), log_ratio_clamp=None)
    assert value.item() == 10.0
    (grad,) = torch.autograd.grad(value.sum(), lp)
    assert not torch.isfinite(grad).all()


def test_clamp_bounds_must_be_positive_or_none():
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_k3(t(0.0), t(0.0), log_ratio_clamp=0.0)
    with pytest.raises(ValueError, match="value_clamp"):
        importance_weighted_kl(t(0.0), t(0.0), t(0.0), estimator="k1", value_clamp=-1.0)
