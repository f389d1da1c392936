"""The adapter directory: how to recognise one, where its base model is, and whether that base is the right one.

No torch here: `rlpipe iterate`, the run loop and the engine server's client read adapter
directories without loading a model.

An adapter directory holds PEFT's own files (``adapter_config.json``, ``adapter_model.safetensors``)
and ``rlpipe.json`` with ``kind: lora``, ``policy_version``, ``base_model_path`` and
``base_model_hash``. It holds no ``config.json`` and no tokenizer: both are the base's, which every
reader takes from ``base_model_path``. A relative ``base_model_path`` is relative to the project
root, the working directory of every stage and server (it is the path train was given, e.g.
``artifacts/prepare/model``).

Why a content hash: the base is not part of the adapter's bytes, so a base rebuilt with other weights
(prepare re-run with other params, another model copied to the same path) would silently give another
policy. Every load compares the hash and refuses a mismatch, naming the key.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rlpipe.data.io import CHECKPOINT_INFO
from rlpipe.errors import ArtifactError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KIND = "lora"

_HASHES: dict[tuple, str] = {}  # (path, files' names, sizes, mtimes) -> hash: one hash per process and base


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """A PEFT adapter directory (adapter_config.json, no config.json of its own)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def is_policy_dir(path: str | os.PathLike) -> bool:
    """A directory a policy can be loaded from: a Hugging Face model directory or an adapter directory."""
    p = Path(path)
    return (p / "config.json").is_file() or is_adapter_dir(p)


def adapter_info(path: str | os.PathLike) -> dict[str, Any]:
    """``rlpipe.json`` of an adapter directory, checked to name a base model and its hash."""
    f = Path(path) / CHECKPOINT_INFO
    if not f.is_file():
        raise ArtifactError(f"{path}: an adapter directory without {CHECKPOINT_INFO}: rlpipe cannot tell which base "
                            "model it belongs to (rlpipe writes base_model_path and base_model_hash there)")
    info = json.loads(f.read_text())
    for key in ("base_model_path", "base_model_hash"):
        if not isinstance(info.get(key), str):
            raise ArtifactError(f"{f}: {key} is missing; rlpipe needs the base model's path and content hash")
    return info


def adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())


def base_dir(path: str | os.PathLike) -> Path:
    """The base model directory an adapter directory names (not checked against its hash: `checked_base` does)."""
    return Path(adapter_info(path)["base_model_path"])


def model_dir_of(path: str | os.PathLike) -> Path:
    """Where a policy's config.json, tokenizer and generation config live: the base of an adapter, else ``path``."""
    return base_dir(path) if is_adapter_dir(path) else Path(path)


def _model_files(model_dir: Path) -> list[Path]:
    """The files that make a model directory what it is: its top-level files but rlpipe's own record.

    ``master/`` (float32 training weights) is left out: what samples and what LoRA trains over are the
    top-level weights.
    """
    return sorted(f for f in model_dir.iterdir() if f.is_file() and f.name != CHECKPOINT_INFO)


def model_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over a model directory's files (names and bytes, sorted): the base's identity.

    Hashing reads every byte (about a second per GB); the result is kept for the process while the
    files' sizes and mtimes stay the same.
    """
    root = Path(model_dir)
    files = _model_files(root)
    stamp = (str(root.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if stamp not in _HASHES:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            h.update(b"\0")
        _HASHES[stamp] = "sha256:" + h.hexdigest()
    return _HASHES[stamp]


def checked_base(path: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """The base model directory of adapter ``path`` (or ``base`` instead of the recorded one), after checking
    that its content hash is the one the adapter was trained over."""
    info = adapter_info(path)
    where = Path(path) / CHECKPOINT_INFO
    p = Path(base) if base is not None else Path(info["base_model_path"])
    if not (p / "config.json").is_file():
        raise ArtifactError(f"{where}: base_model_path {str(p)!r} is not a model directory (relative paths are "
                            "relative to the project root; rlpipe never downloads models)")
    got = model_hash(p)
    if got != info["base_model_hash"]:
        raise ArtifactError(f"{where}: base_model_hash {info['base_model_hash']} does not match the base model {p} "
                            f"({got}): the adapter was trained over other weights; restore that base (e.g. "
                            "`dvc checkout prepare`) or train the adapter again")
    return p


def adapter_record(*, policy_version: int, base_path: str | os.PathLike, base_hash: str) -> dict[str, Any]:
    """The ``rlpipe.json`` of an adapter checkpoint."""
    return {"kind": KIND, "policy_version": int(policy_version), "base_model_path": str(base_path),
            "base_model_hash": base_hash, "dtype": "float32", "master_weights": False}
