"""The one optimisation loop: mu epochs of minibatch updates over one iteration's rollouts.

Read top to bottom: (1) recompute old log-probs with the trainer, no grad; (2) for each epoch,
shuffle the trainable sequences with a seeded generator and cut them into minibatches; (3) each
minibatch is one optimizer step, accumulated over micro-batches whose losses are normalised by the
token/sequence counts of the whole minibatch (so the split never changes the gradient);
(4) per-token log-probs after training, for the token-stats table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rlpipe.algorithms.aggregation import aggregate_loss, count_valid
from rlpipe.algorithms.kl import get_kl_estimator
from rlpipe.algorithms.losses import get_policy_loss, policy_health_metrics
from rlpipe.config import TrainConfig
from rlpipe.engines.base import derive_seed
from rlpipe.engines.logprobs import batched_completion_logprobs, completion_logprobs, make_token_batch
from rlpipe.errors import TrainingError

SHUFFLE_STREAM = 3  # seed domain of the minibatch shuffle (see rlpipe.generate for the others)


@dataclass
class TrainingData:
    """The trainable view of one iteration: ragged token lists, one entry per sequence."""

    prompt_token_ids: list[list[int]]
    completion_token_ids: list[list[int]]
    token_advantages: list[np.ndarray]
    ref_logprobs: list[np.ndarray]
    trainable: np.ndarray  # bool [B]: False where the advantage stage filtered the row out
    old_logprobs: list[np.ndarray] = field(default_factory=list)


@dataclass
class TrainResult:
    metrics: dict[str, Any]
    steps: list[dict[str, float]]
    old_logprobs: list[np.ndarray]
    old_entropy: list[np.ndarray]
    new_logprobs: list[np.ndarray]


def pad_rows(rows: Sequence[np.ndarray], width: int, device: torch.device | str) -> torch.Tensor:
    """Right-pad ragged float rows into a [B, width] float32 tensor (zeros beyond each row)."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.float32))
    return out.to(device)


def _autocast(cfg: TrainConfig):
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


def _all_logprobs(model, data: TrainingData, cfg: TrainConfig, *, temperature: float, pad_token_id: int,
                  with_entropy: bool):
    """No-grad log-probs of every sequence, in batches no larger than a training micro-batch."""
    longest = max((len(p) + len(c) for p, c in zip(data.prompt_token_ids, data.completion_token_ids)), default=1)
    with _autocast(cfg):
        return batched_completion_logprobs(
            model, data.prompt_token_ids, data.completion_token_ids, pad_token_id=pad_token_id,
            temperature=temperature, max_tokens_per_batch=cfg.micro_batch_size * longest, chunk_size=cfg.chunk_size,
            with_entropy=with_entropy, device=cfg.device)


