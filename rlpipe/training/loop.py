"""The one optimisation loop: mu epochs of minibatch updates over one iteration's rollouts.

Read top to bottom: (1) recompute old log-probs with the trainer, no grad; (2) for each epoch,
shuffle the trainable sequences with a seeded generator and cut them into minibatches; (3) each
minibatch is one optimizer step, accumulated over micro-batches whose losses are normalised by the
token/sequence counts of the whole minibatch (so the split never changes the gradient);
(4) per-token log-probs after training, for the token-stats table.

Under torchrun, ``dist`` (a `rlpipe.training.distributed.ShardedTraining`) deals each step's
micro-batches over the ranks of an FSDP2-sharded model; see that module. ``dist=None``: one process.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rlpipe.algorithms.aggregation import loss_normalisers, step_sequence_count
from rlpipe.algorithms.losses import health_to_host
from rlpipe.algorithms.token_masks import high_entropy_threshold
from rlpipe.config import GenerateConfig, TrainConfig
from rlpipe.engines.base import derive_seed
from rlpipe.engines.logprobs import batched_completion_logprobs
from rlpipe.engines.truncation import batched_kept_sets, batched_truncated_logprobs
from rlpipe.errors import TrainingError
from rlpipe.training.loop_state import (LoopState, kept_from_state, load_module_state, save_due,
                                        snapshot)
from rlpipe.training.objective import Normalisers, TrainingData, autocast, micro_batch_loss
from rlpipe.training.share import quantile_over_ranks, sums_over_ranks

# step metrics summarised as means; the last three exist only when their feature is on
OPTIONAL_STEP_METRICS = ("dual_clip_fraction", "off_policy_masked_fraction", "tis_weight_mean", "tis_capped_fraction",
                         "high_entropy_kept_fraction")
SHUFFLE_STREAM = 3  # seed domain of the minibatch shuffle (see rlpipe.stages.generate for the others)


@dataclass
class TrainResult:
    metrics: dict[str, Any]
    steps: list[dict[str, float]]
    old_logprobs: list[np.ndarray]
    old_entropy: list[np.ndarray]
    new_logprobs: list[np.ndarray]


def cut_micro_batches(minibatch: Sequence[int], data: TrainingData, cfg: TrainConfig) -> list[Sequence[int]]:
    """The minibatch, in its (shuffled) order, cut into forward/backward passes.

    A micro-batch holds at most ``train.micro_batch_size`` sequences and, when
    ``train.max_tokens_per_micro_batch`` > 0, at most that many prompt+completion tokens (a longer
    sequence gets a micro-batch of its own). Why a token cap: with long-tailed completion lengths a
    fixed sequence count either wastes memory on short batches or runs out of it on long ones. The
    step's gradient does not depend on the cut (the loss normalisers are the step's; scope minibatch).
    """
    cap = cfg.max_tokens_per_micro_batch
    out: list[list[int]] = []
    tokens = 0
    for i in minibatch:
        n = len(data.prompt_token_ids[i]) + len(data.completion_token_ids[i])
        if not out or len(out[-1]) == cfg.micro_batch_size or (cap and tokens + n > cap):
            out.append([])
            tokens = 0
        out[-1].append(i)
        tokens += n
    return [np.asarray(m) if isinstance(minibatch, np.ndarray) else m for m in out]


def trainable_rows(data: TrainingData) -> np.ndarray:
    """The rows the loop shuffles into minibatches: of the whole iteration, also under torchrun."""
    return np.flatnonzero(data.trainable if data.rows is None else data.rows.trainable)


def policy_token_counts(data: TrainingData, rows: Sequence[int]) -> np.ndarray:
    """The loss's tokens of each of ``rows`` (rows of the whole iteration), int64: every rank knows them."""
    if data.rows is not None:
        return data.rows.policy_tokens[np.asarray(rows, dtype=np.int64)]
    return np.array([data.policy_tokens(i) for i in rows], dtype=np.int64)


