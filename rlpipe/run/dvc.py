"""DVC's repro, status and add through its Python API, with the CLI as the fallback.

Why in-process: each ``dvc`` command costs about a second of Python start-up and imports on the
2-core box before doing anything; `rlpipe run` issues several per iteration (repro, status, add).
The API is the same code the CLI runs (``dvc.repo.Repo``), so locks, the run cache and dvc.lock
behave exactly as with ``dvc repro``.
"""
from __future__ import annotations

import json
import os
import subprocess
from contextlib import chdir, contextmanager
from pathlib import Path
from typing import Any

from rlpipe.errors import RlpipeError

def _api_available() -> bool:
    try:
        import dvc.repo  # noqa: F401
    except ImportError:
        return False
    return True


def _cli(args: list[str], root: Path, *, capture: bool) -> str:
    proc = subprocess.run(["dvc", *args], cwd=root, capture_output=capture, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip() if capture else ""
        raise RlpipeError(f"`dvc {' '.join(args)}` failed (exit {proc.returncode})" + (f": {detail}" if detail else ""))
    return proc.stdout or ""


@contextmanager
def _lockfile_read_by_the_c_loader():
    """While DVC updates dvc.lock after each stage, let it read the file with its fast (C) YAML loader.

    Why: DVC re-reads the whole lock with ruamel's pure-Python round-trip parser (to keep comments)
    before writing each stage's entry: ~0.15-0.35 s a stage on the 2-core box, for a file DVC writes
    itself and that carries no comments. The file DVC writes is byte-identical either way
    (tests/e2e/test_warm_servers.py checks it). Only dvc.lock files are affected; without the C
    loader (ruamel.yaml.clib) or with another DVC whose internals differ, nothing is changed.
    """
    try:
        from dvc.utils.serialize import _yaml
        from ruamel.yaml import CSafeLoader  # noqa: F401  (present only with ruamel.yaml.clib)
    except ImportError:
        yield
        return
    original = getattr(_yaml, "parse_yaml_for_update", None)
    if original is None or not hasattr(_yaml, "parse_yaml"):
        yield
        return

    def parse(text, path):
        if os.path.basename(str(path)) == "dvc.lock":
            return _yaml.parse_yaml(text, path)
        return original(text, path)

    _yaml.parse_yaml_for_update = parse
    try:
        yield
    finally:
        _yaml.parse_yaml_for_update = original


@contextmanager
def _lockfile_written_atomically():
    """While DVC writes dvc.lock, write it to a temporary file beside it and rename that over it.

    Why: DVC truncates dvc.lock and then writes the new YAML into it, so a run killed at that moment
    (kill -9, a lost machine) leaves a half file that no later `dvc repro` can read. Renamed into
    place, the file is always either the old lock or the new one. Other files DVC writes are unchanged.
    """
    try:
        from dvc.utils.serialize import _common
    except ImportError:
        yield
        return
    original = getattr(_common, "_dump_data", None)
    if original is None:
        yield
        return

    def dump(path, data, dumper, fs=None, **dumper_args):
        if os.path.basename(os.fspath(path)) != "dvc.lock":
            return original(path, data, dumper, fs=fs, **dumper_args)
        scratch = os.path.join(os.path.dirname(os.fspath(path)), ".rlpipe")  # git-ignored; same file system
        os.makedirs(scratch, exist_ok=True)
        tmp = os.path.join(scratch, "dvc.lock.tmp")
        with open(tmp, "w+", encoding="utf-8") as fd:
            dumper(data, fd, **dumper_args)
        os.replace(tmp, path)

    _common._dump_data = dump
    try:
        yield
    finally:
        _common._dump_data = original


def repro(root: str | os.PathLike, targets: list[str] | None = None) -> list[str]:
    """``dvc repro [targets]``; returns the names of the stages that ran (or were restored from the run cache)."""
    root = Path(root).resolve()
    if not _api_available():
        _cli(["repro", *(targets or [])], root, capture=False)
        return []
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    with chdir(root), _lockfile_read_by_the_c_loader(), _lockfile_written_atomically():  # cwd: DVC resolves stage dirs
        try:
            with Repo(str(root)) as repo:
                stages = repo.reproduce(targets or None)
        except DvcException as e:
            raise RlpipeError(f"`dvc repro` failed: {with_causes(e)}") from None
    return [s.addressing for s in stages]


def with_causes(e: BaseException) -> str:
    """An exception's message followed by its causes', as the dvc command prints them: DVC raises
    "failed to reproduce 'x'" from the error that says why."""
    parts: list[str] = []
    while e is not None and len(parts) < 5:
        text = str(e) or type(e).__name__
        if text not in parts:
            parts.append(text)
        e = e.__cause__ or e.__context__
    return ": ".join(parts)


def status(root: str | os.PathLike) -> dict[str, Any]:
    """``dvc status --json`` as a dict (empty when every stage is up to date)."""
    root = Path(root).resolve()
    if not _api_available():
        out = _cli(["status", "--json"], root, capture=True).strip()
        return json.loads(out) if out else {}
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    with chdir(root):  # DVC resolves stage working directories against the cwd
        try:
            with Repo(str(root)) as repo:
                return dict(repo.status())
        except DvcException as e:
            raise RlpipeError(f"`dvc status` failed: {e}") from None


def add(root: str | os.PathLike, path: str) -> None:
    """``dvc add path`` (track a directory such as state/policy in the DVC cache, with a .dvc file for git)."""
    root = Path(root).resolve()
    if not _api_available():
        _cli(["add", path], root, capture=True)
        return
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    with chdir(root):  # DVC resolves stage working directories against the cwd
        try:
            with Repo(str(root)) as repo:
                repo.add(path)
        except DvcException as e:
            raise RlpipeError(f"`dvc add {path}` failed: {e}") from None
