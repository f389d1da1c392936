"""Policy / value / entropy terms: worked examples, clip variants, GSPO gradients, padding and extremes."""
import math

import pytest
import torch

from rlpipe.algorithms.aggregation import aggregate_loss
from rlpipe.algorithms.losses import (
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    cispo_loss,
    gmpo_loss,
    sapo_loss,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    gspo_token_loss,
    off_policy_sequence_mask,
    health_to_host,
    masked_mean,
    policy_health_metrics,
    policy_health_tensors,
    ppo_clip_loss,
    truncated_importance_weights,
    value_loss,
)

CLIP = dict(eps_low=0.2, eps_high=0.2, dual_clip_c=None)
NO_DUAL_CLIP = ("cispo", "sapo", "gmpo")
OPTIONS = {"ratio_cap": 4.0, "tau_pos": 1.0, "tau_neg": 1.05, "clip_sign": "token"}


def keywords(name, **clip):
    """The shared clip keywords plus the loss's own options; dual clip off where the loss has none."""
    if name in NO_DUAL_CLIP:
        clip = {**clip, "dual_clip_c": None}
    return {**clip, **{k: OPTIONS[k] for k in POLICY_LOSS_OPTIONS[name]}}


def row(*values, grad=False):
    return torch.tensor([list(values)], dtype=torch.float32, requires_grad=grad)


def ppo_one_token(new, old, adv, **clip):
    lp = row(new, grad=True)
    loss, stats = ppo_clip_loss(lp, row(old), row(adv), torch.ones(1, 1, dtype=torch.bool), **clip)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.item(), grad.item(), stats


# ---------------------------------------------------------------------------- PPO-clip


def test_ppo_clip_worked_example():
    # r = e^{-1.8 + 2.1} = e^0.3 = 1.3499 -> clipped to 1.2; A 0.2: unclipped 0.27, clipped 0.24 -> J 0.24
    loss, grad, stats = ppo_one_token(-1.8, -2.1, 0.2, **CLIP)
    assert loss == pytest.approx(-0.24, abs=1e-6)
    assert grad == 0.0  # no gradient through the clipped branch
    assert stats["ratio_BT"].item() == pytest.approx(math.exp(0.3), rel=1e-6)
    assert stats["clipped_BT"].item() is True


def test_ppo_unclipped_token_has_policy_gradient():
    # r = e^0.1 = 1.105 (inside [0.8, 1.2]); loss = -r A, d loss / d log pi = -r A
    loss, grad, stats = ppo_one_token(-2.0, -2.1, 0.2, **CLIP)
    assert loss == pytest.approx(-math.exp(0.1) * 0.2, rel=1e-6)
    assert grad == pytest.approx(-math.exp(0.1) * 0.2, rel=1e-6)
    assert stats["clipped_BT"].item() is False


def test_ppo_negative_advantage_clipped_below():
    # r = e^{-0.4} = 0.670; A = -1: unclipped -0.670, clipped 0.8 * -1 = -0.8 -> J = -0.8 -> loss 0.8
    loss, grad, stats = ppo_one_token(-2.5, -2.1, -1.0, **CLIP)
    assert loss == pytest.approx(0.8, abs=1e-6)
    assert grad == 0.0 and stats["clipped_BT"].item() is True


def test_clip_higher_is_asymmetric():
    up = math.log(1.25)
    # A > 0, r = 1.25: symmetric 0.2 clips at 1.2; clip-higher 0.28 leaves it (1.25 < 1.28)
    loss, grad, _ = ppo_one_token(up, 0.0, 1.0, eps_low=0.2, eps_high=0.2, dual_clip_c=None)
    assert (loss, grad) == (pytest.approx(-1.2), 0.0)
    loss, grad, _ = ppo_one_token(up, 0.0, 1.0, eps_low=0.2, eps_high=0.28, dual_clip_c=None)
    assert loss == pytest.approx(-1.25, rel=1e-6) and grad == pytest.approx(-1.25, rel=1e-6)
    # A < 0, r = 0.75: the low side still clips at 1 - eps_low = 0.8 whatever eps_high is
    loss, grad, _ = ppo_one_token(math.log(0.75), 0.0, -1.0, eps_low=0.2, eps_high=0.28, dual_clip_c=None)
    assert (loss, grad) == (pytest.approx(0.8), 0.0)


