"""What the optimisation loop carries from one optimizer step to the next, and what a resume state holds.

`LoopState` is the loop's running record; `snapshot` turns it, the models and the optimizers into the
state a killed run resumes from (`rlpipe.training.resume` writes it to disk), and `load_module_state`
restores a model and its optimizer from one. A LoRA run's frozen base weights are left out
(`frozen_keys`); under torchrun, ``dist`` gathers and scatters the shards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlpipe.config import TrainConfig
from rlpipe.errors import TrainingError
from rlpipe.training.objective import TrainingData


@dataclass
class LoopState:
    """What the loop carries from one optimizer step to the next, and what a resume state restores.

    ``old`` / ``old_entropy``: pi_old's per-token log-probs and entropies, recomputed before the first step
    (or read back from a resume state, since the model there has already moved); ``done``: optimizer
    steps taken; ``skipped``: steps skipped for a non-finite loss or gradient; ``steps``: each taken
    step's metrics; ``stopped``: train.target_kl ended the loop early.
    """

    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None
    old: list[np.ndarray]
    old_entropy: list[np.ndarray]
    done: int = 0
    skipped: int = 0
    steps: list[dict[str, float]] = field(default_factory=list)
    stopped: bool = False


def snapshot(model, critic, data: TrainingData, state: LoopState, *, step: int, epoch: int, order, dist
             ) -> dict[str, Any]:
    """The whole loop state after ``step`` optimizer steps, as `train_policy`'s ``resume`` takes it back.

    Under torchrun the per-row lists (pi_old's log-probs, entropies, kept sets) of every rank are gathered
    to rank 0, which alone writes the state; the others' copy holds none of them.
    """
    model_state, optimizer_state = module_state(model, state.optimizer, dist)

    def every_row(local: list) -> list:
        if dist is None or data.rows is None:
            return local
        parts = dist.dist.gather_to_main(local)
        return [row for part in parts for row in part] if parts is not None else []

    saved = {"step": step, "skipped_steps": state.skipped, "steps": state.steps, "epoch": epoch,
             "stopped": state.stopped, "order": torch.as_tensor(order), "model": model_state,
             "optimizer": optimizer_state, "old_logprobs": [torch.as_tensor(x) for x in every_row(state.old)],
             "old_entropy": [torch.as_tensor(x) for x in every_row(state.old_entropy)], "rng": torch.get_rng_state()}
    if data.kept is not None:
        saved["old_logprobs_full"] = [torch.as_tensor(x) for x in every_row(data.old_logprobs_full)]
        saved["kept"] = kept_to_state(every_row(data.kept))
    if critic is not None:
        saved.update(zip(("critic", "critic_optimizer"), module_state(critic, state.critic_optimizer, dist)))
    return saved


def save_due(cfg: TrainConfig, *, step: int, last_save: float, stopped: bool, dist) -> bool:
    """Whether to save after ``step`` (0-based): by step count, by time, or because the loop stops early.

    Under torchrun every rank must take part in gathering the state, so rank 0's clock decides for all.
    """
    by_steps = bool(cfg.checkpoint_every_steps) and (step + 1) % cfg.checkpoint_every_steps == 0
    by_time = bool(cfg.checkpoint_every_s) and time.monotonic() - last_save >= cfg.checkpoint_every_s
    if dist is not None and cfg.checkpoint_every_s:
        by_time = dist.dist.gather(by_time)[0]
    return by_steps or by_time or (stopped and bool(cfg.checkpoint_every_steps or cfg.checkpoint_every_s))


def frozen_keys(module) -> set[str]:
    """State-dict keys of the parameters that do not train (a LoRA run's base weights): left out of resume
    states. By identity, so that a tied weight's second name (lm_head.weight) goes too."""
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    return {key for key, value in module.state_dict(keep_vars=True).items() if id(value) in frozen}


def kept_to_state(kept) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Kept sets as (ids, sizes) int32 tensors per sequence: a resume state holds tensors only."""
    return [(torch.from_numpy(np.concatenate(row) if row else np.zeros(0, np.int32)),
             torch.tensor([len(ids) for ids in row], dtype=torch.int32)) for row in kept]


def kept_from_state(state) -> list[list[np.ndarray]]:
    """The kept sets back from `kept_to_state`'s tensors: per sequence, per token, the kept token ids."""
    out = []
    for ids, sizes in state:
        bounds = np.concatenate([[0], np.cumsum(sizes.numpy())])
        out.append([ids.numpy()[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
    return out


def module_state(module, optimizer, dist) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's trainable weights and its optimizer's state, gathered to full tensors under torchrun."""
    if dist is None:
        frozen = frozen_keys(module)
        return {k: v for k, v in module.state_dict().items() if k not in frozen}, optimizer.state_dict()
    return dist.state(module, optimizer)


def load_module_state(module, optimizer, weights, optimizer_state, dist) -> None:
    """Put a saved model's trainable weights and its optimizer's state back (sharded again under torchrun)."""
    if dist is None:
        missing, unexpected = module.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - frozen_keys(module):
            raise TrainingError(f"the resume state does not fit the model: unexpected {unexpected[:5]}, "
                                f"missing {sorted(set(missing) - frozen_keys(module))[:5]}")
        optimizer.load_state_dict(optimizer_state)
    else:
        dist.load_state(module, optimizer, weights, optimizer_state)
