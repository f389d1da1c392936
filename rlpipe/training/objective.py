"""The loss of one micro-batch: policy term, KL to pi_ref, entropy bonus, corrections, critic term.

    L = agg( w_t * (-J_t) + beta * D_t - c_H * H_t )  +  c_V * agg( L_V,t )

- `J_t`: the policy objective named by ``train.policy_loss`` (PPO-clip with clip-higher, dual clip
  and TRL's ratio cap, GSPO, GSPO-token, CISPO, SAPO, GMPO), with the log-ratio clamp of the profile,
  on tokens kept by DeepSeek-V3.2's off-policy sequence mask
  (``train.off_policy_mask_delta``);
- `w_t`: truncated importance weights `min(pi_old / pi_sampler, C)` (``train.tis_cap``), 1 when off,
  times the high-entropy token mask (``train.top_entropy_quantile``; the "80/20" rule), 1 when off
  (with ``train.entropy_mask_form: token_set``, TRL's form, the mask also multiplies `H_t`, and GMPO
  drops the low-entropy tokens from its geometric mean instead of scaling the row's loss);
- `D_t`: the KL estimator of pi_theta against pi_ref (``train.kl_estimator``), optionally weighted by
  pi_theta / pi_old (DeepSeek-V3.2's unbiased KL, ``train.kl_importance_weighted``), clamped as the
  profile says; always of the full softmax, while with DeepSeek-V3.2's keep sampling mask
  (``train.keep_sampling_mask``, top-p/top-k sampling) `J_t`, its corrections and the health metrics
  use pi_old and pi_theta truncated to the sampler's support (rlpipe.engines.truncation);
- `L_V`: the clipped value loss of the critic (gae only);
- `agg`: ``train.loss_aggregation`` with the normalisers of ``train.token_mean_scope``.

A masked-out sequence stays in the normalisers (its loss is 0, not removed), so masking never
changes how much the other sequences weigh, and micro-batch invariance holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from rlpipe.algorithms.aggregation import aggregate_loss
from rlpipe.algorithms.kl import get_kl_estimator, importance_weighted_kl, kl_clamps
from rlpipe.algorithms.losses import (POLICY_LOSS_OPTIONS, entropy_bonus_terms, get_policy_loss, masked_mean,
                                      off_policy_sequence_mask, policy_health_tensors, truncated_importance_weights,
                                      value_loss)
from rlpipe.config import TrainConfig
from rlpipe.engines.logprobs import completion_logprobs, make_packed_batch, make_token_batch, to_device
from rlpipe.engines.truncation import completion_logprobs_truncated


@dataclass
class TrainingData:
    """The trainable view of one iteration: one array per sequence (views into the columns' flat values,
    `rlpipe.data.lists.row_arrays`: nothing per token beyond the numbers)."""

    prompt_token_ids: list[np.ndarray]  # int64
    completion_token_ids: list[np.ndarray]
    token_advantages: list[np.ndarray]
    ref_logprobs: list[np.ndarray]
    sampler_logprobs: list[np.ndarray]
    sequence_advantages: np.ndarray  # [B] A_i (token-level estimators: the mean of the token advantages)
    trainable: np.ndarray  # bool [B]: False where the advantage stage filtered the row out
    old_values: list[np.ndarray] | None = None  # gae: V_old from the values stage
    returns: list[np.ndarray] | None = None  # gae: critic targets R_t
    old_logprobs: list[np.ndarray] | None = None  # filled by the loop: the trainer's recomputed log pi_old
    # multi-turn: per row, which completion tokens the policy sampled (observation tokens are False);
    # None when every token is the policy's (single-turn)
    policy_mask: list[np.ndarray] | None = None
    # train.top_entropy_quantile < 1: per row, the tokens whose policy term is trained (the loop fills it
    # from pi_old's entropies); None = every token
    entropy_keep: list[np.ndarray] | None = None
    # train.keep_sampling_mask with top-p/top-k: pi_old's kept set S_t of every completion token (the loop
    # fills it; old_logprobs are then truncated to it and old_logprobs_full are the full-softmax ones)
    kept: list[list[np.ndarray]] | None = None
    old_logprobs_full: list[np.ndarray] | None = None
    # under torchrun: a `rlpipe.training.share.RowShare`; the lists above then hold this rank's rows only,
    # and loop indices (shuffles, minibatches) are rows of the whole iteration. None: one process, every row
    rows: Any = None

    def policy_tokens(self, i: int) -> int:
        """Tokens of sequence i that enter the loss (its policy tokens)."""
        return len(self.completion_token_ids[i]) if self.policy_mask is None else int(self.policy_mask[i].sum())

    def policy_values(self, rows: Sequence[np.ndarray], i: int) -> np.ndarray:
        """Row i of a per-token list, at the policy's tokens only."""
        return np.asarray(rows[i]) if self.policy_mask is None else np.asarray(rows[i])[self.policy_mask[i]]