def test_dual_clip_bounds_negative_advantage_loss():
    big = math.log(5.0)  # r = 5, A = -1
    # off: J = min(-5, 1.2 * -1) = -5 -> loss 5, d loss / d log pi = -r A = 5
    loss, grad, stats = ppo_one_token(big, 0.0, -1.0, eps_low=0.2, eps_high=0.2, dual_clip_c=None)
    assert loss == pytest.approx(5.0, rel=1e-6) and grad == pytest.approx(5.0, rel=1e-6)
    assert stats["dual_clipped_BT"].item() is False
    # c = 3: J = max(-5, 3 * -1) = -3 -> loss 3, constant -> no gradient
    loss, grad, stats = ppo_one_token(big, 0.0, -1.0, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert stats["dual_clipped_BT"].item() is True
    # c = 10: -10 < -5, the floor is not reached
    loss, _, stats = ppo_one_token(big, 0.0, -1.0, eps_low=0.2, eps_high=0.2, dual_clip_c=10.0)
    assert loss == pytest.approx(5.0, rel=1e-6) and stats["dual_clipped_BT"].item() is False
    # dual clip never touches positive advantages
    loss, _, _ = ppo_one_token(big, 0.0, 1.0, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    assert loss == pytest.approx(-1.2)


def test_clip_arguments_are_validated():
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_one_token(0.0, 0.0, 1.0, eps_low=0.2, eps_high=0.2, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_one_token(0.0, 0.0, 1.0, eps_low=1.5, eps_high=0.2, dual_clip_c=None)


# ---------------------------------------------------------------------------- GSPO


def test_gspo_by_hand_and_seq_mean_token_mean_gives_gspo_objective():
    lp = torch.tensor([[0.1, 0.3, 0.0], [0.01, 0.01, 0.01]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    loss, stats = gspo_loss(lp, old, adv, mask, eps_low=0.3, eps_high=0.3, dual_clip_c=None)
    # seq 0: mean log-ratio (0.1 + 0.3) / 2 = 0.2, s = e^0.2 = 1.2214 (inside 1 +- 0.3): J = 0.5 e^0.2
    # seq 1: s = e^0.01, A = -1: J = -e^0.01
    j0, j1 = 0.5 * math.exp(0.2), -math.exp(0.01)
    torch.testing.assert_close(loss, torch.tensor([[-j0, -j0, 0.0], [-j1, -j1, -j1]]))
    torch.testing.assert_close(stats["seq_ratio_B"], torch.tensor([math.exp(0.2), math.exp(0.01)]))
    total = aggregate_loss(loss, mask, mode="seq-mean-token-mean", total_tokens=5, total_sequences=2, max_length=3)
    assert total.item() == pytest.approx(-(j0 + j1) / 2, rel=1e-6)


def test_gspo_tiny_published_clip_range():
    lp = torch.tensor([[0.01, 0.01]])
    adv = torch.tensor([[1.0, 1.0]])
    # s = e^0.01 = 1.01005 > 1 + 4e-4 -> clipped: J = 1.0004
    loss, stats = gspo_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), eps_low=3e-4, eps_high=4e-4, dual_clip_c=None)
    torch.testing.assert_close(loss, torch.full((1, 2), -1.0004))
    assert stats["seq_clipped_B"].tolist() == [True] and stats["clipped_BT"].all()


GSPO_CLIPS = [dict(eps_low=0.05, eps_high=0.08, dual_clip_c=None), dict(eps_low=0.05, eps_high=0.08, dual_clip_c=1.01)]


@pytest.mark.parametrize("clip", GSPO_CLIPS)
def test_gspo_token_gradient_equals_gspo_gradient_when_token_advantages_are_equal(clip):
    gen = torch.Generator().manual_seed(0)
    rows = [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    mask = torch.tensor(rows, dtype=torch.bool)
    old = -torch.rand(5, 6, generator=gen) * 3
    noise = 0.05 * torch.randn(5, 6, generator=gen) * mask
    noise = noise - (noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True)) * mask  # zero mean per sequence
    # mean log-ratio per sequence (log s_i) and A_i, chosen so that:
    # seq 0: s = e^0.2 > 1.08, A > 0 -> clipped; seq 3: s = e^-0.3 < 0.95, A < 0 -> clipped;
    # seq 1: s = e^0.02, A = -0.5 -> J = -0.5101 < 1.01 * A = -0.505 -> dual-clipped when on;
    # seqs 2 and 4: inside the range -> policy gradient flows
    log_s = torch.tensor([0.2, 0.02, -0.03, -0.3, 0.05])
    base = old + log_s[:, None] + noise
    seq_adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3])
    adv = seq_adv[:, None].expand(5, 6)
    grads, values, clipped, dual = [], [], [], []
    for fn in (gspo_loss, gspo_token_loss):
        lp = base.clone().requires_grad_(True)
        loss, stats = fn(lp, old, adv, mask, **clip)
        total = aggregate_loss(
            loss, mask, mode="seq-mean-token-mean", total_tokens=None, total_sequences=5, max_length=None
        )
        (grad,) = torch.autograd.grad(total, lp)
        grads.append(grad)
        values.append(total.detach())
        clipped.append(stats["seq_clipped_B"])
        dual.append(stats["dual_clipped_BT"].any(dim=1).tolist())
    assert clipped[0].tolist() == clipped[1].tolist() == [True, False, False, True, False]
    assert dual[0] == dual[1] == [False, clip["dual_clip_c"] is not None, False, False, False]
    for i in (2, 4):
        assert grads[0][i].abs().sum() > 0
    torch.testing.assert_close(values[0], values[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-7)


def test_gspo_token_uses_each_token_advantage():
    lp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]])
    loss, _ = gspo_token_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), eps_low=0.2, eps_high=0.2, dual_clip_c=None)
    # s = 1 (inside the range): d(-s A_t)/d log pi_t = -A_t
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 2.0]]))


