"""The train loop's PPO critic, DeepSeek-V3.2 corrections, truncated IS, early stop and token-mean scope."""
import math

import numpy as np
import pytest
import torch

from rlpipe.algorithms.losses import health_to_host
from rlpipe.models.value_model import ScalarHeadModel
from rlpipe.training.loop import train_policy
from rlpipe.training.objective import Normalisers, micro_batch_loss
from tests.training.test_loop import PAD, config, data, flat, tiny_model, trained


def grads(cfg, d, micro: int, norm_for=None):
    """Gradient of one step over all of ``d`` in micro-batches of ``micro``, with d.old_logprobs set by the caller."""
    model = tiny_model(0)
    model.eval()
    lengths = [len(c) for c in d.completion_token_ids]
    whole = Normalisers(sum(lengths), len(lengths), 6)
    healths = []
    for start in range(0, len(lengths), micro):
        idx = list(range(start, min(start + micro, len(lengths))))
        loss, health = micro_batch_loss(model, None, d, idx, cfg, temperature=0.7, pad_token_id=PAD,
                                        norm_for=norm_for or (lambda mask: whole))
        loss.backward()
        healths.append(health)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), health_to_host(healths)


def with_old(d, shift=0.0):
    """old log-probs = the model's own (so ratios are 1) shifted by ``shift``."""
    model = tiny_model(0)
    from rlpipe.engines.logprobs import batched_completion_logprobs
    old, _ = batched_completion_logprobs(model, d.prompt_token_ids, d.completion_token_ids, pad_token_id=PAD,
                                         temperature=0.7, max_tokens_per_batch=10_000, chunk_size=3,
                                         with_entropy=False)
    d.old_logprobs = [o + shift for o in old]
    return d


def test_off_policy_mask_drops_exactly_the_drifted_negative_sequences():
    cfg = config(kl_beta=0.0, entropy_coef=0.0, off_policy_mask_delta=0.5)
    d = with_old(data())
    negative = [i for i, a in enumerate(d.sequence_advantages) if a < 0]
    positive = [i for i, a in enumerate(d.sequence_advantages) if a > 0]
    assert negative and positive
    # sampler log-probs 1.0 above the trainer's: mean log(pi_sampler / pi_theta) = 1.0 > delta on every row
    d.sampler_logprobs = [o + 1.0 for o in d.old_logprobs]
    masked, health = grads(cfg, d, micro=8)
    # the same step with the negative rows' advantages zeroed (they stay in the normalisers)
    for i in negative:
        d.token_advantages[i] = np.zeros_like(d.token_advantages[i])
    expected, _ = grads(config(kl_beta=0.0, entropy_coef=0.0), d, micro=8)
    assert masked.abs().max() > 1e-4
    assert torch.allclose(masked, expected, atol=1e-7)
    assert health[0]["off_policy_masked_fraction"] == pytest.approx(len(negative) / 8)


def test_trl_off_policy_mask_keeps_the_kl():
    """off_policy_mask_scope "policy_term" (TRL): a masked sequence's policy term goes, its KL stays."""
    d = with_old(data(), shift=0.2)  # pi_theta != pi_old, so the k3 KL to the reference has a gradient
    d.sampler_logprobs = [o + 1.0 for o in d.old_logprobs]  # every row drifted; the A < 0 rows are masked
    negative = [i for i, a in enumerate(d.sequence_advantages) if a < 0]
    assert negative
    kl_only = dict(kl_beta=0.1, entropy_coef=0.0, off_policy_mask_delta=0.5)
    trl, _ = grads(config(**kl_only, off_policy_mask_scope="policy_term"), d, micro=8)
    whole, _ = grads(config(**kl_only), d, micro=8)
    # the same step without the mask and with the negative rows' advantages zeroed: policy terms of the
    # kept rows + every row's KL
    for i in negative:
        d.token_advantages[i] = np.zeros_like(d.token_advantages[i])
    expected, _ = grads(config(kl_beta=0.1, entropy_coef=0.0), d, micro=8)
    assert torch.allclose(trl, expected, atol=1e-7)
    assert not torch.allclose(whole, expected, atol=1e-5)  # rlpipe's scope drops the masked rows' KL too