@dataclass(frozen=True)
class Normalisers:
    """What `aggregate_loss` divides by in this micro-batch, and the scale of its contribution."""

    total_tokens: int
    total_sequences: int
    max_length: int
    scale: float = 1.0


def pad_rows(rows: Sequence[np.ndarray], width: int, device: torch.device | str) -> torch.Tensor:
    """Right-pad ragged float rows into a [B, width] float32 tensor (zeros beyond each row).

    Built on the host and copied through pinned memory (`to_device`): a plain copy would make the
    CPU wait for the GPU to finish everything queued before it.
    """
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):  # rows may be read-only views of the table's columns: copied, never wrapped
        out[i, : len(r)] = r
    return to_device(torch.from_numpy(out), device)


def autocast(cfg: TrainConfig):
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


def _kl_to_reference(logp_BC, old_BC, ref_BC, cfg: TrainConfig) -> torch.Tensor:
    clamps = kl_clamps(cfg.kl_estimator, scope=cfg.kl_clamp_scope, log_ratio_clamp=cfg.kl_log_ratio_clamp,
                       value_clamp=cfg.kl_value_clamp)
    if cfg.kl_importance_weighted:
        return importance_weighted_kl(logp_BC, old_BC, ref_BC, estimator=cfg.kl_estimator, **clamps)
    return get_kl_estimator(cfg.kl_estimator)(logp_BC, ref_BC, **clamps)


def _policy_forward(model, batch, data: TrainingData, idx: Sequence[int], cfg: TrainConfig, *, temperature: float,
                    dist) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """pi_theta's float32 log-probs [B, C] for the ratio (on pi_old's kept sets with the keep sampling mask),
    over the full softmax for the KL (the same tensor without the mask), and the entropies (None unless the
    entropy bonus is on)."""
    with autocast(cfg):
        if data.kept is not None:  # keep sampling mask: the ratio on pi_old's support, the KL on the full softmax
            truncated_of = completion_logprobs_truncated if dist is None else dist.completion_logprobs_truncated
            full_BC, entropy_BC, logp_BC = truncated_of(
                model, batch, [data.kept[i] for i in idx], temperature=temperature, chunk_size=cfg.chunk_size,
                with_entropy=cfg.entropy_coef > 0)
        else:
            logprobs_of = completion_logprobs if dist is None else dist.completion_logprobs
            logp_BC, entropy_BC = logprobs_of(model, batch, temperature=temperature, chunk_size=cfg.chunk_size,
                                              with_entropy=cfg.entropy_coef > 0)
            full_BC = logp_BC
    return logp_BC.float(), full_BC.float(), entropy_BC


