"""Resume state of a killed train stage: where it lives, what keys it, how it is written.

DVC deletes a stage's declared outputs before running it, so the state lives outside them, under
``.rlpipe/resume/train-<key>/`` (ignored by git and DVC). The key hashes the bytes of every input
and every parameter that can change the result, so a state saved for other inputs or params is
never picked up: a changed reward, a new iteration or another learning rate starts from scratch.
The stage removes its state once its outputs are written.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from rlpipe.io import _remove, atomic_path

STATE_FILE = "state.pt"


def _hash_path(h: "hashlib._Hash", path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")


def resume_key(inputs: list[str | os.PathLike], params: dict[str, Any]) -> str:
    """sha256 over the inputs' bytes (a directory: its files in sorted order) and the params as sorted JSON."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for path in inputs:
        _hash_path(h, Path(path))
    return h.hexdigest()[:20]


def resume_dir(root: str | os.PathLike, key: str) -> Path:
    return Path(root) / f"train-{key}"


def load_state(directory: Path) -> dict[str, Any] | None:
    """The saved loop state, or None when there is none (a complete state or nothing: writes are atomic)."""
    f = directory / STATE_FILE
    return torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None


def save_state(directory: Path, state: dict[str, Any]) -> None:
    with atomic_path(directory) as tmp:
        tmp.mkdir()
        torch.save(state, tmp / STATE_FILE)
        with open(tmp / STATE_FILE, "rb") as fh:
            os.fsync(fh.fileno())


def clear_state(directory: Path) -> None:
    _remove(directory)