def test_high_entropy_mask_trains_the_policy_term_of_kept_tokens_only():
    d = with_old(data(), shift=0.1)
    rng = np.random.default_rng(0)
    d.entropy_keep = [rng.random(len(a)) < 0.5 for a in d.token_advantages]
    plain = dict(kl_beta=0.0, entropy_coef=0.0)
    masked, health = grads(config(**plain), d, micro=8)
    kept = np.concatenate(d.entropy_keep)
    assert health[0]["high_entropy_kept_fraction"] == pytest.approx(kept.mean())
    # the same as zeroing the advantage of the dropped tokens (ratios are not 1, so their loss is not 0 either)
    d.token_advantages = [np.where(k, a, 0.0).astype(np.float32) for k, a in zip(d.entropy_keep, d.token_advantages)]
    d.entropy_keep = None
    expected, _ = grads(config(**plain), d, micro=8)
    assert masked.abs().max() > 1e-4 and torch.allclose(masked, expected, atol=1e-7)
    # the loop sets the mask from pi_old's entropies: half the tokens at rho 0.5
    _, result = trained(config(**plain, top_entropy_quantile=0.5), data())
    assert 0.4 <= result.metrics["high_entropy_kept_fraction"] <= 0.6
    assert result.metrics["high_entropy_threshold"] == pytest.approx(
        float(np.quantile(np.concatenate(result.old_entropy), 0.5)))


def test_truncated_importance_weights_scale_the_policy_gradient():
    cfg = config(kl_beta=0.0, entropy_coef=0.0)
    d = with_old(data())
    plain, _ = grads(cfg, d, micro=8)
    # pi_old / pi_sampler = 4 on every token; capped at C = 2 -> the policy term doubles
    d.sampler_logprobs = [o - math.log(4.0) for o in d.old_logprobs]
    weighted, health = grads(config(kl_beta=0.0, entropy_coef=0.0, tis_cap=2.0), d, micro=8)
    assert torch.allclose(weighted, 2.0 * plain, rtol=1e-5, atol=1e-8)
    assert health[0]["tis_weight_mean"] == pytest.approx(2.0)
    assert health[0]["tis_capped_fraction"] == pytest.approx(1.0)


def test_importance_weighted_kl_reports_the_weighted_estimate():
    d = with_old(data(), shift=0.3)  # pi_theta / pi_old = exp(-0.3) on every token
    _, plain = grads(config(), d, micro=8)
    _, weighted = grads(config(kl_importance_weighted=True), d, micro=8)
    assert weighted[0]["kl_ref"] == pytest.approx(math.exp(-0.3) * plain[0]["kl_ref"], rel=1e-5)
    d0 = with_old(data(), shift=0.0)  # on-policy: the weight is exactly 1
    _, plain0 = grads(config(), d0, micro=8)
    _, weighted0 = grads(config(kl_importance_weighted=True), d0, micro=8)
    assert weighted0[0]["kl_ref"] == pytest.approx(plain0[0]["kl_ref"], rel=1e-6)


def test_kl_clamps_come_from_the_config():
    d = with_old(data())
    d.ref_logprobs = [r - 50.0 for r in d.ref_logprobs]  # log rho ~ -47: clamped to -20 before exp
    _, clamped = grads(config(kl_estimator="k1"), d, micro=8)
    _, raw = grads(config(kl_estimator="k1", kl_log_ratio_clamp=None, kl_value_clamp=None), d, micro=8)
    assert clamped[0]["kl_ref"] == pytest.approx(10.0)  # k1 = -log rho = ~47, value clamp 10
    assert raw[0]["kl_ref"] > 40.0


