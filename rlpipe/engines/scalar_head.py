"""Forward passes of a scalar-head model (`rlpipe.models.value_model`), batched like the log-prob passes:
per-token values for the PPO critic, one score per sequence for the reward model.

Why here and not beside the model: these passes batch token rows the way `rlpipe.engines.logprobs`
does, and the model itself stays a plain module that `rlpipe.models` loads and saves.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlpipe.engines.base import eval_mode
from rlpipe.engines.logprobs import TokenBatch, make_token_batch
from rlpipe.models.value_model import ScalarHeadModel


def completion_values(model: ScalarHeadModel, batch: TokenBatch) -> torch.Tensor:
    """[B, C] values, zero-padded: column t is read at the position that predicts completion token t."""
    out_BT = model(batch)
    n_rows, n_cols = out_BT.shape[0], batch.max_completion_length
    row_N, pos_N = batch.completion_mask_BT[:, 1:].nonzero(as_tuple=True)
    prompt_len_B = torch.tensor(batch.prompt_lengths, dtype=torch.long, device=out_BT.device)
    col_N = pos_N + 1 - prompt_len_B[row_N]
    grid_BC = torch.zeros((n_rows, n_cols), dtype=torch.float32, device=out_BT.device)
    return grid_BC.index_put((row_N, col_N), out_BT[row_N, pos_N])


def sequence_scores(model: ScalarHeadModel, batch: TokenBatch) -> torch.Tensor:
    """[B] head output at the last token of each prompt+completion (the reward model's score)."""
    out_BT = model(batch)
    last_B = batch.attention_mask_BT.sum(-1) - 1
    return out_BT[torch.arange(out_BT.shape[0], device=out_BT.device), last_B]


def _batches(lengths: Sequence[int], max_tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped longest first so that rows x longest length stays within the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens_per_batch:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def batched_values(model: ScalarHeadModel, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                   *, pad_token_id: int, max_tokens_per_batch: int) -> list[np.ndarray]:
    """No-grad per-token values of every completion, one float32 array each, in input order."""
    out: list[np.ndarray | None] = [None] * len(prompts)
    device = next(model.parameters()).device
    with torch.inference_mode(), eval_mode(model):
        for idx in _batches([len(p) + len(c) for p, c in zip(prompts, completions)], max_tokens_per_batch):
            batch = make_token_batch([prompts[i] for i in idx], [completions[i] for i in idx],
                                     pad_token_id=pad_token_id).to(device)
            grid = completion_values(model, batch).cpu().numpy()
            for row, i in enumerate(idx):
                out[i] = grid[row, : len(completions[i])].copy()
    return out  # type: ignore[return-value]


def batched_scores(model: ScalarHeadModel, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                   *, pad_token_id: int, max_tokens_per_batch: int) -> np.ndarray:
    """No-grad sequence scores, float64 [B], in input order."""
    out = np.zeros(len(prompts), dtype=np.float64)
    device = next(model.parameters()).device
    with torch.inference_mode(), eval_mode(model):
        for idx in _batches([len(p) + len(c) for p, c in zip(prompts, completions)], max_tokens_per_batch):
            batch = make_token_batch([prompts[i] for i in idx], [completions[i] for i in idx],
                                     pad_token_id=pad_token_id).to(device)
            out[idx] = sequence_scores(model, batch).double().cpu().numpy()
    return out