@pytest.mark.parametrize("clamp, loss_per_token, grad_per_token", [
    (10.0, math.exp(10.0), 0.0),  # verl: capped value, gradient switched off beyond the clamp
    (20.0, math.exp(12.0), math.exp(12.0) / 2),  # rlpipe: inside the clamp, s_i * grad log pi / 2 tokens
    (None, math.exp(12.0), math.exp(12.0) / 2),  # TRL: no clamp
])
def test_gspo_token_clamp_on_the_issue_16_example(clamp, loss_per_token, grad_per_token):
    # old [-1, -1], log pi [11, 11]: log s = 12; A = -1, token-mean over 2 tokens
    lp = torch.tensor([[11.0, 11.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-1.0, -1.0]]), -torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    loss, stats = gspo_token_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=None,
                                  log_ratio_clamp=clamp)
    total = aggregate_loss(loss, mask, mode="token-mean", total_tokens=2, total_sequences=1, max_length=None)
    # unclipped -s A = s wins over clip(s) A = -1.2: the loss is s, e^10 = 22026.47 or e^12 = 162754.79
    assert total.item() == pytest.approx(loss_per_token, rel=1e-6)
    assert total.item() == pytest.approx(22026.5 if clamp == 10.0 else 162754.8, abs=0.05)
    (grad,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(grad, torch.full((1, 2), grad_per_token), rtol=1e-6, atol=0.0)
    assert stats["seq_ratio_B"].item() == pytest.approx(loss_per_token, rel=1e-6)


def test_gspo_sequence_log_ratio_is_clamped_from_above_only():
    lp = torch.tensor([[30.0], [-30.0]], requires_grad=True)
    loss, stats = gspo_loss(lp, torch.zeros(2, 1), torch.tensor([[-1.0], [1.0]]), torch.ones(2, 1), **CLIP,
                            log_ratio_clamp=10.0)
    torch.testing.assert_close(stats["seq_ratio_B"], torch.tensor([math.exp(10.0), math.exp(-30.0)]))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad[0].item() == 0.0  # beyond the clamp


def test_ppo_clip_log_ratio_clamp_is_a_keyword_and_none_turns_it_off():
    lp = torch.tensor([[25.0]], requires_grad=True)
    adv = -torch.ones(1, 1)
    loss20, _ = ppo_clip_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), **CLIP)
    loss_off, stats = ppo_clip_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), **CLIP, log_ratio_clamp=None)
    assert loss20.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert loss_off.item() == pytest.approx(math.exp(25.0), rel=1e-6)  # TRL: unclamped
    assert stats["log_ratio_BT"].item() == 25.0
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        ppo_clip_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), **CLIP, log_ratio_clamp=0.0)


