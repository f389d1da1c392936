"""Keep disk in check: drop old iterations' checkpoints from the local DVC cache, keep everything else.

Why not plain ``dvc gc``: it keeps or drops whole revisions (``--workspace``, ``--all-tags``), while
an iteration's bulk is its model weights and its lasting value is in its metrics and tables. This
removes from the cache exactly the objects of the checkpoint directories (``paths.checkpoint``,
``state/policy``, ``state/reference``) of the iterations tagged ``iteration-j`` that are older
than the last K, unless any revision that is kept still refers to the same object (a tokenizer
file shared by every checkpoint, the initial model, the current policy and reference). Nothing in
git is touched: every headline metrics file, plot, history row and dvc.lock entry stays, and every
Parquet table, stage metrics file and the prepare outputs of every iteration stay in the cache.

Kept whole: the work tree, HEAD, every local branch and the last K ``iteration-*`` tags.
Only the local cache is pruned; a DVC remote keeps what was pushed (docs/multi-machine.md).
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from rlpipe.config import load_params
from rlpipe.run.repo import STATE_POLICY, STATE_REFERENCE, run_command, tag_name

WORKTREE = None  # a revision argument meaning "the files on disk, committed or not"


@dataclass(frozen=True)
class PruneReport:
    kept_iterations: list[int]
    pruned_iterations: list[int]
    removed_objects: list[str] = field(default_factory=list)  # md5 names, ".dir" for directory manifests
    removed_bytes: int = 0


def iteration_tags(root: Path) -> list[int]:
    """The iterations that have a tag ``iteration-j``, ascending."""
    out = run_command(["git", "tag", "--list", "iteration-*"], root)
    return sorted(int(m.group(1)) for t in out.split() if (m := re.fullmatch(r"iteration-(\d+)", t)))


def cache_dir(root: Path) -> Path:
    return Path(run_command(["dvc", "cache", "dir"], root).strip())


def object_path(cache: Path, md5: str) -> Path:
    return cache / "files" / "md5" / md5[:2] / md5[2:]


def _read(root: Path, rev: str | None, path: str) -> str | None:
    if rev is WORKTREE:
        p = root / path
        return p.read_text() if p.is_file() else None
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def _dvc_files(root: Path, rev: str | None) -> list[str]:
    cmd = (["git", "ls-files", "--cached", "--others", "--exclude-standard"] if rev is WORKTREE
           else ["git", "ls-tree", "-r", "--name-only", rev])
    return [f for f in run_command(cmd, root).splitlines() if f.endswith(".dvc") and not f.startswith(".dvc/")]


def revision_outs(root: Path, rev: str | None) -> list[tuple[str, str]]:
    """(path, md5) of every cached output recorded at ``rev``: dvc.lock's stage outs and the ``*.dvc`` files."""
    outs: list[tuple[str, str]] = []
    lock = yaml.safe_load(_read(root, rev, "dvc.lock") or "") or {}
    for stage in (lock.get("stages") or {}).values():
        outs += [(o["path"], o["md5"]) for o in stage.get("outs", []) if o.get("md5")]
    for dvc_file in _dvc_files(root, rev):
        data = yaml.safe_load(_read(root, rev, dvc_file) or "") or {}
        parent = PurePosixPath(dvc_file).parent
        outs += [(str(parent / o["path"]), o["md5"]) for o in data.get("outs", []) if o.get("md5")]
    return outs


def checkpoint_paths(root: Path, rev: str | None, params_file: str, default: str) -> set[str]:
    """The outputs that hold model weights of an iteration: ``paths.checkpoint`` as named at ``rev``, the state dirs."""
    params = yaml.safe_load(_read(root, rev, params_file) or "") or {}
    checkpoint = (params.get("paths") or {}).get("checkpoint") or default
    return {checkpoint, STATE_POLICY, STATE_REFERENCE}


def objects(cache: Path, md5: str) -> set[str]:
    """The cache objects of one output: the file itself, or a directory's manifest and its files."""
    found = {md5}
    manifest = object_path(cache, md5)
    if md5.endswith(".dir") and manifest.is_file():
        found |= {entry["md5"] for entry in json.loads(manifest.read_text())}
    return found


def prune_checkpoints(root: str | Path = ".", *, keep: int, params_file: str = "params.yaml",
                      dry_run: bool = False) -> PruneReport:
    """Remove from the local DVC cache the checkpoint objects of all but the last ``keep`` tagged iterations."""
    root = Path(root)
    if keep < 1:
        raise ValueError("keep must be >= 1 (0 means: do not prune, so do not call this)")
    current = load_params(root / params_file)  # a broken params file stops here, before anything is removed
    tags = iteration_tags(root)
    kept, old = tags[-keep:], tags[:-keep]
    report = PruneReport(kept_iterations=kept, pruned_iterations=old)
    if not old:
        return report
    cache = cache_dir(root)
    branches = run_command(["git", "for-each-ref", "--format=%(objectname)", "refs/heads"], root).split()
    whole = [WORKTREE, "HEAD", *branches, *(tag_name(j) for j in kept)]
    protected: set[str] = set()
    for rev in whole:
        for _path, md5 in revision_outs(root, rev):
            protected |= objects(cache, md5)
    candidates: set[str] = set()
    for j in old:
        rev = tag_name(j)
        weights = checkpoint_paths(root, rev, params_file, current.paths.checkpoint)
        for path, md5 in revision_outs(root, rev):
            (candidates if path in weights else protected).update(objects(cache, md5))
    # Files first, manifests last: a manifest still on disk lets a re-run find what a killed run left.
    doomed = sorted(candidates - protected, key=lambda h: (h.endswith(".dir"), h))
    removed, size = [], 0
    for md5 in doomed:
        obj = object_path(cache, md5)
        if obj.is_file():
            size += obj.stat().st_size
            if not dry_run:
                obj.unlink()
            removed.append(md5)
    return PruneReport(kept_iterations=kept, pruned_iterations=old, removed_objects=removed, removed_bytes=size)
