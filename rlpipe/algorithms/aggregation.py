"""Loss aggregation: how per-token terms become the one number that is back-propagated (torch).

Why the normalisers are arguments: with gradient accumulation and data-parallel ranks, one
optimizer step sees a batch split into micro-batches. Dividing each micro-batch by its *own* token
or sequence count makes the gradient depend on the split (short micro-batches get up-weighted), a
trap several frameworks fell into. Here the caller passes the counts of the WHOLE optimizer step
(all micro-batches, all ranks; `count_valid` gives one micro-batch's share), so that the sum over
micro-batches of `aggregate_loss(...)` equals the full-batch value and gradient.

To reproduce a framework that did normalise per micro-batch (`train.token_mean_scope:
micro_batch`, see rlpipe.profiles), `loss_normalisers` hands each micro-batch its own counts and
a scale of 1/k: the step's loss is then the MEAN of the k micro-batch means. That is what those
frameworks computed: each divides every micro-batch loss by the gradient-accumulation steps (TRL's
`loss / current_gradient_accumulation_steps`, verl's `loss_scale_factor = 1 / gradient_accumulation`,
DeepSpeed's backward in OpenRLHF before v0.10.4) and averages the gradients of data-parallel ranks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_AGGREGATIONS: tuple[str, ...] = (
    "token-mean",  # sum over valid tokens / total_tokens (DAPO)
    "seq-mean-token-mean",  # mean over each sequence's tokens, then / total_sequences (GRPO)
    "seq-mean-token-sum",  # sum over each sequence's tokens, then / total_sequences
    "seq-mean-token-sum-norm",  # sum over each sequence's tokens / max_length, then / total_sequences (Dr.GRPO)
    "token-sum",  # sum over valid tokens, no normaliser (verl's token-sum: longer batches, larger steps)
)

SEQUENCE_COUNTS: tuple[str, ...] = (
    "nonempty",  # rows with at least one loss token: an empty completion does not dilute the mean (rlpipe)
    "all_rows",  # every row of the step, empty ones adding 0 (verl's global_batch_size, TRL's per-row .mean())
)

TOKEN_MEAN_SCOPES: tuple[str, ...] = (
    "minibatch",  # counts of the whole optimizer step: invariant to the micro-batch split (ALGORITHMS.md)
    "micro_batch",  # each micro-batch's own counts, scaled by 1/k: the mean of per-micro-batch means
)

_NEEDS = {
    "token-mean": ("total_tokens",),
    "seq-mean-token-mean": ("total_sequences",),
    "seq-mean-token-sum": ("total_sequences",),
    "seq-mean-token-sum-norm": ("total_sequences", "max_length"),
    "token-sum": (),
}


@torch.no_grad()
def count_valid(mask_BT: torch.Tensor, *, sequence_count: str = "nonempty") -> tuple[int, int]:
    """(valid tokens, sequences) of one micro-batch.

    Sum these over the micro-batches (and all-reduce over ranks) of an optimizer step to get the
    `total_tokens` / `total_sequences` of `aggregate_loss`. `sequence_count` "nonempty" counts the
    rows with at least one valid token, so an empty row (e.g. an overlong completion filtered out)
    does not dilute the sequence mean; "all_rows" counts every row, as verl and TRL do: token losses
    [[1, 3], []] give seq-mean-token-sum 4 / 1 = 4 with "nonempty", 4 / 2 = 2 with "all_rows".
    """
    if sequence_count not in SEQUENCE_COUNTS:
        raise ValueError(f"unknown sequence count {sequence_count!r}; valid: {list(SEQUENCE_COUNTS)}")
    m = mask_BT.bool()
    sequences = m.shape[0] if sequence_count == "all_rows" else int(m.any(dim=1).sum())
    return int(m.sum()), sequences


def step_sequence_count(row_tokens: Sequence[int], *, sequence_count: str) -> int:
    """The `total_sequences` of an optimizer step from each row's loss-token count (rows of the whole step).

    The loop knows these per-row counts on every rank (the global rows), so this is the same number
    `count_valid` summed over every micro-batch and rank would give.
    """
    if sequence_count not in SEQUENCE_COUNTS:
        raise ValueError(f"unknown sequence count {sequence_count!r}; valid: {list(SEQUENCE_COUNTS)}")
    counts = [int(n) for n in row_tokens]
    return len(counts) if sequence_count == "all_rows" else sum(n > 0 for n in counts)


def loss_normalisers(
    mask_BT: torch.Tensor,
    *,
    scope: str,
    step_tokens: int,
    step_sequences: int,
    num_micro_batches: int,
    sequence_count: str = "nonempty",
) -> tuple[int, int, float]:
    """(total_tokens, total_sequences, scale) for one micro-batch of an optimizer step.

    Use: `scale * aggregate_loss(loss_BT, mask_BT, mode=..., total_tokens=total_tokens,
    total_sequences=total_sequences, max_length=...)`, then backward; summed over the step's
    micro-batches this is the step's loss.
      minibatch:   (step_tokens, step_sequences, 1.0) -- the step's counts; the sum over micro-batches
                   is the full-batch value whatever the split (rlpipe's default).
      micro_batch: (count_valid(mask_BT, sequence_count=...)..., 1 / num_micro_batches) -- its own counts;
                   the step's loss is the mean over micro-batches of their own means, which depends
                   on the split (what verl's legacy workers, TRL's bnpo/grpo/dr_grpo losses and
                   OpenRLHF before v0.10.4 computed).
    `mask_BT` is this micro-batch's mask; `step_tokens` / `step_sequences` are `count_valid` summed
    over all micro-batches of the step; `num_micro_batches` is this step's number (a last, short
    minibatch may have fewer, and then its actual count is the one the frameworks divide by).
    """
    if scope not in TOKEN_MEAN_SCOPES:
        raise ValueError(f"unknown token-mean scope {scope!r}; valid: {list(TOKEN_MEAN_SCOPES)}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches!r}")
    if scope == "minibatch":
        return step_tokens, step_sequences, 1.0
    tokens, sequences = count_valid(mask_BT, sequence_count=sequence_count)
    return tokens, sequences, 1.0 / num_micro_batches


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str,
    total_tokens: int | float | None,
    total_sequences: int | float | None,
    max_length: int | None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with step-level normalisers (see module docstring).

    Modes (ALGORITHMS.md, "Loss aggregation"), with m the mask and n_i = sum_t m_{i,t}:
      token-mean:               sum_{i,t} m L / total_tokens
      seq-mean-token-mean:      sum_i (sum_t m L / n_i) / total_sequences
      seq-mean-token-sum:       sum_{i,t} m L / total_sequences
      seq-mean-token-sum-norm:  sum_{i,t} m L / (max_length * total_sequences)
      token-sum:                sum_{i,t} m L (no normaliser: a sum is split-invariant as it is; with
                                scope micro_batch the caller's 1/k scale still applies)
    n_i is each sequence's own count (from mask_BT), so sequences are never split across calls.
    A normaliser a mode does not use may be None; one it uses is required. A count of 0 (an empty
    step) gives 0, not NaN; padded positions are excluded with torch.where, so NaN there is harmless.

    Shapes: loss_BT [B, T], mask_BT [B, T] bool or 0/1 -> scalar float32 (keeps the graph).
    """
    if mode not in _NEEDS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {list(LOSS_AGGREGATIONS)}")
    given = {"total_tokens": total_tokens, "total_sequences": total_sequences, "max_length": max_length}
    for key in _NEEDS[mode]:
        if given[key] is None or not given[key] >= 0:
            raise ValueError(f"aggregation mode {mode!r} needs {key} >= 0, got {given[key]!r}")
    if mask_BT.shape != loss_BT.shape:
        raise ValueError(f"mask_BT has shape {tuple(mask_BT.shape)}, loss_BT has {tuple(loss_BT.shape)}")
    m = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    masked = torch.where(m, loss_BT.float(), 0.0)

    if mode == "token-mean":
        # the step's token count is 0 only if every mask is empty, and then the sum is 0 too
        return masked.sum() / max(total_tokens, 1)
    if mode == "seq-mean-token-mean":
        per_seq_B = masked.sum(dim=1) / m.sum(dim=1).clamp_min(1)
        return per_seq_B.sum() / max(total_sequences, 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(total_sequences, 1)
    if mode == "token-sum":
        return masked.sum()
    if max_length == 0:
        raise ValueError("aggregation mode 'seq-mean-token-sum-norm' needs max_length > 0")
    return masked.sum() / (max_length * max(total_sequences, 1))