def micro_batch_loss(model, critic, data: TrainingData, idx: Sequence[int], cfg: TrainConfig, *, temperature: float,
                     pad_token_id: int, norm_for, dist=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch (already scaled for accumulation) and its health statistics.

    The statistics are 0-dim tensors left on the device (`health_to_host` reads a whole step's at
    once): a read-back here would stall the GPU once per micro-batch.

    ``norm_for(mask_BC) -> Normalisers``: the loop's normalisers for this micro-batch.
    ``dist``: under torchrun, the `ShardedTraining` whose FSDP root runs the policy's forward.
    """
    prompts, completions = [data.prompt_token_ids[i] for i in idx], [data.completion_token_ids[i] for i in idx]
    batch = make_packed_batch(prompts, completions).to(cfg.device)  # one unpadded row: no work on padding
    logp_BC, full_BC, entropy_BC = _policy_forward(model, batch, data, idx, cfg, temperature=temperature, dist=dist)
    width, device = logp_BC.shape[1], logp_BC.device
    lengths_B = to_device(torch.tensor(batch.completion_lengths), device)
    mask_BC = torch.arange(width, device=device)[None, :] < lengths_B[:, None]
    if data.policy_mask is not None:  # multi-turn: observation tokens are outside the loss, KL, entropy, corrections
        mask_BC = mask_BC & pad_rows([data.policy_mask[i] for i in idx], width, device).bool()
    rows = lambda name: pad_rows([getattr(data, name)[i] for i in idx], width, device)  # noqa: E731
    old_BC, adv_BC, ref_BC = rows("old_logprobs"), rows("token_advantages"), rows("ref_logprobs")
    norm = norm_for(mask_BC)
    health: dict[str, torch.Tensor] = {}

    with_sampler = cfg.off_policy_mask_delta is not None or cfg.tis_cap is not None
    sampler_BC = rows("sampler_logprobs") if with_sampler else None  # built and copied once for both corrections
    loss_mask_BC = mask_BC
    if cfg.off_policy_mask_delta is not None:
        seq_adv_B = to_device(torch.as_tensor(data.sequence_advantages[list(idx)], dtype=torch.float32), device)
        keep_B = off_policy_sequence_mask(sampler_BC, logp_BC, seq_adv_B, mask_BC,
                                          delta=cfg.off_policy_mask_delta)
        loss_mask_BC = mask_BC & keep_B[:, None]
        health["off_policy_masked_fraction"] = (~keep_B).float().mean()
    name = cfg.policy_loss_function
    options = {key: cfg.policy_loss_options[key] for key in POLICY_LOSS_OPTIONS[name]}
    keep_BC = rows("entropy_keep") if data.entropy_keep is not None else None  # the 80/20 rule's kept tokens
    in_geometric_mean = keep_BC is not None and name == "gmpo" and cfg.entropy_mask_form == "token_set"
    if in_geometric_mean:  # TRL's GMPO: low-entropy tokens leave the geometric mean itself
        options["mean_mask_BT"] = keep_BC.bool()
    loss_BC, stats = get_policy_loss(name)(
        logp_BC, old_BC, adv_BC, loss_mask_BC, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        dual_clip_c=cfg.dual_clip_c, log_ratio_clamp=cfg.policy_loss_log_ratio_clamp, **options)
    if keep_BC is not None:
        if not in_geometric_mean:  # the policy term of high-entropy tokens only
            loss_BC = loss_BC * keep_BC
        health["high_entropy_kept_fraction"] = masked_mean(keep_BC, mask_BC)
    if cfg.tis_cap is not None:
        weights_BC = truncated_importance_weights(old_BC, sampler_BC, mask_BC, cap=cfg.tis_cap)
        loss_BC = loss_BC * weights_BC
        health["tis_weight_mean"] = masked_mean(weights_BC, mask_BC)
        health["tis_capped_fraction"] = masked_mean(weights_BC >= cfg.tis_cap, mask_BC)
    old_full_BC = rows("old_logprobs_full") if data.kept is not None else old_BC
    kl_BC = _kl_to_reference(full_BC, old_full_BC, ref_BC, cfg)
    if cfg.kl_beta > 0:
        loss_BC = loss_BC + cfg.kl_beta * kl_BC
    if cfg.entropy_coef > 0:
        loss_BC = loss_BC - cfg.entropy_coef * entropy_bonus_terms(entropy_BC, keep_BC, form=cfg.entropy_mask_form)
    # off_policy_mask_scope "policy_term" (TRL): a masked sequence's policy term is already 0 (the loss
    # got loss_mask_BC), but its KL and entropy terms still count
    agg_mask_BC = mask_BC if cfg.off_policy_mask_scope == "policy_term" else loss_mask_BC
    loss = norm.scale * aggregate_loss(loss_BC, agg_mask_BC, mode=cfg.loss_aggregation, total_tokens=norm.total_tokens,
                                       total_sequences=norm.total_sequences, max_length=norm.max_length)
    health["policy_loss"] = loss.detach()

    health.update(policy_health_tensors(logp_BC, old_BC, mask_BC, stats))
    health["kl_ref"] = masked_mean(kl_BC.detach(), mask_BC)
    if entropy_BC is not None:
        health["entropy"] = masked_mean(entropy_BC.detach(), mask_BC)
    if critic is not None:
        padded = make_token_batch(prompts, completions, pad_token_id=pad_token_id).to(cfg.device)  # the critic's layout
        value_term, value_health = _critic_loss(critic, padded, data, idx, mask_BC, cfg, norm)
        loss = loss + cfg.critic.value_coef * value_term
        health.update(value_health)
    return loss, health


def _critic_loss(critic, batch, data: TrainingData, idx, mask_BC, cfg: TrainConfig, norm: Normalisers
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from rlpipe.engines.scalar_head import completion_values

    with autocast(cfg):
        values_BC = completion_values(critic, batch).float()
    width, device = values_BC.shape[1], values_BC.device
    old_BC = pad_rows([data.old_values[i] for i in idx], width, device)
    ret_BC = pad_rows([data.returns[i] for i in idx], width, device)
    loss_BC = value_loss(values_BC, old_BC, ret_BC, mask_BC, clip_eps=cfg.critic.value_clip_eps)
    loss = norm.scale * aggregate_loss(loss_BC, mask_BC, mode=cfg.loss_aggregation, total_tokens=norm.total_tokens,
                                       total_sequences=norm.total_sequences, max_length=norm.max_length)
    with torch.no_grad():
        clipped = (values_BC - old_BC).abs() > cfg.critic.value_clip_eps
        health = {"value_loss": loss.detach(), "value_clip_fraction": masked_mean(clipped, mask_BC),
                  "value_mean": masked_mean(values_BC, mask_BC)}
    return loss, health