def test_ratio_cap_is_trls_two_sided_clip():
    # r = e^2 = 7.389, A = -1, delta 4: unclipped min(r, 4) A = -4 < clip(r) A = -1.2 -> loss 4, gradient 0
    lp = torch.tensor([[2.0]], requires_grad=True)
    adv = -torch.ones(1, 1)
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), **CLIP, ratio_cap=4.0)
    assert loss.item() == pytest.approx(4.0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad.item() == 0.0
    plain, _ = ppo_clip_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), **CLIP)
    assert plain.item() == pytest.approx(math.exp(2.0))
    # below the cap nothing changes: r = e^0.1 inside [0.8, 1.2], A = 1 -> J = r
    inside, _ = ppo_clip_loss(torch.tensor([[0.1]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), **CLIP,
                              ratio_cap=4.0)
    assert inside.item() == pytest.approx(-math.exp(0.1))
    with pytest.raises(ValueError, match="ratio_cap"):
        ppo_clip_loss(lp, torch.zeros(1, 1), adv, torch.ones(1, 1), **CLIP, ratio_cap=1.0)


# ---------------------------------------------------------------------------- CISPO, SAPO, GMPO


def test_cispo_by_hand():
    # old -1, new -0.5: r = e^0.5 = 1.6487 -> weight clip(r, 0.8, 1.2) = 1.2 (no gradient through it)
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[2.0, -1.0]])
    loss, stats = cispo_loss(lp, old, adv, torch.ones(1, 2), eps_low=0.2, eps_high=0.2, dual_clip_c=None)
    # token 0: -1.2 * 2 * -0.5 = 1.2; token 1: r = 1, weight 1: -1 * -1 * -1 = -1
    torch.testing.assert_close(loss, torch.tensor([[1.2, -1.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[-2.4, 1.0]]))  # -w A: the clipped token still has a gradient
    assert stats["clipped_BT"].tolist() == [[True, False]]
    # TRL's form: no lower bound (eps_low 1), absolute cap 5 (eps_high 4): r = e^-3 stays e^-3
    loss, _ = cispo_loss(torch.tensor([[-4.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1), torch.ones(1, 1),
                         eps_low=1.0, eps_high=4.0, dual_clip_c=None)
    assert loss.item() == pytest.approx(-math.exp(-3.0) * -4.0)
    with pytest.raises(ValueError, match="dual clip"):
        cispo_loss(lp, old, adv, torch.ones(1, 2), eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)


def test_sapo_by_hand_and_on_policy_gradient_is_ppos():
    lp = torch.tensor([[0.0, 0.5, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    loss, _ = sapo_loss(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), eps_low=0.2, eps_high=0.2, dual_clip_c=None,
                        tau_pos=1.0, tau_neg=2.0)
    sig = 1 / (1 + math.exp(-(math.exp(0.5) - 1)))  # tau 1: sigmoid(e^0.5 - 1) = sigmoid(0.6487)
    # r = 1: f = sigmoid(0) 4 / tau = 2 / tau -> token 0: -2; token 2 (tau_neg 2): f = 1, loss -1 * -2 = 2
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -4.0 * sig, 2.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    # on-policy (r = 1) the gate's gradient is 4 sigmoid'(0) r = 1 for every tau: -A, as PPO
    assert grad[0, 0].item() == pytest.approx(-1.0) and grad[0, 2].item() == pytest.approx(2.0)
    # token 1: d/dl of -4 sigmoid(e^l - 1) = -4 s (1 - s) e^0.5
    assert grad[0, 1].item() == pytest.approx(-4 * sig * (1 - sig) * math.exp(0.5), rel=1e-6)


def test_gmpo_by_hand():
    # l = [0.5, -0.1], eps 0.4 (log space)
    lp = torch.tensor([[0.5, -0.1], [0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, stats = gmpo_loss(lp, torch.zeros(2, 2), adv, torch.ones(2, 2), eps_low=0.4, eps_high=0.4, dual_clip_c=None)
    # A > 0: min(l, clip(l)) = [0.4, -0.1] -> mean 0.15 -> J = e^0.15; A < 0: max(l, clip(l)) = [0.5, -0.1] -> e^0.2
    torch.testing.assert_close(loss, torch.tensor([[-math.exp(0.15)] * 2, [math.exp(0.2)] * 2]))
    torch.testing.assert_close(stats["seq_ratio_B"], torch.tensor([math.exp(0.15), math.exp(0.2)]))
    assert stats["clipped_BT"].tolist() == [[True, False], [False, False]]
    total = aggregate_loss(loss, torch.ones(2, 2), mode="seq-mean-token-mean", total_tokens=4, total_sequences=2,
                           max_length=None)
    assert total.item() == pytest.approx((-math.exp(0.15) + math.exp(0.2)) / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(total, lp)
    # the clipped token has no gradient; token 1 of row 0: -(1/2) A e^0.15 / 2 tokens (1/2 from the sequence mean)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(0.15) / 4], [math.exp(0.2) / 4] * 2]))


# ---------------------------------------------------------------------------- padding and extremes


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_padding_never_influences_outputs_or_gradients(name):
    fn = get_policy_loss(name)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    lp = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.3, -1.1, 0.0, 0.0]])
    old = torch.tensor([[-1.1, -0.4, -2.2, 0.0], [-0.2, -1.0, 0.0, 0.0]])
    adv = torch.tensor([[0.5, 0.5, 0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    garbage = torch.tensor([[0, 0, 0, float("nan")], [0, 0, 1e30, -float("inf")]])
    results = []
    for extra in (torch.zeros(2, 4), garbage):
        x = (torch.where(mask, lp, extra)).requires_grad_(True)
        loss, stats = fn(x, torch.where(mask, old, extra), torch.where(mask, adv, extra), mask,
                         **keywords(name, **CLIP))
        (grad,) = torch.autograd.grad(loss.sum(), x)
        results.append((loss, grad, stats))
    (loss0, grad0, stats0), (loss1, grad1, stats1) = results
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert (loss1[~mask] == 0).all() and (grad1[~mask] == 0).all() and torch.isfinite(grad1).all()
    for key in ("ratio_BT", "clipped_BT", "dual_clipped_BT"):
        assert torch.equal(stats0[key], stats1[key])
        assert not stats1[key][~mask].any()
        assert not stats1[key].requires_grad


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_extreme_log_ratios_give_finite_loss_and_gradient(name, dual_clip_c):
    lp = torch.tensor([[1000.0, -1000.0], [1000.0, 0.0], [-1000.0, 0.0]], requires_grad=True)
    old = torch.zeros(3, 2)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]], dtype=torch.bool)
    for sign in (1.0, -1.0):
        adv = sign * torch.ones(3, 2)
        loss, _ = get_policy_loss(name)(lp, old, adv, mask, **keywords(name, eps_low=0.2, eps_high=0.28,
                                                                       dual_clip_c=dual_clip_c))
        (grad,) = torch.autograd.grad(loss.sum(), lp)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


def test_unknown_policy_loss_lists_valid_names():
    with pytest.raises(ValueError, match=r"\['cispo', 'gmpo', 'gspo', 'gspo_token', 'ppo_clip', 'sapo'\]"):
        get_policy_loss("ppo")


# ---------------------------------------------------------------------------- entropy, value, corrections


def test_entropy_by_hand_and_masked_vocabulary():
    inf = float("inf")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -inf, -inf], [1000.0, 0.0, 0.0, 0.0]], requires_grad=True)
    h = entropy_from_logits(logits)
    # uniform over 4 -> log 4; uniform over the 2 kept tokens -> log 2; one dominant logit -> ~0
    torch.testing.assert_close(h, torch.tensor([math.log(4), math.log(2), 0.0]))
    (grad,) = torch.autograd.grad(h.sum(), logits)
    assert torch.isfinite(grad).all()
    x = torch.randn(3, 11, dtype=torch.float64)
    p = torch.softmax(x, -1)
    torch.testing.assert_close(entropy_from_logits(x), (-(p * p.log()).sum(-1)).float())
    assert entropy_from_logits(x.to(torch.bfloat16)).dtype == torch.float32


def test_value_loss_clipped_by_hand():
    v = torch.tensor([[1.0, 0.6, 9.0]])
    v_old = torch.tensor([[0.5, 0.5, float("nan")]])
    ret = torch.tensor([[1.2, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    # token 0: V_clip = 0.5 + clip(0.5, +-0.2) = 0.7; max((1 - 1.2)^2, (0.7 - 1.2)^2) = 0.25 -> 0.125
    # token 1: V - V_old = 0.1 inside the range -> 0.5 * (0.6 - 1.0)^2 = 0.08
    torch.testing.assert_close(value_loss(v, v_old, ret, mask, clip_eps=0.2), torch.tensor([[0.125, 0.08, 0.0]]))
    # off: 0.5 * 0.04 = 0.02 and 0.08
    torch.testing.assert_close(value_loss(v, v_old, ret, mask, clip_eps=None), torch.tensor([[0.02, 0.08, 0.0]]))


def test_off_policy_sequence_mask_by_hand():
    sampler = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])
    lp = torch.tensor([[-1.2, -1.8], [-1.1, -1.1], [-1.0, -1.0], [-9.0, -9.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    # drift = mean(sampler - theta): [0.5, 0.1, 1.0, (empty) 0]; delta 0.3
    # drop only seq 0 (A < 0 and 0.5 > 0.3); seq 2 is positive; seq 3 has no tokens
    keep = off_policy_sequence_mask(sampler, lp, adv, mask, delta=0.3)
    assert keep.tolist() == [False, True, True, True]


def test_truncated_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -0.5, 0.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -2.0, float("nan")]])
    w = truncated_importance_weights(old, sampler, torch.tensor([[1, 1, 0]]), cap=2.0)
    # e^{0.5} = 1.6487; e^{1.5} = 4.48 -> capped at 2; padding 0
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), 2.0, 0.0]]))
    assert not w.requires_grad


