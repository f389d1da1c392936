"""The recent policy versions an overlapped run samples from, kept under ``.rlpipe/policies/<version>/``.

With ``policy.max_staleness`` S > 0, iteration k samples with policy version ``sampler_version(k, S)``
while the trainer starts from version k. That older version is no longer in ``state/policy``, so each
hand-over keeps a copy (hard links: free) of the versions a coming iteration may still sample from,
and ``rlpipe iterate`` turns the one iteration k+1 needs into ``state/sampler`` (DVC-tracked, so the
committed iteration restores with ``dvc checkout`` like every other input).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlpipe.data.io import atomic_path, read_policy_version
from rlpipe.errors import RlpipeError
from rlpipe.models.lora.adapter import is_policy_dir

STORE = ".rlpipe/policies"


def sampler_version(iteration: int, max_staleness: int) -> int:
    """The policy version that samples ``iteration``: as old as allowed, never older than version 0.

    Fixed by the iteration and S alone, so a rerun of the same schedule samples with the same
    policies (the schedule is part of what a rerun reproduces, not a race between processes).
    """
    return max(0, iteration - max_staleness)


def link_tree(src: Path, dst: Path) -> None:
    """Replace ``dst`` atomically by a copy of ``src`` made of hard links where the file system allows.

    Safe because no rlpipe step changes a file in place (outputs are replaced by renames, rlpipe.data.io);
    DVC recognises the linked inodes it already hashed.
    """
    with atomic_path(dst) as tmp:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def keep(root: Path, version: int, model_dir: Path) -> None:
    """Keep ``model_dir`` (which must hold ``version``) as that version in the store, unless already there."""
    target = root / STORE / str(version)
    if read_policy_version(target) == version or (version == 0 and is_policy_dir(target)):
        return
    stored = read_policy_version(model_dir)
    if stored is not None and stored != version:
        raise RlpipeError(f"{model_dir}: holds policy version {stored}, not {version}")
    link_tree(model_dir, target)


def path_of(root: Path, version: int) -> Path:
    target = root / STORE / str(version)
    if not is_policy_dir(target):
        raise RlpipeError(f"policy version {version} is not in {root / STORE} (an overlapped run keeps the "
                          f"versions it may still sample from there); restore it from the DVC cache with "
                          f"`git checkout iteration-{version - 1} && dvc checkout train` and copy "
                          f"artifacts/train/checkpoint there, or run with --max-staleness 0")
    return target


def prune(root: Path, *, oldest_needed: int) -> None:
    """Drop stored versions older than ``oldest_needed`` (no coming iteration samples with them)."""
    store = root / STORE
    if not store.is_dir():
        return
    for entry in store.iterdir():
        if entry.name.isdigit() and int(entry.name) < oldest_needed:
            shutil.rmtree(entry)
