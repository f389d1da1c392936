"""DeepSeek-V3.2's "keep sampling mask": the sampler's top-k/top-p support, applied to pi_old and pi_theta.

With `generate.top_p < 1` or `generate.top_k > 0` the sampler draws token t from pi_old truncated to a
support S_t and renormalised, and records that distribution's log-prob. The trainer's log-probs are of
the full softmax, so the ratio pi_theta / pi_old and every sampler-vs-trainer comparison mix two
distributions (ALGORITHMS.md, "Sampling truncation"). Here both policies are truncated to the same S_t:
`log pi^S(o_t) = z(o_t) - logsumexp_{v in S_t} z(v)`, z = logits / temperature.

Recompute, not store: S_t is recomputed by the trainer from its own pi_old logits with the sampler's
rule (`rlpipe.engines.hf.filter_logits`, the function the HF engine samples with), once per iteration,
in the pass that recomputes the old log-probs. Why: storing the support costs |S_t| ids per token in
the rollout table (up to the whole vocabulary at a flat position) and vLLM does not report it at all,
while the recomputed one costs one no-grad LM-head pass and is exact up to the float noise between
sampler and trainer logits (which can only move a token that sits on the top-p boundary). The sampled
token is always added to S_t, so its log-prob is finite even if that noise dropped it.
The sets live in memory for the iteration (and in the train stage's resume state), as int32 ids.
Under torchrun, `rlpipe.training.distributed.PolicyForward` runs `batch_kept_sets` and
`completion_logprobs_truncated` inside the FSDP root, on the batches one process would make.

What uses which: the policy ratio, the off-policy mask, truncated importance sampling and the health
metrics use the truncated log-probs of pi_old and pi_theta; the KL to pi_ref (and its importance
weight) and the entropy use the full softmax, as the reference stage does: that KL regularises the
model itself, not its truncated sampler (NeMo-RL does the same).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from rlpipe.engines.base import eval_mode
from rlpipe.engines.chunked_head import ChunkLogprobs, fused_on_cuda, logit_stats
from rlpipe.engines.hf import filter_logits
from rlpipe.engines.logprobs import (PackedBatch, TokenBatch, completion_grid, completion_hidden, make_packed_batch,
                                     token_budget_batches, unpad)

KeptSets = list[list[np.ndarray]]  # per sequence, per completion token: the int32 vocabulary ids of S_t


def kept_sets(logits_NV: torch.Tensor, target_N: torch.Tensor, *, temperature: float, top_k: int,
              top_p: float) -> list[np.ndarray]:
    """S_t of each of N positions: the ids the sampler's rule keeps from softmax(logits / T), plus the target.

    Shapes: logits_NV [N, V], target_N [N] -> N int32 arrays (ascending ids). Worked example: logits
    log([0.5, 0.3, 0.15, 0.05]), T 1, top_p 0.9 -> mass before each sorted token [0, 0.5, 0.8, 0.95]
    -> S = {0, 1, 2}; with target 3 (a boundary token dropped by float noise) S = {0, 1, 2, 3}.
    """
    with torch.no_grad():
        keep_NV = filter_logits(logits_NV.float() / temperature, top_k=top_k, top_p=top_p) > float("-inf")
        keep_NV[torch.arange(keep_NV.shape[0], device=keep_NV.device), target_N] = True
        row_M, col_M = (x.cpu().numpy() for x in keep_NV.nonzero(as_tuple=True))  # row-major: ids ascend per row
    bounds = np.searchsorted(row_M, np.arange(keep_NV.shape[0] + 1))
    return [col_M[a:b].astype(np.int32) for a, b in zip(bounds[:-1], bounds[1:])]


def truncated_target_logprobs(logits_NV: torch.Tensor, target_N: torch.Tensor, kept_N: Sequence[np.ndarray], *,
                              temperature: float) -> torch.Tensor:
    """`z(target) - logsumexp_{v in S_t} z(v)` with z = logits / T: the log-prob under softmax truncated to S_t.

    Differentiable in `logits_NV` (plain autograd: keeps one [N, V] float32 tensor per call for backward).
    Its gradient is `onehot(target) - p^S`, with p^S the truncated distribution (0 outside S_t).
    Shapes: logits_NV [N, V], target_N [N], N arrays of ids -> [N] float32.
    """
    n, vocab = logits_NV.shape
    sizes = np.fromiter((len(ids) for ids in kept_N), dtype=np.int64, count=n)
    rows = torch.from_numpy(np.repeat(np.arange(n), sizes))
    cols = torch.from_numpy(np.concatenate(kept_N).astype(np.int64) if n else np.zeros(0, np.int64))
    keep_NV = torch.zeros((n, vocab), dtype=torch.bool)
    keep_NV[rows, cols] = True
    keep_NV = keep_NV.to(logits_NV.device)
    z_NV = (logits_NV.float() / temperature).masked_fill(~keep_NV, float("-inf"))
    return z_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z_NV, dim=-1)


def _ordered(kept: KeptSets, row_N: torch.Tensor, col_N: torch.Tensor) -> list[np.ndarray]:
    """The kept sets of a batch in the N order of its positions."""
    return [kept[r][c] for r, c in zip(row_N.tolist(), col_N.tolist())]


def completion_logprobs_truncated(model: torch.nn.Module, batch: TokenBatch | PackedBatch, kept: KeptSets, *,
                                  temperature: float, chunk_size: int, with_entropy: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(full_BC, entropy_BC or None, truncated_BC): `completion_logprobs` plus the log-probs truncated to `kept`.

    One body pass; the head runs twice per chunk (the chunked full-softmax term, then the truncated
    one). `kept[b][t]` is S_t of completion token t of sequence b (from `batched_kept_sets`).
    Differentiable when grad is enabled, like `completion_logprobs`.
    """
    hidden_NH, target_N, row_N, col_N, head = completion_hidden(model, batch, temperature=temperature,
                                                                chunk_size=chunk_size)
    device = hidden_NH.device
    params = list(head.parameters())
    with_grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or any(p.requires_grad for p in params))
    kept_N = _ordered(kept, row_N, col_N)
    full, entropy, truncated = [], [], []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        h_NH, t_N = hidden_NH[start:start + chunk_size], target_N[start:start + chunk_size]
        if with_grad:
            logprob_N, entropy_N = ChunkLogprobs.apply(h_NH, t_N, head, temperature, with_entropy, *params)
        else:
            logprob_N, _, entropy_N = fused_on_cuda(logit_stats, device)(head(h_NH), t_N, temperature, with_entropy)
        full.append(logprob_N)
        entropy.append(entropy_N)
        truncated.append(truncated_target_logprobs(head(h_NH), t_N, kept_N[start:start + chunk_size],
                                                   temperature=temperature))
    shape = (len(batch.completion_lengths), batch.max_completion_length)
    return (completion_grid(full, row_N, col_N, shape, device),
            completion_grid(entropy, row_N, col_N, shape, device) if with_entropy else None,
            completion_grid(truncated, row_N, col_N, shape, device))