def micro_batch_plan(minibatch: Sequence[int], data: TrainingData, cfg: TrainConfig, dist
                     ) -> tuple[list[Sequence[int] | None], int]:
    """The micro-batches this process runs for ``minibatch`` and how many all processes run together.

    One process: `cut_micro_batches`. Under torchrun: the micro-batches cut from this rank's own rows of
    the minibatch (in the shuffled order), padded with None (a zero-weighted pass) to the most any rank
    has. With train.token_mean_scope minibatch the step's gradient is one process's whatever the cut;
    with micro_batch each micro-batch is normalised by its own counts, as in peers whose ranks cut their
    own data, so its value depends on the number of ranks.
    """
    if dist is None:
        cut = cut_micro_batches(minibatch, data, cfg)
        return cut, len(cut)
    cut = cut_micro_batches(data.rows.mine(np.asarray(minibatch)), data, cfg)
    counts = dist.dist.gather(len(cut))
    return cut + [None] * (max(counts) - len(cut)), sum(counts)


def _budget(data: TrainingData, cfg: TrainConfig) -> int:
    """Tokens per no-grad batch: no more than a training micro-batch holds (the longest sequence of the
    whole iteration sets it, under torchrun too: every rank batches with one process's budget)."""
    if data.rows is not None:
        longest = int(data.rows.lengths.max(initial=1))
    else:
        longest = max((len(p) + len(c) for p, c in zip(data.prompt_token_ids, data.completion_token_ids)),
                      default=1)
    budget = cfg.micro_batch_size * longest
    if cfg.max_tokens_per_micro_batch:
        budget = max(min(budget, cfg.max_tokens_per_micro_batch), longest)
    return budget


def _all_logprobs(model, data: TrainingData, cfg: TrainConfig, *, temperature: float, pad_token_id: int,
                  with_entropy: bool, dist=None):
    """No-grad log-probs of every sequence, in batches no larger than a training micro-batch."""
    budget = _budget(data, cfg)
    with autocast(cfg):
        if dist is not None:
            return dist.share_logprobs(data.prompt_token_ids, data.completion_token_ids, temperature=temperature,
                                       max_tokens_per_batch=budget, chunk_size=cfg.chunk_size,
                                       with_entropy=with_entropy)
        return batched_completion_logprobs(
            model, data.prompt_token_ids, data.completion_token_ids, pad_token_id=pad_token_id,
            temperature=temperature, max_tokens_per_batch=budget, chunk_size=cfg.chunk_size,
            with_entropy=with_entropy, device=cfg.device)


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Micro-batch health stats -> one step's: losses summed (each part is already a share of the
    step's loss), ratio extremes as min/max, the rest as token-weighted means."""
    n = sum(p["num_valid_tokens"] for p in parts)
    out: dict[str, float] = {}
    for key in parts[0]:
        if key == "num_valid_tokens":
            continue
        vals = [p[key] for p in parts if p["num_valid_tokens"]]
        if key.endswith("_loss"):
            out[key] = sum(p[key] for p in parts)
        elif not vals:
            out[key] = 0.0
        elif key == "ratio_min":
            out[key] = min(vals)
        elif key == "ratio_max":
            out[key] = max(vals)
        else:
            out[key] = sum(p[key] * p["num_valid_tokens"] for p in parts) / max(n, 1)
    return out


def sampling_truncation(generate: GenerateConfig, cfg: TrainConfig) -> tuple[int, float] | None:
    """(top_k, top_p) for `train_policy`'s keep sampling mask: when train.keep_sampling_mask is on and the
    sampler truncated (generate.top_p < 1 or generate.top_k > 0, not greedy); else None."""
    truncates = generate.temperature > 0 and (generate.top_p < 1.0 or generate.top_k > 0)
    return (generate.top_k, generate.top_p) if cfg.keep_sampling_mask and truncates else None


def count_optimizer_steps(num_trainable: int, cfg: TrainConfig) -> int:
    """How many optimizer steps train_policy makes (epochs x minibatches) unless train.target_kl stops it early."""
    return cfg.epochs * math.ceil(num_trainable / cfg.minibatch_size)


def _adamw(params, cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
                             fused=torch.device(cfg.device).type == "cuda")


