"""What an iteration commit holds, and whether the workspace may be recorded as an iteration at all.

An iteration must restore in a fresh clone (``git checkout iteration-k && dvc pull``), so its
commit holds everything that defined it: dvc.yaml, params.yaml, dvc.lock, .dvc/config (the remote a
clone pulls from; secrets belong in .dvc/config.local, which git ignores), and every input a stage
read that no stage wrote — in git (stage scripts, reward modules, code) or, when DVC tracks it
(``dvc add``: the model, prompt files), its ``.dvc`` pointer — plus the ``.gitignore`` files DVC
keeps beside its outputs. An input that is in neither (git-ignored and not DVC-tracked) cannot be
restored: `iteration_files` names it and ``rlpipe iterate`` refuses.

`applied_experiment`: after ``dvc exp run`` or ``dvc exp apply`` the workspace holds an experiment's
params and results; recording that as the iteration must be asked for (``rlpipe iterate --allow-experiment``).
"""
from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

import yaml

PIPELINE_FILES = ("dvc.yaml", "params.yaml", "dvc.lock", ".dvcignore", ".gitignore", ".dvc/config")  # config: the remote a clone pulls from
EXEC_APPLY = "refs/exps/exec/EXEC_APPLY"  # DVC 3's ref to the experiment `dvc exp apply` put in the workspace


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def _inside(path: str, parents: set[str]) -> bool:
    parts = PurePosixPath(path).parts
    return any(PurePosixPath(*parts[:i]).as_posix() in parents for i in range(1, len(parts) + 1))


def _dvc_pointer(root: Path, path: str) -> str | None:
    """The ``.dvc`` file that tracks ``path`` (itself or a parent directory), if any."""
    parts = PurePosixPath(path).parts
    for i in range(len(parts), 0, -1):
        pointer = PurePosixPath(*parts[:i]).as_posix() + ".dvc"
        if (root / pointer).is_file():
            return pointer
    return None


def iteration_files(root: Path, lock_file: str = "dvc.lock") -> tuple[list[str], list[str]]:
    """(files to commit with the iteration, stage inputs that can be neither committed nor restored)."""
    lock = yaml.safe_load((root / lock_file).read_text()) or {}
    stages = lock.get("stages") or {}
    outs = {o["path"] for s in stages.values() for o in s.get("outs") or []}
    deps = sorted({d["path"] for s in stages.values() for d in s.get("deps") or []})
    commit = [f for f in PIPELINE_FILES if (root / f).exists()]
    inputs = [d for d in deps if not (PurePosixPath(d).is_absolute() or ".." in PurePosixPath(d).parts
                                      or _inside(d, outs))]  # outside the project, or written by a stage: skipped
    pointers = {d: _dvc_pointer(root, d) for d in inputs}
    in_git = [d for d in inputs if pointers[d] is None]
    ignored = set(subprocess.run(["git", "check-ignore", "--stdin"], cwd=root, input="\n".join(in_git),
                                 capture_output=True, text=True).stdout.splitlines()) if in_git else set()
    lost = [d for d in in_git if d in ignored]
    commit += [p for p in pointers.values() if p is not None]
    commit += [d for d in in_git if d not in ignored and (root / d).exists()]
    others = _git(root, "ls-files", "--others", "--modified", "--exclude-standard").stdout.splitlines()
    commit += [f for f in others if PurePosixPath(f).name == ".gitignore"]  # DVC's, beside each output
    return sorted(set(commit)), lost


def applied_experiment(root: Path, params_file: str = "params.yaml") -> str | None:
    """The experiment whose params the workspace holds (after ``dvc exp run`` or ``dvc exp apply``), when
    HEAD's differ; None otherwise.

    Candidates: the experiment ``dvc exp apply`` last applied, and every experiment branched from HEAD
    (``refs/exps/<HEAD[:2]>/<HEAD[2:]>/<name>``; ``dvc exp run`` leaves its results in the workspace).
    An experiment whose params equal HEAD's (a saved baseline) is never one.
    """
    mine = (root / params_file).read_text() if (root / params_file).is_file() else None
    head_sha = _git(root, "rev-parse", "-q", "--verify", "HEAD").stdout.strip()
    head = _git(root, "show", f"HEAD:{params_file}")
    if mine is None or (head.returncode == 0 and head.stdout == mine):
        return None
    listed = _git(root, "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps").stdout.splitlines()
    refs = [line.split(" ", 1) for line in listed if " " in line]
    applied = _git(root, "rev-parse", "-q", "--verify", EXEC_APPLY).stdout.strip()
    branched = f"refs/exps/{head_sha[:2]}/{head_sha[2:]}/" if head_sha else None
    candidates = ([applied] if applied else []) + [sha for sha, ref in refs if branched and ref.startswith(branched)]
    for sha in candidates:
        theirs = _git(root, "show", f"{sha}:{params_file}")
        if theirs.returncode == 0 and theirs.stdout == mine:
            names = [ref.rsplit("/", 1)[-1] for other, ref in refs if other == sha and ref != EXEC_APPLY]
            return names[0] if names else sha[:7]
    return None