def batch_kept_sets(model: torch.nn.Module, batch: TokenBatch | PackedBatch, *, temperature: float, top_k: int,
                    top_p: float, chunk_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeptSets]:
    """(truncated_BC, full_BC, entropy_BC, kept) of one batch under `model` (pi_old); call it without grad.

    `kept[b][t]` is S_t of completion token t of sequence b. The truncated log-probs are the sampler's:
    `log softmax(filter(logits / T))` of each token (the HF engine's `pick_next_tokens`), so against the
    recorded sampler log-probs they differ by float noise only; the full ones and the entropies are
    `completion_logprobs`'s, from the same logits.
    """
    hidden_NH, target_N, row_N, col_N, head = completion_hidden(model, batch, temperature=temperature,
                                                                chunk_size=chunk_size)
    pieces: dict[str, list[torch.Tensor]] = {"truncated": [], "full": [], "entropy": []}
    sets: list[np.ndarray] = []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        logits_NV = head(hidden_NH[start:start + chunk_size])
        t_N = target_N[start:start + chunk_size]
        chunk_sets = kept_sets(logits_NV, t_N, temperature=temperature, top_k=top_k, top_p=top_p)
        pieces["truncated"].append(truncated_target_logprobs(logits_NV, t_N, chunk_sets, temperature=temperature))
        logprob_N, _, entropy_N = fused_on_cuda(logit_stats, hidden_NH.device)(logits_NV, t_N, temperature, True)
        pieces["full"].append(logprob_N)
        pieces["entropy"].append(entropy_N)
        sets += chunk_sets
    kept: KeptSets = [[None] * n for n in batch.completion_lengths]  # type: ignore[list-item]
    for r, c, ids in zip(row_N.tolist(), col_N.tolist(), sets):
        kept[r][c] = ids
    shape = (len(batch.completion_lengths), batch.max_completion_length)
    grids = [completion_grid(pieces[name], row_N, col_N, shape, hidden_NH.device)
             for name in ("truncated", "full", "entropy")]
    return grids[0], grids[1], grids[2], kept


