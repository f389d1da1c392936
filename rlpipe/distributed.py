"""Several processes on one stage: torchrun detection, the process group, who does which share.

    torchrun --standalone --nproc_per_node 2 stages/train.py ...              (FSDP2: rlpipe.training.distributed)
    torchrun --standalone --nproc_per_node 2 stages/reference_logprob.py ...  (data parallel: rlpipe.stages.reference_logprob)

Without torchrun (or with WORLD_SIZE=1) `start` returns None and every stage takes its
single-process path, unchanged: nothing here runs then.

Data-parallel work (reference_logprob) is dealt round-robin: item i goes to rank i % world_size
(`share`), and `in_order` puts the ranks' results back in item order. Training ranks instead own
contiguous blocks of rows and read only those (`rlpipe.training.share`).
Only rank 0 writes outputs. Kept free of polars: the GPU image runs the training path without it.
"""
from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from rlpipe.errors import ConfigError

T = TypeVar("T")



def contiguous_blocks(count: int, parts: int) -> list[tuple[int, int]]:
    """range(count) as ``parts`` contiguous [start, stop) blocks whose sizes differ by at most one (larger first).

    One rule for every split by position: training ranks' rows, generating ranks' prompts, vLLM replicas'
    requests. Contiguous blocks keep each part's output in order, so concatenating them is the whole.
    """
    base, extra = divmod(count, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(starts))

@dataclass(frozen=True)
class Dist:
    """This process's place in a torchrun launch (the process group is initialised by `start`)."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T | None]:
        """This rank's items (i % world_size == rank), padded with None to the largest share.

        Why the padding: a rank that runs one forward fewer than the others would leave FSDP's
        collectives waiting; the caller runs a dummy pass for each None.
        """
        mine: list[T | None] = list(items[self.rank::self.world_size])
        return mine + [None] * (math.ceil(len(items) / self.world_size) - len(mine))

    def in_order(self, mine: list[Any]) -> list[Any]:
        """Every rank's results of `share(items)` (without the None padding), back in item order."""
        per_rank = self.gather(mine)
        rounds = max(len(results) for results in per_rank)
        return [results[i] for i in range(rounds) for results in per_rank if i < len(results)]

    def gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank (picklable), indexed by rank, on every rank."""
        out: list[Any] = [None] * self.world_size
        torch_dist.all_gather_object(out, obj)
        return out

    def send_to_main(self, obj: Any) -> None:
        """Send ``obj`` (picklable) to rank 0, which takes it with `receive_from` this rank."""
        torch_dist.send_object_list([obj], dst=0)

    def receive_from(self, rank: int) -> Any:
        """On rank 0: the object ``rank`` sends with `send_to_main`."""
        box: list[Any] = [None]
        torch_dist.recv_object_list(box, src=rank)
        return box[0]

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """`obj` of every rank, indexed by rank, on rank 0 only (None elsewhere): what only rank 0 writes
        (a resume state) is never held by every rank."""
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        torch_dist.gather_object(obj, out, dst=0)
        return out


def torchrun_world_size() -> int:
    """WORLD_SIZE as torchrun sets it; 1 when not launched by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start(device: str) -> Dist | None:
    """Join the process group of a torchrun launch (nccl on CUDA, gloo on CPU); None without one.

    Each rank uses GPU LOCAL_RANK, so ``device`` must be "cuda" (or "cpu"), not "cuda:N". Ranks
    other than 0 draw no progress bars (RLPIPE_NO_PROGRESS).
    """
    world_size = torchrun_world_size()
    if world_size <= 1:
        return None
    kind = torch.device(device)
    if kind.index is not None or kind.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} under torchrun: use 'cuda' (each rank takes GPU LOCAL_RANK) or 'cpu'")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if kind.type == "cuda":
        torch.cuda.set_device(local_rank)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if kind.type == "cuda" else "gloo")
    if rank != 0:
        os.environ["RLPIPE_NO_PROGRESS"] = "1"
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank)


def finish(dist: Dist | None) -> None:
    """Leave the process group (a no-op without one)."""
    if dist is not None and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()
