"""Per-token log-probs (and entropies) of completions under a causal LM, without full-vocab logits.

Used by the reference_logprob stage (no grad) and by training (with grad). A [batch, seq, vocab]
float32 logits tensor is the largest thing a naive implementation builds (8 x 2048 x 152k x 4 B
= 10 GB), so this module never makes one:

1. run the transformer body once over the right-padded prompt+completion batch -> hidden states;
2. keep only the hidden states at positions that predict a completion token (prompt positions
   never need the LM head);
3. apply the output embedding to `chunk_size` of those positions at a time, log_softmax in float32,
   gather the target token (and the full-vocab entropy if asked).

With autograd on, each chunk runs under activation checkpointing, so backward recomputes one
chunk's logits at a time instead of keeping every chunk's [chunk, vocab] tensors alive.

All log-probs are of softmax(logits / temperature), the temperature used for sampling (ALGORITHMS.md).
Gotcha: the body is called as `model.base_model` and the head as `model.get_output_embeddings()`,
bypassing the causal-LM wrapper's forward; wrappers that act in that forward (e.g. FSDP on the root
module, accelerate device-map hooks) or models that rescale logits there are not supported.
For a PEFT model pass `peft_model.get_base_model()` (the adapters live inside its layers).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from rlpipe.engines.base import eval_mode


@dataclass
class TokenBatch:
    """Right-padded prompt+completion sequences, B rows of T tokens.

    completion_mask_BT is True exactly at the positions that hold completion tokens.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    completion_mask_BT: torch.Tensor
    prompt_lengths: list[int]
    completion_lengths: list[int]

    @property
    def max_completion_length(self) -> int:
        return max(self.completion_lengths, default=0)

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            input_ids_BT=self.input_ids_BT.to(device),
            attention_mask_BT=self.attention_mask_BT.to(device),
            completion_mask_BT=self.completion_mask_BT.to(device),
            prompt_lengths=list(self.prompt_lengths),
            completion_lengths=list(self.completion_lengths),
        )


def make_token_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    completion_token_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
) -> TokenBatch:
    """Concatenate each prompt with its completion and right-pad to the longest (CPU tensors).

    Every prompt needs at least one token: the first completion token is predicted from the last prompt position.
    """
    if len(prompt_token_ids) != len(completion_token_ids):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(completion_token_ids)} completions")
    if not prompt_token_ids:
        raise ValueError("empty batch")
    prompt_lengths = [len(p) for p in prompt_token_ids]
    completion_lengths = [len(c) for c in completion_token_ids]
    if min(prompt_lengths) == 0:
        raise ValueError(f"prompt {prompt_lengths.index(0)} is empty")
    total = max(p + c for p, c in zip(prompt_lengths, completion_lengths))
    rows = [list(p) + list(c) for p, c in zip(prompt_token_ids, completion_token_ids)]
    input_ids_BT = torch.tensor([row + [pad_token_id] * (total - len(row)) for row in rows], dtype=torch.long)
    col_T = torch.arange(total)
    prompt_len_B1 = torch.tensor(prompt_lengths).unsqueeze(-1)
    seq_len_B1 = prompt_len_B1 + torch.tensor(completion_lengths).unsqueeze(-1)
    return TokenBatch(
        input_ids_BT=input_ids_BT,
        attention_mask_BT=(col_T < seq_len_B1).long(),
        completion_mask_BT=(col_T >= prompt_len_B1) & (col_T < seq_len_B1),
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
    )


def _check_plain_lm_head(model: torch.nn.Module) -> None:
    """Refuse models whose causal-LM forward rescales logits after the head (we apply the head ourselves)."""
    config = getattr(model, "config", None)
    for name, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0)):
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise NotImplementedError(
                f"{type(model).__name__} post-processes logits (config.{name}={value}); "
                "chunked log-probs support plain linear LM heads only"
            )