def test_micro_batch_scope_is_the_mean_of_micro_batch_means():
    """token-mean over 4 micro-batches of 2: the mean of per-micro-batch token means (hand-built),
    which differs from the whole-step token mean when lengths differ."""
    plain = dict(loss_aggregation="token-mean", kl_beta=0.0, entropy_coef=0.0)
    d = with_old(data())
    lengths = [len(c) for c in d.completion_token_ids]
    assert len(set(lengths)) > 1
    whole, _ = grads(config(**plain), d, micro=8)
    # the loop's normalisers under micro_batch scope: this micro-batch's own token count, scale 1/4
    by_micro, _ = grads(config(**plain), d, micro=2,
                        norm_for=lambda mask: Normalisers(int(mask.sum()), int(mask.any(dim=1).sum()), 6, 0.25))
    # hand-built: per micro-batch k, the whole-step gradient restricted to its rows, rescaled
    manual = torch.zeros_like(whole)
    for k in range(4):
        rows = [2 * k, 2 * k + 1]
        sub = type(d)(**{**d.__dict__})
        sub.token_advantages = [a if i in rows else np.zeros_like(a) for i, a in enumerate(d.token_advantages)]
        g, _ = grads(config(**plain), sub, micro=8)  # = (sum over rows' tokens of grad) / all tokens
        manual += g * sum(lengths) / (lengths[rows[0]] + lengths[rows[1]]) / 4
    assert torch.allclose(by_micro, manual, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(by_micro, whole, rtol=1e-3)
    # and train_policy applies the scope itself (its micro-batches follow a shuffle, so only the
    # split-invariant minibatch scope can be compared with the unshuffled gradient)
    _, scoped = trained(config(**plain, micro_batch_size=2, token_mean_scope="micro_batch"), data())
    _, unscoped = trained(config(**plain, micro_batch_size=2), data())
    assert unscoped.steps[0]["grad_norm"] == pytest.approx(float(whole.norm()), rel=1e-4)
    assert scoped.steps[0]["grad_norm"] != pytest.approx(float(whole.norm()), rel=1e-3)


def test_target_kl_stops_the_epoch_loop():
    cfg = config(epochs=3, minibatch_size=2, micro_batch_size=2, target_kl=1e-12)
    _, result = trained(cfg, data())
    # step 0 is on-policy (approx KL 0); step 1 has moved past 1e-12 -> no third step
    assert len(result.steps) == 2
    assert result.metrics["early_stopped"] is True
    assert result.metrics["planned_optimizer_steps"] == 12


def tiny_critic(seed=5):
    body = tiny_model(seed).model
    head = torch.nn.Linear(32, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return ScalarHeadModel(body, head)


def test_ppo_trains_actor_and_critic_and_the_critic_fits_its_returns():
    d = data()
    d.returns = [np.full(len(c), 1.0 + 0.1 * i, dtype=np.float32) for i, c in enumerate(d.completion_token_ids)]
    d.old_values = [np.zeros(len(c), dtype=np.float32) for c in d.completion_token_ids]
    critic = tiny_critic()
    critic_before = flat(critic)
    cfg = config(epochs=6, minibatch_size=8, micro_batch_size=4, critic=config().critic.__class__(
        lr=3e-2, value_coef=0.5, value_clip_eps=10.0, max_grad_norm=1e9))
    model = tiny_model(0)
    result = train_policy(model, d, cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0, max_length=6,
                          critic=critic)
    assert not torch.equal(flat(critic), critic_before)
    losses = [s["value_loss"] for s in result.steps]
    # V starts at 0 against returns ~1.35: 0.5 * mean(R^2) over tokens, then falls as the critic fits
    assert losses[0] > 0.5 and losses[-1] < 0.25 * losses[0]
    assert {"value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm_mean"} <= set(result.metrics)


def test_value_clipping_limits_the_first_steps():
    d = data()
    d.returns = [np.full(len(c), 5.0, dtype=np.float32) for c in d.completion_token_ids]
    d.old_values = [np.zeros(len(c), dtype=np.float32) for c in d.completion_token_ids]
    cfg = config(epochs=4, critic=config().critic.__class__(lr=3e-2, value_coef=0.5, value_clip_eps=1e-3,
                                                           max_grad_norm=1e9))
    result = train_policy(tiny_model(0), d, cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0,
                          max_length=6, critic=tiny_critic())
    # once V moves past V_old +- 1e-3 the clipped branch (constant) dominates the max: clip fraction > 0
    assert result.steps[-1]["value_clip_fraction"] > 0.5


def test_a_critic_needs_returns():
    with pytest.raises(ValueError, match="critic"):
        train_policy(tiny_model(0), data(), config(), temperature=0.7, pad_token_id=PAD, seed=3, iteration=0,
                     max_length=6, critic=tiny_critic())


def test_gspo_form_picks_the_loss_function():
    assert config(policy_loss="gspo", gspo_form="sequence").policy_loss_function == "gspo"
    assert config(policy_loss="gspo", gspo_form="token").policy_loss_function == "gspo_token"
    assert config(policy_loss="gspo_token", gspo_form="sequence").policy_loss_function == "gspo_token"
    assert config(policy_loss="ppo_clip", gspo_form="token").policy_loss_function == "ppo_clip"


def test_sequence_count_all_rows_divides_by_every_row_of_the_step():
    """An empty completion in the step: verl/TRL (all_rows) divide the seq-mean by 8 rows, rlpipe by the 7 with a
    token, so the step's loss is 7/8 of rlpipe's; split into micro-batches of 3 it stays the same."""
    d = data()
    d.completion_token_ids[3] = []
    for name in ("token_advantages", "ref_logprobs", "sampler_logprobs"):
        getattr(d, name)[3] = np.zeros(0, dtype=np.float32)
    loss = {}
    for count in ("nonempty", "all_rows"):
        for micro in (8, 3):
            cfg = config(sequence_count=count, loss_aggregation="seq-mean-token-sum", kl_beta=0.0, entropy_coef=0.0,
                         lr=0.0, micro_batch_size=micro)
            loss[count, micro] = trained(cfg, d)[1].steps[0]["loss"]
    assert abs(loss["nonempty", 8]) > 1e-3
    assert loss["all_rows", 8] == pytest.approx(loss["nonempty", 8] * 7 / 8, rel=1e-5)
    assert loss["all_rows", 3] == pytest.approx(loss["all_rows", 8], rel=1e-5)


def _own_logprobs_and_entropy(d):
    from rlpipe.engines.logprobs import batched_completion_logprobs
    return batched_completion_logprobs(tiny_model(0), d.prompt_token_ids, d.completion_token_ids, pad_token_id=PAD,
                                       temperature=0.7, max_tokens_per_batch=10_000, chunk_size=3, with_entropy=True)


def test_trl_entropy_mask_form_takes_the_bonus_over_the_kept_tokens():
    """A = 0 and no KL: the loss is the entropy bonus alone, -c_H * sum(H * keep) / N (TRL) or sum(H) / N."""
    d = with_old(data())
    d.token_advantages = [np.zeros_like(a) for a in d.token_advantages]
    rng = np.random.default_rng(2)
    d.entropy_keep = [rng.random(len(a)) < 0.5 for a in d.token_advantages]
    _, entropy = _own_logprobs_and_entropy(d)
    n = sum(len(h) for h in entropy)
    kept_h = sum(float((np.asarray(h, np.float64) * k).sum()) for h, k in zip(entropy, d.entropy_keep))
    all_h = sum(float(np.asarray(h, np.float64).sum()) for h in entropy)
    assert 0 < kept_h < all_h
    for form, expected in (("token_set", -0.01 * kept_h / n), ("policy_term", -0.01 * all_h / n)):
        cfg = config(kl_beta=0.0, entropy_coef=0.01, loss_aggregation="token-mean", entropy_mask_form=form)
        _, health = grads(cfg, d, micro=8)
        assert health[0]["policy_loss"] == pytest.approx(expected, rel=1e-4), form


def test_trl_entropy_mask_form_drops_low_entropy_tokens_from_the_gmpo_mean():
    """GMPO, token_set: each row's -A_i exp(mean of the kept tokens' log-ratios), a plain row mean (TRL)."""
    d = data()
    own, _ = _own_logprobs_and_entropy(d)
    rng = np.random.default_rng(4)
    shifts = [rng.uniform(-0.3, 0.3, size=len(o)).astype(np.float32) for o in own]
    d.old_logprobs = [o - s for o, s in zip(own, shifts)]  # log-ratio = shift, inside the 0.4 clip
    d.entropy_keep = [rng.random(len(o)) < 0.5 for o in own]
    for k in d.entropy_keep:
        k[0] = True  # every row keeps a token
    cfg = config(policy_loss="gmpo", eps_low=0.4, eps_high=0.4, kl_beta=0.0, entropy_coef=0.0,
                 entropy_mask_form="token_set")
    _, health = grads(cfg, d, micro=8)
    rows = [-a * math.exp(float(s[k].mean())) for a, s, k in zip(d.sequence_advantages, shifts, d.entropy_keep)]
    assert health[0]["policy_loss"] == pytest.approx(sum(rows) / len(rows), rel=1e-4)
    _, scaled = grads(config(policy_loss="gmpo", eps_low=0.4, eps_high=0.4, kl_beta=0.0, entropy_coef=0.0), d, micro=8)
    rlpipe = [-a * math.exp(float(s.mean())) * k.mean() for a, s, k in zip(d.sequence_advantages, shifts,
                                                                           d.entropy_keep)]
    assert scaled[0]["policy_loss"] == pytest.approx(sum(rlpipe) / len(rlpipe), rel=1e-4)
