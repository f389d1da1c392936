"""FSDP2 (`fully_shard`) training under torchrun: the sharding, the forward FSDP sees, what crosses ranks.

    torchrun --standalone --nproc_per_node 2 stages/train.py ...   (the arguments of `python stages/train.py`)

`train_policy(..., dist=ShardedTraining)` runs the loop of one process on every rank, with these
differences (``dist=None`` is the single-process path, untouched):
- every rank holds only its own rows (`rlpipe.training.share`) and draws one process's shuffles and
  minibatches over all rows; of each minibatch it trains its own rows, cut into micro-batches as one
  process cuts. The normalisers are the whole step's token/sequence counts (scope minibatch: from the
  per-row numbers every rank knows) or each micro-batch's own counts and 1/k, k the step's micro-batch
  count over all ranks (scope micro_batch). FSDP then SUMS the gradients over ranks (divide factor 1:
  the losses are already normalised globally), so with scope minibatch a step's gradient is one
  process's up to the order of float additions, whatever the number of ranks;
- a rank with fewer micro-batches than another runs zero-weighted passes, so that FSDP's
  all-gathers and reduce-scatters stay in step;
- step metrics: every micro-batch's loss and health stats are gathered and combined rank by rank;
  skip / early-stop decisions are therefore the same on every rank;
- log-probs before and after training: each rank's own rows, in packed token-budget batches of them;
- state dicts (checkpoint, resume state): gathered full and unsharded to rank 0's CPU memory.

Why a wrapper as the FSDP root. FSDP2 gathers the parameters that belong to no sharded
submodule (embeddings, final norm, LM head) in a pre-forward hook of the module given to
`fully_shard`, and reduce-scatters their gradients after that module's backward.
`rlpipe.engines.logprobs.completion_logprobs` runs the body through the causal LM's own forward
but applies its chunked LM head afterwards, outside that forward. Here the root is
`PolicyForward`, a module whose forward IS the whole log-prob computation (body + chunked head),
so `fully_shard(each decoder layer)` + `fully_shard(PolicyForward(model))` brackets every use of
every parameter with FSDP's hooks. Tied embeddings are one parameter in the root's group,
unsharded for the whole forward and backward (FSDP2 leaves the root unsharded after its forward).
The PPO critic (`rlpipe.models.value_model.ScalarHeadModel`) needs no wrapper: its forward already runs
body and head.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlpipe.distributed import Dist
from rlpipe.engines.logprobs import completion_logprobs, make_packed_batch, token_budget_batches, unpad
from rlpipe.engines.truncation import batch_kept_sets, completion_logprobs_truncated

FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # others get an empty dict


class PolicyForward(torch.nn.Module):
    """The FSDP2 root over a causal LM: forward = `completion_logprobs` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch, *, temperature: float, chunk_size: int, with_entropy: bool, kept=None,
                truncation: tuple[int, float] | None = None):
        """`completion_logprobs`; with ``kept``, `completion_logprobs_truncated`; with ``truncation`` (top_k,
        top_p), `batch_kept_sets` (the keep sampling mask, rlpipe.engines.truncation)."""
        if truncation is not None:
            return batch_kept_sets(self.model, batch, temperature=temperature, top_k=truncation[0],
                                   top_p=truncation[1], chunk_size=chunk_size)
        if kept is not None:
            return completion_logprobs_truncated(self.model, batch, kept, temperature=temperature,
                                                 chunk_size=chunk_size, with_entropy=with_entropy)
        return completion_logprobs(self.model, batch, temperature=temperature, chunk_size=chunk_size,
                                   with_entropy=with_entropy)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no transformers decoder layers to shard")
    return layers