def batched_kept_sets(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                      completions: Sequence[Sequence[int]], *, temperature: float, top_k: int, top_p: float,
                      max_tokens_per_batch: int, chunk_size: int, autocast_dtype: torch.dtype | None = None
                      ) -> tuple[list[np.ndarray], KeptSets, list[np.ndarray], list[np.ndarray]]:
    """(truncated log-probs, kept sets, full log-probs, entropies) of every completion (`batch_kept_sets`),
    in input order: one no-grad pass over the packed token-budget batches of `batched_completion_logprobs`."""
    truncated: list = [None] * len(prompts)
    full: list = [None] * len(prompts)
    entropy: list = [None] * len(prompts)
    kept: list = [None] * len(prompts)
    for indices, batch in _packed_no_grad(model, prompts, completions, max_tokens_per_batch, autocast_dtype):
        grids = batch_kept_sets(model, batch, temperature=temperature, top_k=top_k, top_p=top_p,
                                chunk_size=chunk_size)
        for j, i in enumerate(indices):
            kept[i] = grids[3][j]
        for grid, out in zip(grids[:3], (truncated, full, entropy)):
            for i, row in zip(indices, unpad(grid, batch.completion_lengths)):
                out[i] = row
    return truncated, kept, full, entropy


def batched_truncated_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                               completions: Sequence[Sequence[int]], kept: KeptSets, *, temperature: float,
                               max_tokens_per_batch: int, chunk_size: int,
                               autocast_dtype: torch.dtype | None = None) -> list[np.ndarray]:
    """Log-probs of every completion truncated to the given kept sets (e.g. pi_new on pi_old's S_t), no grad."""
    out: list = [None] * len(prompts)
    for indices, batch in _packed_no_grad(model, prompts, completions, max_tokens_per_batch, autocast_dtype):
        _, _, truncated_BC = completion_logprobs_truncated(model, batch, [kept[i] for i in indices],
                                                           temperature=temperature, chunk_size=chunk_size,
                                                           with_entropy=False)
        for i, row in zip(indices, unpad(truncated_BC, batch.completion_lengths)):
            out[i] = row
    return out


def _packed_no_grad(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], max_tokens_per_batch: int,
                    autocast_dtype: torch.dtype | None):
    """(row indices, packed batch) of `batched_completion_logprobs`' token-budget batches, yielded inside
    no-grad, eval mode and the optional autocast: the one loop both batched truncation passes run."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device
    autocast = (torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else nullcontext())
    with torch.inference_mode(), eval_mode(model), autocast:
        for indices in token_budget_batches(lengths, max_tokens_per_batch, packed=True):
            yield indices, make_packed_batch([prompts[i] for i in indices], [completions[i] for i in indices])