def train_policy(model, data: TrainingData, cfg: TrainConfig, *, temperature: float, pad_token_id: int,
                 seed: int, iteration: int, max_length: int, critic=None, progress: Any = None,
                 resume: dict[str, Any] | None = None,
                 save_state: Callable[[dict[str, Any]], None] | None = None, dist=None,
                 check_old: Callable[[list[np.ndarray]], None] | None = None,
                 truncation: tuple[int, float] | None = None) -> TrainResult:
    """Run cfg.epochs x minibatches of updates in place on ``model`` (and ``critic``); see module docstring.

    Three named steps: `start_loop` (optimizers and pi_old's log-probs, or a resume state), `run_epochs`
    (the optimizer steps, saving resume states), `loop_result` (log-probs after training, the metrics).

    ``critic``: a `rlpipe.models.value_model.ScalarHeadModel` trained alongside the actor (gae), with its
    own AdamW (``train.critic.lr``) and gradient clip; ``data`` then carries old values and returns.
    A step whose loss or gradient norm is NaN/inf is skipped (no optimizer step, gradients zeroed)
    and counted; more than ``cfg.max_skipped_steps`` of them raise TrainingError, since then the
    data or the model is broken rather than one batch unlucky.
    ``cfg.target_kl``: once a step's approx KL to pi_old exceeds it, no further step is taken
    (the policy has moved as far from the sampler as this iteration's data supports).

    ``save_state``: called with the whole loop state (models, optimizers, shuffle order, step
    counter, step metrics, old log-probs) every ``cfg.checkpoint_every_steps`` steps and every
    ``cfg.checkpoint_every_s`` seconds (whichever comes first; either 0 = off), and after an early stop.
    ``resume``: such a state; the loop continues after its last step and ends exactly where an
    uninterrupted run ends (same shuffles, same AdamW moments, same step metrics).
    ``progress``: optional callback, called with 1 after each optimizer step (see rlpipe.progress).
    ``check_old``: called with the recomputed log pi_old before the first step; it may raise to stop the
    stage before any update (train's sampler check: the sampler must have run these weights).
    With ``train.lora`` the model's base weights are frozen: only parameters that require grad are
    optimised and kept in resume states, and LoRA's dropout layers run in train mode during the
    optimizer steps only (the log-probs before and after stay dropout-free).
    ``dist``: under torchrun, the `ShardedTraining` that sharded ``model`` and ``critic``; every rank
    calls this and gets the same result; ``save_state`` gets full states on rank 0 only.
    ``truncation``: (top_k, top_p) of the sampler when train.keep_sampling_mask applies them
    (rlpipe.engines.truncation): pi_old's kept sets are computed once with the old log-probs, and
    pi_old and pi_theta are both truncated to them in the ratio; None = full softmax.
    """
    if (critic is None) != (data.returns is None):
        raise ValueError("a critic needs returns and old values in the training data, and returns need a critic")
    state = start_loop(model, critic, data, cfg, resume=resume, truncation=truncation, temperature=temperature,
                       pad_token_id=pad_token_id, dist=dist)
    if check_old is not None:
        check_old(state.old)
    data.old_logprobs = state.old
    entropy_threshold = _entropy_mask(data, state.old_entropy, cfg, dist)
    if progress is not None and state.done:
        progress(state.done)
    run_epochs(model, critic, data, cfg, state, seed=seed, iteration=iteration, temperature=temperature,
               pad_token_id=pad_token_id, max_length=max_length, resume=resume, save_state=save_state,
               progress=progress, dist=dist)
    return loop_result(model, critic, data, cfg, state, temperature=temperature, pad_token_id=pad_token_id,
                       entropy_threshold=entropy_threshold, dist=dist)