def _mesh(model: torch.nn.Module, dist: Dist):
    """The 1-D device mesh of all ranks, on the device type the weights live on.

    Why explicit: without a mesh fully_shard builds one on CUDA whenever CUDA is available, so CPU
    (gloo) ranks on a GPU host would start an NCCL group on one shared GPU and hang.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(next(model.parameters()).device.type, (dist.world_size,))


def _shard(root: torch.nn.Module, body: torch.nn.Module, mesh) -> None:
    """fully_shard each decoder layer of ``body``, then ``root``; gradients summed over ranks, not averaged."""
    for layer in _decoder_layers(body):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # a plain SUM: gloo has no PREMUL_SUM
                module.set_force_sum_reduction_for_comms(True)


@dataclass
class ShardedTraining:
    """The `dist` of `train_policy`: the sharded policy (and critic) and the collectives the loop needs."""

    dist: Dist
    policy: torch.nn.Module  # the causal LM, sharded in place
    root: PolicyForward
    critic: torch.nn.Module | None = None  # its own FSDP root

    def share(self, items: Sequence[Any]) -> list[Any]:
        return self.dist.share(items)

    def completion_logprobs(self, model, batch, *, temperature: float, chunk_size: int, with_entropy: bool):
        """`rlpipe.engines.logprobs.completion_logprobs` of the sharded policy, run through its FSDP root."""
        if model is not self.policy:
            raise ValueError("ShardedTraining computes the log-probs of the policy it sharded, no other model")
        return self.root(batch, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)

    def share_logprobs(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                       temperature: float, max_tokens_per_batch: int, chunk_size: int, with_entropy: bool
                       ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """No-grad log-probs (and entropies) of this rank's sequences (its `RowShare`), in their order: the
        packed token-budget batches `batched_completion_logprobs` makes of them."""
        out = self._over_batches(prompts, completions, max_tokens_per_batch, lambda batch, pick: self.root(
            batch, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy))
        logprobs, entropies = out if out else ([], [])  # no sequences: no batches
        return logprobs, (entropies if with_entropy else None)

    def completion_logprobs_truncated(self, model, batch, kept, *, temperature: float, chunk_size: int,
                                      with_entropy: bool):
        """`rlpipe.engines.truncation.completion_logprobs_truncated` of the sharded policy, through its FSDP root."""
        if model is not self.policy:
            raise ValueError("ShardedTraining computes the log-probs of the policy it sharded, no other model")
        return self.root(batch, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, kept=kept)

    def share_kept_sets(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                        temperature: float, top_k: int, top_p: float, max_tokens_per_batch: int, chunk_size: int
                        ) -> tuple[list[np.ndarray], list, list[np.ndarray], list[np.ndarray]]:
        """`rlpipe.engines.truncation.batched_kept_sets` of this rank's sequences."""
        out = self._over_batches(prompts, completions, max_tokens_per_batch, lambda batch, pick: self.root(
            batch, temperature=temperature, chunk_size=chunk_size, with_entropy=True, truncation=(top_k, top_p)))
        truncated, full, entropy, kept = out  # batch_kept_sets' order
        return truncated, kept, full, entropy

    def share_truncated_logprobs(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                                 kept: list, *, temperature: float, max_tokens_per_batch: int,
                                 chunk_size: int) -> list[np.ndarray]:
        """`rlpipe.engines.truncation.batched_truncated_logprobs` of this rank's sequences."""
        out = self._over_batches(prompts, completions, max_tokens_per_batch, lambda batch, pick: self.root(
            batch, temperature=temperature, chunk_size=chunk_size, with_entropy=False, kept=[kept[i] for i in pick]))
        return out[2]

    def _over_batches(self, prompts, completions, max_tokens_per_batch: int, forward) -> list[list[Any]]:
        """Run ``forward(batch, rows)`` (no grad) on packed token-budget batches of this rank's sequences and
        return every output per sequence, in input order: [B, C] grids are unpadded, lists of rows (kept sets)
        taken as they are, None stays None. One list per output of ``forward``.

        A rank with fewer batches than another runs dummy passes on its shortest sequence, so that FSDP's
        all-gathers stay in step (the count is agreed on with one small gather)."""
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        batches = token_budget_batches(lengths, max_tokens_per_batch, packed=True)
        rounds = max(self.dist.gather(len(batches)))
        shortest = [int(np.argmin(lengths))] if lengths else []
        per_output: list[list[Any]] = []
        with torch.no_grad():
            for k in range(rounds):
                rows = batches[k] if k < len(batches) else None
                pick = rows if rows is not None else shortest
                batch = make_packed_batch([prompts[i] for i in pick], [completions[i] for i in pick])
                outputs = forward(batch, pick)
                if rows is None:
                    continue
                for j, values in enumerate(outputs):
                    if len(per_output) <= j:
                        per_output.append([None] * len(prompts))
                    values = (unpad(values, batch.completion_lengths) if isinstance(values, torch.Tensor)
                              else [None] * len(rows) if values is None else values)
                    for i, value in zip(rows, values):
                        per_output[j][i] = value
        return per_output

    def concat(self, mine: list[Any]) -> list[Any]:
        """Every rank's list, concatenated in rank order, on every rank."""
        return [item for part in self.dist.gather(mine) for item in part]

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
        """`torch.nn.utils.clip_grad_norm_` over sharded gradients: the norm of the full gradient, on every rank."""
        params = [p for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):  # each rank holds a partial norm of its shards
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Full model (and optimizer) state dicts on rank 0, on the CPU; empty on other ranks. A collective.

        The optimizer's is keyed by parameter name (DCP's format), not by position as one process's is.
        """
        for root in (self.root, self.critic):
            if root is not None:
                root.reshard()  # after a no-grad forward the root holds unsharded parameters
        model_state = get_model_state_dict(module, options=FULL_ON_RANK0)
        if optimizer is None:
            return model_state, None
        return model_state, get_optimizer_state_dict(module, optimizer, options=FULL_ON_RANK0)

    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Load full state dicts (as `state` gathers them, held by every rank) into the sharded module and optimizer."""
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, model_state, options=options)
        set_optimizer_state_dict(module, optimizer, optimizer_state, options=options)