def _head_stats(
    hidden_NH: torch.Tensor,
    target_N: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of each target (and entropy) from one chunk of hidden states; logits live only in here."""
    logits_NV = head(hidden_NH).float() / temperature
    logprobs_NV = torch.log_softmax(logits_NV, dim=-1)
    target_logprob_N = logprobs_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return (target_logprob_N,)
    entropy_N = -(logprobs_NV.exp() * logprobs_NV).sum(dim=-1)
    return target_logprob_N, entropy_N


def completion_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the completion tokens of `batch`, as [B, C] float32, zero-padded.

    Row b, column t is completion token t of sequence b: log softmax(logits / temperature) of that
    token at the position before it; C is the longest completion. Entropy is the full-vocabulary
    entropy of the same distribution. Differentiable when grad is enabled; the caller picks the
    model's train/eval mode. chunk_size: completion positions per LM-head call (memory ~ chunk_size x vocab).
    """
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (use 1.0 for greedy rollouts), got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_plain_lm_head(model)
    device = next(model.parameters()).device
    batch = batch.to(device)
    n_rows, n_cols = batch.input_ids_BT.shape[0], batch.max_completion_length

    positions_BT = (batch.attention_mask_BT.cumsum(-1) - 1).clamp(min=0)
    hidden_BTH = model.base_model(
        input_ids=batch.input_ids_BT,
        attention_mask=batch.attention_mask_BT,
        position_ids=positions_BT,
        use_cache=False,
    ).last_hidden_state

    # Position p predicts token p+1; keep the positions whose next token is a completion token.
    row_N, pos_N = batch.completion_mask_BT[:, 1:].nonzero(as_tuple=True)
    target_N = batch.input_ids_BT[row_N, pos_N + 1]
    prompt_len_B = torch.tensor(batch.prompt_lengths, dtype=torch.long, device=device)
    col_N = pos_N + 1 - prompt_len_B[row_N]
    hidden_NH = hidden_BTH[row_N, pos_N]

    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embedding (LM head)")
    recompute = torch.is_grad_enabled()
    pieces: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        stop = start + chunk_size
        args = (hidden_NH[start:stop], target_N[start:stop], head, temperature, with_entropy)
        pieces.append(checkpoint(_head_stats, *args, use_reentrant=False) if recompute else _head_stats(*args))

    def to_grid(stat_index: int) -> torch.Tensor:
        grid_BC = torch.zeros((n_rows, n_cols), dtype=torch.float32, device=device)
        if not pieces:
            return grid_BC
        values_N = torch.cat([piece[stat_index] for piece in pieces])
        return grid_BC.index_put((row_N, col_N), values_N)

    return to_grid(0), (to_grid(1) if with_entropy else None)


def unpad(values_BC: torch.Tensor, lengths: Sequence[int]) -> list[np.ndarray]:
    """Split a zero-padded [B, C] grid into B float32 arrays of the given lengths."""
    grid = values_BC.detach().to(device="cpu", dtype=torch.float32).numpy()
    if len(lengths) != grid.shape[0]:
        raise ValueError(f"{len(lengths)} lengths for {grid.shape[0]} rows")
    return [grid[row, :length].copy() for row, length in enumerate(lengths)]


def _token_budget_batches(lengths: Sequence[int], max_tokens_per_batch: int) -> list[list[int]]:
    """Group indices, longest first, so that rows x longest length stays within the budget.

    A sequence longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens_per_batch:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def batched_completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    temperature: float,
    max_tokens_per_batch: int,
    chunk_size: int,
    with_entropy: bool,
    device: torch.device | str | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Log-probs (and entropies) of every completion, one float32 array per completion, in input order.

    Runs without grad and in eval mode, batching by padded-token budget (max_tokens_per_batch counts
    rows x longest prompt+completion of the batch). device: where the model lives (default: its own).
    progress: optional callback, called with the number of sequences finished after each batch.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if device is not None:
        want, have = torch.device(device), next(model.parameters()).device
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise ValueError(f"model is on {have}, not on {want}: move it first")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    logprobs: list[np.ndarray | None] = [None] * len(prompts)
    entropies: list[np.ndarray | None] = [None] * len(prompts)
    with torch.inference_mode(), eval_mode(model):
        for indices in _token_budget_batches(lengths, max_tokens_per_batch):
            batch = make_token_batch(
                [prompts[i] for i in indices], [completions[i] for i in indices], pad_token_id=pad_token_id
            )
            logprobs_BC, entropy_BC = completion_logprobs(
                model, batch, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
            )
            for i, values in zip(indices, unpad(logprobs_BC, batch.completion_lengths)):
                logprobs[i] = values
            if entropy_BC is not None:
                for i, values in zip(indices, unpad(entropy_BC, batch.completion_lengths)):
                    entropies[i] = values
            if progress is not None:
                progress(len(indices))
    return logprobs, (entropies if with_entropy else None)  # type: ignore[return-value]