def start_loop(model, critic, data: TrainingData, cfg: TrainConfig, *, resume: dict[str, Any] | None,
               truncation: tuple[int, float] | None, temperature: float, pad_token_id: int, dist) -> LoopState:
    """The optimizers (AdamW, one per model) and pi_old's log-probs: recomputed with no dropout (they must
    equal pi_theta's at the first step), or everything restored from a resume state."""
    model.eval()  # no dropout: the recomputed old log-probs must equal pi_theta's at the first step
    optimizer = _adamw([p for p in model.parameters() if p.requires_grad], cfg, cfg.lr)
    critic_optimizer = None
    if critic is not None:
        critic.eval()
        critic_optimizer = _adamw(critic.parameters(), cfg, cfg.critic.lr)
    if resume is None:
        if truncation is not None:  # one pass gives the kept sets, both old log-probs and the entropies
            old, old_entropy = _keep_sampling_mask(model, data, cfg, truncation, temperature=temperature, dist=dist)
        else:
            with torch.no_grad():
                old, old_entropy = _all_logprobs(model, data, cfg, temperature=temperature,
                                                 pad_token_id=pad_token_id, with_entropy=True, dist=dist)
        return LoopState(optimizer, critic_optimizer, old, old_entropy)
    # pi_old's log-probs come from the state: the model there has already moved
    load_module_state(model, optimizer, resume["model"], resume["optimizer"], dist)
    if critic is not None:
        load_module_state(critic, critic_optimizer, resume["critic"], resume["critic_optimizer"], dist)
    mine = slice(None) if data.rows is None else slice(data.rows.start, data.rows.stop)  # a state holds every row
    state = LoopState(optimizer, critic_optimizer, [t.numpy() for t in resume["old_logprobs"][mine]],
                      [t.numpy() for t in resume["old_entropy"][mine]], done=int(resume["step"]),
                      skipped=int(resume["skipped_steps"]), steps=list(resume["steps"]),
                      stopped=bool(resume.get("stopped", False)))
    if truncation is not None:
        data.old_logprobs_full = [t.numpy() for t in resume["old_logprobs_full"][mine]]
        data.kept = kept_from_state(resume["kept"][mine])
    if "rng" in resume:  # LoRA dropout draws from torch's global generator
        torch.set_rng_state(resume["rng"])
    return state