def test_policy_health_metrics_by_hand_and_empty():
    lp = torch.tensor([[math.log(1.5), 0.0, 0.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    _, stats = ppo_clip_loss(lp, old, torch.ones(1, 3), mask, **CLIP)
    m = policy_health_metrics(lp, old, mask, stats)
    # ratios [1.5, 1]: 1.5 clipped -> clip fraction 1/2; approx KL = mean(r - 1 - log r) = (0.5 - log 1.5) / 2
    assert m["clip_fraction"] == 0.5 and m["num_valid_tokens"] == 2
    assert m["approx_kl"] == pytest.approx((0.5 - math.log(1.5)) / 2, rel=1e-5)
    assert (m["ratio_min"], m["ratio_max"]) == (pytest.approx(1.0), pytest.approx(1.5))
    empty = policy_health_metrics(lp, old, torch.zeros(1, 3, dtype=torch.bool), stats)
    assert all(v == 0 for v in empty.values())


def test_policy_health_tensors_are_the_metrics_left_on_the_device():
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [0.0, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    _, stats = ppo_clip_loss(lp, old, torch.ones(2, 3), mask, **CLIP)
    tensors = policy_health_tensors(lp, old, mask, stats)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in tensors.values())
    # ratios [1.5, 0.5, 1]: min 0.5, max 1.5, mean 1; only 1.5 > 1 + 0.2 with A > 0 is clipped
    assert health_to_host([tensors])[0] == policy_health_metrics(lp, old, mask, stats)
    host = policy_health_metrics(lp, old, mask, stats)
    assert (host["ratio_min"], host["ratio_max"], host["num_valid_tokens"]) == (pytest.approx(0.5), pytest.approx(1.5), 3)
    assert host["ratio_mean"] == pytest.approx(1.0) and host["clip_fraction"] == pytest.approx(1 / 3)
    empty = policy_health_tensors(lp, old, torch.zeros(2, 3, dtype=torch.bool), stats)
    assert all(float(v) == 0 for v in empty.values())


def test_masked_mean_and_health_to_host_by_hand():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert float(masked_mean(x, m)) == pytest.approx(7 / 3)  # NaN at a masked-out position never reaches the mean
    assert float(masked_mean(x, torch.zeros_like(m))) == 0.0
    parts = [{"a": torch.tensor(0.1), "num_valid_tokens": torch.tensor(3), "b": 2.5}, {"a": torch.tensor(-1.0)}]
    host = health_to_host(parts)
    assert host == [{"a": float(torch.tensor(0.1)), "num_valid_tokens": 3, "b": 2.5}, {"a": -1.0}]
    assert type(host[0]["num_valid_tokens"]) is int and isinstance(parts[0]["a"], torch.Tensor)  # inputs untouched
    assert health_to_host([{"b": 1.0}]) == [{"b": 1.0}]