def micro_batch_loss(model, data: TrainingData, idx: Sequence[int], cfg: TrainConfig, *, temperature: float,
                     pad_token_id: int, total_tokens: int, total_sequences: int, max_length: int):
    """Loss of one micro-batch, normalised by the counts of its whole optimizer step; and its health stats."""
    batch = make_token_batch([data.prompt_token_ids[i] for i in idx], [data.completion_token_ids[i] for i in idx],
                             pad_token_id=pad_token_id)
    with _autocast(cfg):
        logp_BC, entropy_BC = completion_logprobs(model, batch.to(cfg.device), temperature=temperature,
                                                  chunk_size=cfg.chunk_size, with_entropy=cfg.entropy_coef > 0)
    width = logp_BC.shape[1]
    mask_BC = (torch.arange(width)[None, :] < torch.tensor(batch.completion_lengths)[:, None]).to(logp_BC.device)
    old_BC = pad_rows([data.old_logprobs[i] for i in idx], width, logp_BC.device)
    adv_BC = pad_rows([data.token_advantages[i] for i in idx], width, logp_BC.device)
    loss_fn = get_policy_loss(cfg.policy_loss)
    loss_BC, stats = loss_fn(logp_BC.float(), old_BC, adv_BC, mask_BC, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                             dual_clip_c=cfg.dual_clip_c)
    ref_BC = pad_rows([data.ref_logprobs[i] for i in idx], width, logp_BC.device)
    kl_BC = get_kl_estimator(cfg.kl_estimator)(logp_BC.float(), ref_BC)
    if cfg.kl_beta > 0:
        loss_BC = loss_BC + cfg.kl_beta * kl_BC
    if cfg.entropy_coef > 0:
        loss_BC = loss_BC - cfg.entropy_coef * entropy_BC.float()
    loss = aggregate_loss(loss_BC, mask_BC, mode=cfg.loss_aggregation, total_tokens=total_tokens,
                          total_sequences=total_sequences, max_length=max_length)
    health = policy_health_metrics(logp_BC.float(), old_BC, mask_BC, stats)
    m = mask_BC.bool()
    health["kl_ref"] = float(kl_BC.detach()[m].mean()) if m.any() else 0.0
    if entropy_BC is not None:
        health["entropy"] = float(entropy_BC.detach().float()[m].mean()) if m.any() else 0.0
    return loss, health


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of micro-batch health stats; min/max for the ratio extremes."""
    n = sum(p["num_valid_tokens"] for p in parts)
    out: dict[str, float] = {}
    for key in parts[0]:
        if key == "num_valid_tokens":
            continue
        vals = [p[key] for p in parts if p["num_valid_tokens"]]
        if not vals:
            out[key] = 0.0
        elif key == "ratio_min":
            out[key] = min(vals)
        elif key == "ratio_max":
            out[key] = max(vals)
        else:
            out[key] = sum(p[key] * p["num_valid_tokens"] for p in parts) / max(n, 1)
    return out


def count_optimizer_steps(num_trainable: int, cfg: TrainConfig) -> int:
    """How many optimizer steps train_policy makes (epochs x minibatches): the total of its progress bar."""
    return cfg.epochs * math.ceil(num_trainable / cfg.minibatch_size)


def train_policy(model, data: TrainingData, cfg: TrainConfig, *, temperature: float, pad_token_id: int,
                 seed: int, iteration: int, max_length: int, progress: Any = None,
                 resume: dict[str, Any] | None = None,
                 save_state: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Run cfg.epochs x minibatches of PPO-style updates in place on ``model``; see module docstring.

    A step whose loss or gradient norm is NaN/inf is skipped (no optimizer step, gradients zeroed)
    and counted; more than ``cfg.max_skipped_steps`` of them raise TrainingError, since then the
    data or the model is broken rather than one batch unlucky.

    ``save_state``: called with the whole loop state (model, optimizer, shuffle order and generator,
    step counter, step metrics, old log-probs) every ``cfg.checkpoint_every_steps`` steps.
    ``resume``: such a state; the loop continues after its last step and ends exactly where an
    uninterrupted run ends (same shuffles, same AdamW moments, same step metrics).
    ``progress``: optional callback, called with 1 after each optimizer step (see rlpipe.progress).
    """
    model.eval()  # no dropout: the recomputed old log-probs must equal pi_theta's at the first step
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, fused=torch.device(cfg.device).type == "cuda")
    if resume is None:
        with torch.no_grad():
            old, old_entropy = _all_logprobs(model, data, cfg, temperature=temperature, pad_token_id=pad_token_id,
                                             with_entropy=True)
        done, skipped, steps = 0, 0, []
    else:  # pi_old's log-probs come from the state: the model there has already moved
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        old = [t.numpy() for t in resume["old_logprobs"]]
        old_entropy = [t.numpy() for t in resume["old_entropy"]]
        done, skipped, steps = int(resume["step"]), int(resume["skipped_steps"]), list(resume["steps"])
    data.old_logprobs = old
    trainable = np.flatnonzero(data.trainable)
    per_epoch = math.ceil(len(trainable) / cfg.minibatch_size)
    if progress is not None and done:
        progress(done)
    for epoch in range(done // per_epoch if per_epoch else cfg.epochs, cfg.epochs):
        gen = torch.Generator().manual_seed(derive_seed(seed, SHUFFLE_STREAM, iteration, epoch))
        order = trainable[torch.randperm(len(trainable), generator=gen).numpy()]
        if resume is not None and resume["epoch"] == epoch:  # the saved shuffle, not a recomputed one
            order = resume["order"].numpy()
        for start in range(0, len(order), cfg.minibatch_size):
            step = epoch * per_epoch + start // cfg.minibatch_size
            if step < done:
                continue
            record = _optimizer_step(model, optimizer, data, order[start:start + cfg.minibatch_size], cfg,
                                     temperature=temperature, pad_token_id=pad_token_id, max_length=max_length,
                                     step=step, epoch=epoch)
            if record is None:
                skipped += 1
                if skipped > cfg.max_skipped_steps:
                    raise TrainingError(
                        f"{skipped} optimizer steps had a non-finite loss or gradient norm (last: epoch {epoch}, "
                        f"step {step}), more than train.max_skipped_steps={cfg.max_skipped_steps}; no checkpoint "
                        "was written (check rewards, advantages and log-probs for NaN/inf)")
            else:
                steps.append(record)
            if progress is not None:
                progress(1)
            if save_state is not None and cfg.checkpoint_every_steps and (step + 1) % cfg.checkpoint_every_steps == 0:
                save_state({"step": step + 1, "skipped_steps": skipped, "steps": steps, "epoch": epoch,
                            "order": torch.as_tensor(order),
                            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "old_logprobs": [torch.as_tensor(x) for x in old],
                            "old_entropy": [torch.as_tensor(x) for x in old_entropy]})
    with torch.no_grad():
        new, _ = _all_logprobs(model, data, cfg, temperature=temperature, pad_token_id=pad_token_id,
                               with_entropy=False)
    metrics = {**_summary(steps, data, old, new, old_entropy), "skipped_steps": skipped}
    return TrainResult(metrics=metrics, steps=steps, old_logprobs=old, old_entropy=old_entropy, new_logprobs=new)


def _optimizer_step(model, optimizer, data, minibatch, cfg, *, temperature, pad_token_id, max_length, step, epoch):
    """One optimizer step over ``minibatch``; None (and no update) if a loss or the gradient norm is not finite."""
    lengths = [len(data.completion_token_ids[i]) for i in minibatch]
    total_tokens = int(sum(lengths))
    total_sequences = int(sum(1 for n in lengths if n > 0))
    parts, loss_sum = [], 0.0
    for m0 in range(0, len(minibatch), cfg.micro_batch_size):
        idx = minibatch[m0:m0 + cfg.micro_batch_size]
        loss, health = micro_batch_loss(model, data, idx, cfg, temperature=temperature, pad_token_id=pad_token_id,
                                        total_tokens=total_tokens, total_sequences=total_sequences,
                                        max_length=max_length)
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)  # drop what earlier micro-batches accumulated
            return None
        loss.backward()
        loss_sum += float(loss.detach())
        parts.append(health)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"step": step, "epoch": epoch, "loss": loss_sum, "grad_norm": grad_norm, "lr": cfg.lr,
            "sequences": len(minibatch), "tokens": total_tokens, **_combine(parts)}