def shard_for_training(model: torch.nn.Module, dist: Dist, critic: torch.nn.Module | None = None) -> ShardedTraining:
    """Shard ``model`` (a causal LM) and ``critic`` (a ScalarHeadModel) in place with FSDP2 over all ranks.

    Enable gradient checkpointing before sharding (it composes with fully_shard on the same layers).
    Weights stay float32; train.dtype bfloat16 runs the forward under autocast, as in one process.
    """
    root = PolicyForward(model)
    mesh = _mesh(model, dist)
    _shard(root, model, mesh)
    if critic is not None:
        _shard(critic, critic, mesh)
    return ShardedTraining(dist=dist, policy=model, root=root, critic=critic)


def gathered_models(sharded, policy_dir: str, critic_dir: str | None, *, seed: int, rebuild=None):
    """Rank 0: plain CPU copies of the trained policy and critic, from full state dicts gathered over
    the ranks (a collective: every rank calls it); other ranks: (None, None).

    ``rebuild``: makes the CPU model the policy's state is loaded into (default: the policy dir's model).
    With train.lora it is the PEFT model, whose inner causal LM takes the state and which train saves.
    """
    policy_state, _ = sharded.state(sharded.policy)
    critic_state = sharded.state(sharded.critic)[0] if sharded.critic is not None else None
    if not sharded.dist.is_main:
        return None, None
    from rlpipe.models.critic import load_critic
    from rlpipe.models.loading import load_model

    model = rebuild() if rebuild is not None else load_model(policy_dir, device="cpu", dtype="float32")
    (model.get_base_model() if hasattr(model, "get_base_model") else model).load_state_dict(policy_state)
    critic_model = None
    if critic_state is not None:
        critic_model = load_critic(critic_dir, seed=seed, device="cpu")
        critic_model.load_state_dict(critic_state)
    return model, critic_model
