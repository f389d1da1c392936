"""The train_reward_model stage's logic, Bradley-Terry training: a scalar head learns to score chosen
completions above rejected ones.

The model is `rlpipe.models.value_model.ScalarHeadModel`: a causal LM's body plus Linear(hidden, 1), read at
the last token of prompt + completion (the completion ends with EOS, as a rollout that stopped
does). For a pair, ``P(chosen > rejected) = sigmoid(r_c - r_r)`` and the loss is its negative log
(ALGORITHMS.md, "Reward models"; Bradley & Terry 1952, Ouyang et al. 2022 eq. 1). Scores have no
fixed zero: only their differences are trained, so a reward model's absolute level is arbitrary
(the metrics report the scale so that a reward weight can be chosen).

The loop is deliberately plain: seeded shuffles of the train pairs each epoch, AdamW at a constant
learning rate, gradient clipping. On CPU with a fixed thread count two runs give identical weights.
Held-out pairwise accuracy before and after training is the number to watch.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from rlpipe.algorithms.losses import bradley_terry_loss
from rlpipe.config import RewardModelConfig
from rlpipe.data.io import CHECKPOINT_INFO, atomic_path
from rlpipe.engines.base import derive_seed
from rlpipe.engines.logprobs import make_token_batch
from rlpipe.engines.scalar_head import batched_scores, sequence_scores
from rlpipe.errors import ArtifactError, TrainingError
from rlpipe.models.value_model import ScalarHeadModel
from rlpipe.rewards.model_reward import PLACEHOLDER_KIND

# Seed domains: the fresh head, the held-out split and the epoch shuffles draw from independent
# streams of the one params seed (rlpipe.engines.base.derive_seed(seed, stream)).
HEAD_STREAM, SPLIT_STREAM, SHUFFLE_STREAM = 31, 32, 33


def pairwise_accuracy(chosen_scores: np.ndarray | torch.Tensor, rejected_scores: np.ndarray | torch.Tensor) -> float:
    """Share of pairs whose chosen completion scores higher; a tie counts one half.

    Why a tie counts one half: a model that cannot tell completions apart (a zero head, identical
    texts) then sits at the chance level 0.5 instead of 0.
    """
    c = np.asarray(torch.as_tensor(chosen_scores).detach().cpu(), dtype=np.float64)
    r = np.asarray(torch.as_tensor(rejected_scores).detach().cpu(), dtype=np.float64)
    return float(np.mean((c > r) + 0.5 * (c == r)))


@dataclass(frozen=True)
class PreferencePairs:
    """The token ids of every pair, in pair_id order (one list per pair in each field)."""

    prompts: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def from_frame(cls, frame: pl.DataFrame) -> PreferencePairs:
        """From a PREFERENCES table (rlpipe.data.schema)."""
        frame = frame.sort("pair_id")
        return cls(prompts=frame["prompt_token_ids"].to_list(), chosen=frame["chosen_token_ids"].to_list(),
                   rejected=frame["rejected_token_ids"].to_list())

    def max_token_id(self) -> int:
        return max((max(ids, default=-1) for field in (self.prompts, self.chosen, self.rejected) for ids in field),
                   default=-1)


def split_pairs(num_pairs: int, *, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): a seeded permutation, the first ``floor(n * eval_fraction)`` held out.

    Both are sorted so that the split, not the permutation, is what later code sees.
    """
    order = np.random.default_rng(seed).permutation(num_pairs)
    n_eval = int(num_pairs * eval_fraction)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def pair_scores(model: ScalarHeadModel, pairs: PreferencePairs, idx: Sequence[int], *,
                pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] chosen scores, [B] rejected scores) of pairs ``idx``, differentiable, from one forward pass.

    The batch holds the B chosen sequences, then the B rejected ones (2B rows, right-padded).
    """
    prompts = [pairs.prompts[i] for i in idx]
    batch = make_token_batch(prompts + prompts, [pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx],
                             pad_token_id=pad_token_id).to(next(model.parameters()).device)
    scores_2B = sequence_scores(model, batch)
    return scores_2B[: len(idx)], scores_2B[len(idx):]


def evaluate_pairs(model: ScalarHeadModel, pairs: PreferencePairs, idx: Sequence[int], *, pad_token_id: int,
                   max_tokens_per_batch: int = 16384) -> dict[str, float | None]:
    """No-grad pairwise accuracy, loss, margin and score scale on pairs ``idx`` (all None when idx is empty)."""
    keys = ("accuracy", "loss", "margin_mean", "score_chosen_mean", "score_rejected_mean", "score_std")
    if len(idx) == 0:
        return dict.fromkeys(keys)
    prompts = [pairs.prompts[i] for i in idx]
    c = batched_scores(model, prompts, [pairs.chosen[i] for i in idx], pad_token_id=pad_token_id,
                       max_tokens_per_batch=max_tokens_per_batch)
    r = batched_scores(model, prompts, [pairs.rejected[i] for i in idx], pad_token_id=pad_token_id,
                       max_tokens_per_batch=max_tokens_per_batch)
    loss = float(bradley_terry_loss(torch.from_numpy(c), torch.from_numpy(r)))
    return dict(zip(keys, (pairwise_accuracy(c, r), loss, float(np.mean(c - r)), float(np.mean(c)),
                           float(np.mean(r)), float(np.std(np.concatenate([c, r]))))))


def train_bradley_terry(model: ScalarHeadModel, pairs: PreferencePairs, train_idx: Sequence[int], *, epochs: int,
                        batch_size: int, lr: float, weight_decay: float, max_grad_norm: float, seed: int,
                        pad_token_id: int, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``epochs`` passes over the train pairs in seeded random order; returns training metrics.

    One optimizer step per ``batch_size`` pairs (the last batch of an epoch may be smaller).
    AdamW at constant ``lr`` on every parameter, body and head; gradients clipped to
    ``max_grad_norm`` (the norm before clipping is reported). A non-finite loss or gradient stops
    training: with no data-dependent failure mode in this loss, it means the settings diverge.
    ``progress``: optional callback, called with 1 per optimizer step.
    """
    train_idx = np.asarray(train_idx)
    if len(train_idx) == 0:
        raise TrainingError("no preference pairs left to train on after holding out reward_model.eval_fraction")
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses, accuracies, grad_norms = [], [], []
    model.train()
    for epoch in range(epochs):
        order = train_idx[torch.randperm(len(train_idx), generator=generator).numpy()]
        for start in range(0, len(order), batch_size):
            chosen_B, rejected_B = pair_scores(model, pairs, order[start:start + batch_size], pad_token_id=pad_token_id)
            loss = bradley_terry_loss(chosen_B, rejected_B)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
            loss_value = loss.item()
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                raise TrainingError(f"reward model step {len(losses)} (epoch {epoch}): non-finite loss "
                                    f"{loss_value} or gradient norm {grad_norm}; lower reward_model.lr")
            optimizer.step()
            losses.append(loss_value)
            accuracies.append(pairwise_accuracy(chosen_B, rejected_B))
            grad_norms.append(grad_norm)
            if progress is not None:
                progress(1)
    model.eval()
    tail = max(1, len(losses) // 10)  # first and last 10% of steps: one step's loss is noisy
    return {
        "optimizer_steps": len(losses),
        "train_loss_first": float(np.mean(losses[:tail])),
        "train_loss_last": float(np.mean(losses[-tail:])),
        "train_accuracy_last": float(np.mean(accuracies[-tail:])),
        "grad_norm_mean": float(np.mean(grad_norms)),
        "grad_norm_max": float(np.max(grad_norms)),
    }


def count_steps(num_train_pairs: int, *, epochs: int, batch_size: int) -> int:
    return epochs * math.ceil(num_train_pairs / batch_size)


def write_placeholder(out_dir: str | Path, *, reason: str) -> None:
    """A model directory holding only ``rlpipe.json`` ``{"kind": "none", "reason": ...}`` (no preference data).

    Why a directory and not nothing: DVC needs the stage's output to exist, and the `reward_model`
    reward reads this file to fail with the reason instead of a bare "file not found".
    """
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        (tmp / CHECKPOINT_INFO).write_text(json.dumps({"kind": PLACEHOLDER_KIND, "reason": reason},
                                                      sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# the stage's steps, in the order stages/train_reward_model.py calls them


def why_no_model(cfg: RewardModelConfig, *, params: str, preferences: str, num_pairs: int) -> str | None:
    """Why this run writes a placeholder instead of a model (None: it trains one)."""
    if not cfg.train:  # why: a fresh project would otherwise train a model that no configured reward reads
        return f"{params}: reward_model.train is false (set it to true to train a reward model on {preferences})"
    if num_pairs == 0:
        return f"{preferences} has no preference pairs (prepare.files.preferences is null)"
    return None


def load_start(init: str, pairs: PreferencePairs, cfg: RewardModelConfig, *, seed: int,
               preferences: str) -> tuple[Any, ScalarHeadModel]:
    """The tokenizer and the model to train: --init's body with a seeded fresh head (or a saved reward model);
    refuses preferences tokenized with a larger vocabulary than the model's."""
    from rlpipe.models.loading import load_tokenizer
    from rlpipe.models.value_model import load_scalar_model

    tokenizer = load_tokenizer(init)
    model = load_scalar_model(init, seed=derive_seed(seed, HEAD_STREAM), device=cfg.device, dtype=cfg.dtype)
    vocab = model.body.get_input_embeddings().num_embeddings
    if pairs.max_token_id() >= vocab:
        raise ArtifactError(f"{preferences}: holds token id {pairs.max_token_id()} but {init} has a vocabulary of "
                            f"{vocab}; prepare the preferences with the reward model's tokenizer")
    return tokenizer, model


def fit(model: ScalarHeadModel, pairs: PreferencePairs, cfg: RewardModelConfig, train_idx: np.ndarray,
        eval_idx: np.ndarray, *, seed: int, pad_token_id: int,
        progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train on ``train_idx`` (`split_pairs`); the held-out accuracy before and after, and the trainer's numbers."""
    before = evaluate_pairs(model, pairs, eval_idx, pad_token_id=pad_token_id)
    train_m = train_bradley_terry(model, pairs, train_idx, epochs=cfg.epochs, batch_size=cfg.batch_size,
                                  lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                                  seed=derive_seed(seed, SHUFFLE_STREAM), pad_token_id=pad_token_id, progress=progress)
    after = evaluate_pairs(model, pairs, eval_idx, pad_token_id=pad_token_id)
    return {"kind": "bradley_terry", "num_pairs": len(pairs), "num_train_pairs": len(train_idx),
            "num_eval_pairs": len(eval_idx), "eval_accuracy_init": before["accuracy"],
            **{f"eval_{k}": v for k, v in after.items()}, **train_m}