def _summary(steps, data: TrainingData, old, new, old_entropy) -> dict[str, Any]:
    def mean_of(key: str) -> float:
        return float(np.mean([s[key] for s in steps])) if steps else 0.0

    mask = data.trainable
    flat = lambda rows: np.concatenate([rows[i] for i in np.flatnonzero(mask)]) if mask.any() else np.zeros(0)  # noqa: E731
    delta = flat(new) - flat(old)
    return {
        "optimizer_steps": len(steps),
        "trained_sequences": int(mask.sum()),
        "loss_mean": mean_of("loss"),
        "clip_fraction": mean_of("clip_fraction"),
        "approx_kl_old": mean_of("approx_kl"),
        "kl_ref": mean_of("kl_ref"),
        "grad_norm_mean": mean_of("grad_norm"),
        "grad_norm_max": max((s["grad_norm"] for s in steps), default=0.0),
        "ratio_min": min((s["ratio_min"] for s in steps), default=1.0),
        "ratio_max": max((s["ratio_max"] for s in steps), default=1.0),
        "entropy_old": float(np.concatenate(old_entropy).mean()) if old_entropy else 0.0,
        "logprob_change_mean": float(delta.mean()) if delta.size else 0.0,
        "final_kl_old": float(np.mean(np.exp(-delta) - 1 + delta)) if delta.size else 0.0,
    }