def run_epochs(model, critic, data: TrainingData, cfg: TrainConfig, state: LoopState, *, seed: int, iteration: int,
               temperature: float, pad_token_id: int, max_length: int, resume: dict[str, Any] | None,
               save_state: Callable[[dict[str, Any]], None] | None, progress: Any, dist) -> None:
    """Every optimizer step still to take: per epoch a seeded shuffle of the trainable rows, cut into
    minibatches; each minibatch is one step. Updates ``state``; saves resume states when due.
    Under torchrun the shuffles are one process's, over every row of the iteration (`trainable_rows`)."""
    trainable = trainable_rows(data)
    per_epoch = math.ceil(len(trainable) / cfg.minibatch_size)
    last_save = time.monotonic()
    for epoch in range(state.done // per_epoch if per_epoch else cfg.epochs, cfg.epochs):
        if state.stopped:
            break
        gen = torch.Generator().manual_seed(derive_seed(seed, SHUFFLE_STREAM, iteration, epoch))
        order = trainable[torch.randperm(len(trainable), generator=gen).numpy()]
        if resume is not None and resume["epoch"] == epoch:  # the saved shuffle, not a recomputed one
            order = resume["order"].numpy()
        for start in range(0, len(order), cfg.minibatch_size):
            step = epoch * per_epoch + start // cfg.minibatch_size
            if step < state.done:
                continue
            record = _optimizer_step(model, critic, (state.optimizer, state.critic_optimizer), data,
                                     order[start:start + cfg.minibatch_size], cfg, temperature=temperature,
                                     pad_token_id=pad_token_id, max_length=max_length, step=step, epoch=epoch,
                                     dist=dist)
            if record is None:
                state.skipped += 1
                if state.skipped > cfg.max_skipped_steps:
                    raise TrainingError(
                        f"{state.skipped} optimizer steps had a non-finite loss or gradient norm (last: epoch "
                        f"{epoch}, step {step}), more than train.max_skipped_steps={cfg.max_skipped_steps}; no "
                        "checkpoint was written (check rewards, advantages and log-probs for NaN/inf)")
            else:
                state.steps.append(record)
                state.stopped = cfg.target_kl is not None and record["approx_kl"] > cfg.target_kl
            if progress is not None:
                progress(1)
            if save_state is not None and save_due(cfg, step=step, last_save=last_save, stopped=state.stopped,
                                                   dist=dist):
                save_state(snapshot(model, critic, data, state, step=step + 1, epoch=epoch, order=order, dist=dist))
                last_save = time.monotonic()
            if state.stopped:
                break


def loop_result(model, critic, data: TrainingData, cfg: TrainConfig, state: LoopState, *, temperature: float,
                pad_token_id: int, entropy_threshold: float | None, dist) -> TrainResult:
    """pi_theta's log-probs after the updates (on pi_old's kept sets with the keep sampling mask) and the
    loop's metrics: the step means, what moved, what was skipped or stopped."""
    with torch.no_grad():
        if data.kept is not None:  # on pi_old's supports, like the old log-probs they are compared with
            truncated_of = (batched_truncated_logprobs if dist is None
                            else (lambda model, *args, **kw: dist.share_truncated_logprobs(*args, **kw)))
            with autocast(cfg):
                new = truncated_of(model, data.prompt_token_ids, data.completion_token_ids, data.kept,
                                   temperature=temperature, max_tokens_per_batch=_budget(data, cfg),
                                   chunk_size=cfg.chunk_size)
        else:
            new, _ = _all_logprobs(model, data, cfg, temperature=temperature, pad_token_id=pad_token_id,
                                   with_entropy=False, dist=dist)
    old, trainable = state.old, np.flatnonzero(data.trainable)
    gather = None if dist is None else dist.dist.gather
    metrics = {**_summary(state.steps, data, old, new, state.old_entropy, gather), "skipped_steps": state.skipped,
               "early_stopped": state.stopped,
               "planned_optimizer_steps": count_optimizer_steps(len(trainable_rows(data)), cfg)}
    if entropy_threshold is not None:
        metrics["high_entropy_threshold"] = entropy_threshold
    metrics["keep_sampling_mask"] = data.kept is not None
    if data.kept is not None:  # how much of pi_old the sampler's support held, on average over tokens
        keep = np.concatenate([data.policy_values(data.old_logprobs_full, i) - data.policy_values(old, i)
                               for i in trainable] or [[]])
        metrics["sampling_kept_mass_mean"] = _mean(np.exp(keep), gather, empty=1.0)
    if critic is not None:
        metrics.update(_critic_summary(state.steps, data, gather))
    return TrainResult(metrics=metrics, steps=state.steps, old_logprobs=old, old_entropy=state.old_entropy,
                       new_logprobs=new)


def _keep_sampling_mask(model, data: TrainingData, cfg: TrainConfig, truncation: tuple[int, float], *,
                        temperature: float, dist) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """DeepSeek-V3.2's keep sampling mask: pi_old's kept sets (into data.kept), its truncated log-probs and
    entropies (returned); the full log-probs go to data.old_logprobs_full for the KL's importance weight."""
    top_k, top_p = truncation
    kept_sets_of = (batched_kept_sets if dist is None
                    else (lambda model, *args, **kw: dist.share_kept_sets(*args, **kw)))
    with autocast(cfg):
        old, kept, old_full, entropy = kept_sets_of(
            model, data.prompt_token_ids, data.completion_token_ids, temperature=temperature, top_k=top_k,
            top_p=top_p, max_tokens_per_batch=_budget(data, cfg), chunk_size=cfg.chunk_size)
    data.old_logprobs_full = old_full
    data.kept = kept
    return old, entropy


def _entropy_mask(data: TrainingData, old_entropy: list[np.ndarray], cfg: TrainConfig, dist=None) -> float | None:
    """With train.top_entropy_quantile < 1, set data.entropy_keep from pi_old's entropies; return the threshold.

    The threshold is taken once over the policy tokens of every trainable row (not per micro-batch),
    so it is the same whatever the split and after a resume (old_entropy is part of the saved state).
    Under torchrun each rank holds its rows' entropies: the quantile of them all is found without moving them.
    """
    if cfg.top_entropy_quantile >= 1.0:
        data.entropy_keep = None
        return None
    rows = np.flatnonzero(data.trainable)
    entropies = np.concatenate([data.policy_values(old_entropy, i) for i in rows] or [[]])
    if dist is None:
        threshold = high_entropy_threshold(entropies, top_quantile=cfg.top_entropy_quantile)
    else:
        threshold = quantile_over_ranks(entropies, 1.0 - cfg.top_entropy_quantile, dist.dist.gather)
    keep = [np.asarray(h, dtype=np.float64) >= threshold for h in old_entropy]
    if data.policy_mask is not None:
        keep = [k & m for k, m in zip(keep, data.policy_mask)]
    data.entropy_keep = keep
    return threshold


def _optimizer_step(model, critic, optimizers, data, minibatch, cfg, *, temperature, pad_token_id, max_length,
                    step, epoch, dist=None):
    """One optimizer step over ``minibatch``; None (and no update) if a loss or a gradient norm is not finite.

    Every micro-batch runs backward, even on a non-finite loss: losses and health statistics stay
    on the device and are read back once, after the last micro-batch (one GPU sync per step, not
    per micro-batch), and then the skip decision is taken. With ``dist`` each rank runs the
    micro-batches cut from its own rows of the minibatch (`micro_batch_plan`; zero-weighted passes
    where it has fewer than another rank, so that FSDP's reduce-scatters stay in step) and the
    decision is taken on every micro-batch's loss, gathered from all ranks.
    """
    lengths = policy_token_counts(data, minibatch)  # the loss's tokens: a multi-turn row's policy tokens
    step_tokens = int(lengths.sum())
    step_sequences = step_sequence_count(lengths, sequence_count=cfg.sequence_count)
    micro_batches, num_micro_batches = micro_batch_plan(minibatch, data, cfg, dist)

    def norm_for(mask_BC) -> Normalisers:
        tokens, sequences, scale = loss_normalisers(mask_BC, scope=cfg.token_mean_scope, step_tokens=step_tokens,
                                                    step_sequences=step_sequences,
                                                    num_micro_batches=num_micro_batches,
                                                    sequence_count=cfg.sequence_count)
        return Normalisers(tokens, sequences, max_length, scale)

    def drop() -> None:
        for opt in optimizers:
            if opt is not None:
                opt.zero_grad(set_to_none=True)  # drop what earlier micro-batches accumulated

    parts, losses = [], []
    dropouts = _lora_dropouts(model, cfg)
    for layer in dropouts:
        layer.train()
    for idx in micro_batches:
        loss, health = micro_batch_loss(model, critic, data, np.zeros(1, np.int64) if idx is None else idx, cfg,
                                        temperature=temperature, pad_token_id=pad_token_id, norm_for=norm_for,
                                        dist=dist)
        if idx is None:  # dist: this rank has one micro-batch fewer; the pass only keeps collectives in step
            (loss * 0.0).backward()
            continue
        loss.backward()  # a non-finite loss is caught below, once per step: checking here would sync the GPU
        parts.append({**health, "micro_batch_loss": loss.detach()})
    for layer in dropouts:
        layer.eval()
    parts = health_to_host(parts)
    losses = [part.pop("micro_batch_loss") for part in parts]
    if dist is not None:  # every rank's micro-batches, rank by rank
        losses, parts = map(list, zip(*dist.concat(list(zip(losses, parts)))))
    if not all(math.isfinite(x) for x in losses):
        drop()
        return None
    loss_sum = sum(losses)
    clip = torch.nn.utils.clip_grad_norm_ if dist is None else dist.clip_grad_norm_
    grad_norm = float(clip(model.parameters(), cfg.max_grad_norm))
    critic_grad_norm = float(clip(critic.parameters(), cfg.critic.max_grad_norm)) if critic is not None else 0.0
    if not (math.isfinite(grad_norm) and math.isfinite(critic_grad_norm)):
        drop()
        return None
    for opt in optimizers:
        if opt is not None:
            opt.step()
    drop()
    record = {"step": step, "epoch": epoch, "loss": loss_sum, "grad_norm": grad_norm, "lr": cfg.lr,
              "sequences": len(minibatch), "tokens": step_tokens, **_combine(parts)}
    if critic is not None:
        record["critic_grad_norm"] = critic_grad_norm
    return record


def _lora_dropouts(model, cfg: TrainConfig) -> list[torch.nn.Module]:
    if not (cfg.lora.enabled and cfg.lora.dropout > 0):
        return []
    from rlpipe.models.lora.peft_model import dropout_modules

    return dropout_modules(model)


def _mean(values: np.ndarray, gather, *, empty: float = 0.0) -> float:
    """The mean of ``values`` (numpy's, one process) or of every rank's values together (``gather``)."""
    if gather is None:
        return float(values.mean()) if values.size else empty
    total = sums_over_ranks({"sum": float(np.sum(values, dtype=np.float64)), "count": int(values.size)}, gather)
    return total["sum"] / total["count"] if total["count"] else empty


def _variance(values: np.ndarray, gather) -> float:
    """numpy's variance (ddof 0) of ``values``, or of every rank's together: the mean first, then the squares."""
    if gather is None:
        return float(np.var(values)) if values.size else 0.0
    mean = _mean(values.astype(np.float64), gather)
    return _mean(np.square(values.astype(np.float64) - mean), gather)


def _critic_summary(steps, data: TrainingData, gather=None) -> dict[str, Any]:
    """Critic health: its loss, clip fraction, and how much of the returns' variance V_old explained."""
    keep = np.flatnonzero(data.trainable)
    ret = np.concatenate([data.returns[i] for i in keep]) if keep.size else np.zeros(0)
    val = np.concatenate([data.old_values[i] for i in keep]) if keep.size else np.zeros(0)
    var = _variance(ret, gather)
    unexplained = _variance(ret - val, gather)
    mean_of = lambda key: float(np.mean([s[key] for s in steps])) if steps else 0.0  # noqa: E731
    return {"value_loss": mean_of("value_loss"), "value_clip_fraction": mean_of("value_clip_fraction"),
            "critic_grad_norm_mean": mean_of("critic_grad_norm"),
            "explained_variance": 1.0 - unexplained / var if var > 0 else 0.0}


def _summary(steps, data: TrainingData, old, new, old_entropy, gather=None) -> dict[str, Any]:
    """The loop's metrics: step means, and over the trainable policy tokens (of every rank) what moved."""
    def mean_of(key: str) -> float:
        return float(np.mean([s[key] for s in steps])) if steps else 0.0

    mask = data.trainable
    flat = lambda rows: (np.concatenate([data.policy_values(rows, i) for i in np.flatnonzero(mask)])  # noqa: E731
                         if mask.any() else np.zeros(0))
    delta = flat(new) - flat(old)
    entropy = (np.concatenate([data.policy_values(old_entropy, i) for i in range(len(old_entropy))])
               if old_entropy else np.zeros(0))
    return {
        "optimizer_steps": len(steps),
        "trained_sequences": len(trainable_rows(data)),
        "loss_mean": mean_of("loss"),
        "clip_fraction": mean_of("clip_fraction"),
        "approx_kl_old": mean_of("approx_kl"),
        "kl_ref": mean_of("kl_ref"),
        "grad_norm_mean": mean_of("grad_norm"),
        "grad_norm_max": max((s["grad_norm"] for s in steps), default=0.0),
        "ratio_min": min((s["ratio_min"] for s in steps), default=1.0),
        "ratio_max": max((s["ratio_max"] for s in steps), default=1.0),
        "entropy_old": _mean(entropy, gather),
        "logprob_change_mean": _mean(delta, gather),
        # the same k3 estimate as approx_kl (r = pi_new / pi_old), after the last step
        "final_kl_old": _mean(np.exp(delta) - 1 - delta, gather),
        **{key: mean_of(key) for key in OPTIONAL_STEP_METRICS if steps and key in steps[0]},
    }
