"""Resume state of a killed train stage: where it lives, what keys it, how it is written.

DVC deletes a stage's declared outputs before running it, so the state lives outside them, under
``.rlpipe/resume/train-<key>/`` (ignored by git and DVC). The key hashes the bytes of every input
and every parameter that can change the result, so a state saved for other inputs or params is
never picked up: a changed reward, a new iteration or another learning rate starts from scratch.
The stage removes its state once its outputs are written.

What it costs, and why it is cheap now (BENCHMARKS.md, "fixed cost"): a state holds the float32
weights and both AdamW moments, 12 bytes per parameter (6 GB for a 0.5B model). Writing one took
7-10 s on an H200 host and the stage wrote four per iteration. So:
- states are written every ``train.checkpoint_every_s`` seconds (and/or every
  ``train.checkpoint_every_steps`` steps), not every few steps by default;
- the loop only copies the state to host memory; a background thread writes it (and fsyncs it
  when ``train.checkpoint_fsync``), while the next steps run;
- the key (a hash of gigabytes of inputs) is computed only when a state is written or one exists;
- the state is deleted after the stage in a detached process, not on the stage's clock.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from rlpipe.data.io import atomic_path, remove_path

STATE_FILE = "state.pt"
_TRASH_PREFIX = ".trash-"  # a state being deleted in the background; never matches train-*


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
    """The saved loop state, or None when there is none (a complete state or nothing: writes are atomic).

    A state that cannot be read (a machine that lost power before an un-fsynced write reached the
    disk) is set aside with a warning and the stage starts from scratch.
    """
    f = directory / STATE_FILE
    if not f.is_file():
        return None
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable state means: start over
        print(f"rlpipe train: warning: resume state {f} is unreadable ({type(e).__name__}: {e}); starting over",
              file=sys.stderr)
        discard_later(directory)
        return None


def save_state(directory: Path, state: dict[str, Any], *, fsync: bool = True) -> None:
    with atomic_path(directory) as tmp:
        tmp.mkdir()
        torch.save(state, tmp / STATE_FILE)
        if fsync:
            with open(tmp / STATE_FILE, "rb") as fh:
                os.fsync(fh.fileno())


def clear_state(directory: Path) -> None:
    remove_path(directory)


def discard_later(directory: Path) -> None:
    """Rename a state out of the way (instant) and delete it in a detached process (seconds for gigabytes)."""
    if not directory.exists():
        return
    trash = directory.with_name(f"{_TRASH_PREFIX}{directory.name}-{os.getpid()}")
    os.replace(directory, trash)
    subprocess.Popen(["rm", "-rf", "--", str(trash)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def host_copy(obj: Any) -> Any:
    """A deep copy of a state (dicts, lists, tensors) with every tensor on the CPU, detached from training.

    The writer thread serialises this copy while the loop keeps updating the live tensors.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class ResumeStates:
    """The train stage's resume states: found at start, written in the background, discarded at the end.

    ``key``: computes the resume key (hashing the inputs); called at most once, and only when a
    state is looked up or written.
    """

    def __init__(self, root: str | os.PathLike, key: Callable[[], str], *, fsync: bool, enabled: bool = True) -> None:
        self.root = Path(root)
        self._key_fn = key
        self._key: str | None = None
        self.fsync = fsync
        self.enabled = enabled  # False on every rank but 0 under torchrun: only rank 0 writes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written = 0

    @property
    def directory(self) -> Path:
        if self._key is None:
            self._key = self._key_fn()
        return resume_dir(self.root, self._key)

    def load(self) -> dict[str, Any] | None:
        """The state a killed run of these inputs and params left, or None. Hashes nothing when no state exists."""
        if not any(self.root.glob("train-*")):
            return None
        return load_state(self.directory)

    def save(self, state: dict[str, Any]) -> None:
        """Copy ``state`` to host memory now; write it in the background (waiting for the previous write first)."""
        if not self.enabled:
            return
        self.wait()
        snapshot = host_copy(state)
        self._thread = threading.Thread(target=self._write, args=(snapshot,), name="rlpipe-resume-writer",
                                        daemon=True)
        self._thread.start()

    def _write(self, snapshot: dict[str, Any]) -> None:
        try:
            save_state(self.directory, snapshot, fsync=self.fsync)
            self.written += 1
        except BaseException as e:  # noqa: BLE001 - re-raised in the stage's thread by wait()
            self._error = e

    def wait(self) -> None:
        """Wait for the write in flight; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def discard(self) -> None:
        """After the outputs are written: wait for any write, then delete the state in the background."""
        self.wait()
        if self._key is not None:  # None: no state was looked up (none existed) or written
            discard_later(self.directory)
