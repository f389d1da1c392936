"""Where a report's rows come from: a project directory or a git revision of it, and the run's metadata.

A side of `rlpipe diff` and the target of `rlpipe inspect --rev` can be a git revision: a tag such
as ``iteration-3`` (or just ``3``), a branch, a commit. Its params.yaml comes from git (``git show
REV:path``; `rlpipe iterate` commits it) and its artifacts and stage metrics, DVC outputs, through
``dvc.api.read(path, rev=REV)``, which reads the local DVC cache (or a remote) without touching
the workspace. params.yaml is read leniently (plain YAML, not rlpipe.config's strict loader): a
report also reads older runs, whose params may predate a key.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from rlpipe.data.io import Artifact, read_artifact
from rlpipe.data.schema import ArtifactSchema
from rlpipe.errors import ArtifactError


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def is_revision(repo: Path, rev: str) -> bool:
    return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0


def resolve_revision(repo: Path, spec: str, *, or_directory: bool = True) -> str:
    """The git revision ``spec`` names in ``repo`` (``3`` is short for ``iteration-3``), or an error saying why not.

    ``or_directory``: ``spec`` could also have been a directory (a diff side), and the error says so.
    """
    label = f"{spec!r}: not a directory, and" if or_directory else f"--rev {spec}:"
    if git(repo, "rev-parse", "--git-dir").returncode != 0:
        raise ArtifactError(f"{label} {repo} is not a git repository to look it up in")
    for rev in ([f"iteration-{spec}", spec] if spec.isdigit() else [spec]):
        if is_revision(repo, rev):
            return rev
    tags = git(repo, "tag", "--list", "iteration-*").stdout.split()
    what = "neither a directory nor a git revision" if or_directory else "not a git revision"
    raise ArtifactError(f"{spec!r}: {what} of {repo}"
                        + (f"; iteration tags: {', '.join(tags)}" if tags else "; no iteration-* tags yet"))


def parse_params(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ArtifactError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: not a mapping of params")
    return data


def read_params(root: Path, rev: str | None = None) -> dict[str, Any]:
    """params.yaml of a project directory, or as committed at ``rev``."""
    if rev is None:
        pfile = root / "params.yaml"
        if not pfile.is_file():
            raise ArtifactError(f"{root}: no params.yaml here; pass a project directory or one artifact "
                                "(.parquet) file")
        return parse_params(pfile.read_text(), str(pfile))
    shown = git(root, "show", f"{rev}:params.yaml")
    if shown.returncode != 0:
        raise ArtifactError(f"{root}: no params.yaml at revision {rev}")
    return parse_params(shown.stdout, f"params.yaml at {rev}")


def project_paths(params: dict[str, Any]) -> dict[str, Any]:
    """params.yaml's `paths`, plus the policy's path (where a tokenizer is)."""
    paths = dict(params.get("paths") or {})
    paths["policy"] = (params.get("policy") or {}).get("path")
    return paths


def read_artifact_at(repo: Path, rev: str, path: str, schema: ArtifactSchema, *,
                     columns: list[str] | None = None) -> Artifact:
    """An artifact as it was at ``rev``, read through DVC (local cache or remote), validated; path ``REV:path``.

    ``columns``: as for `rlpipe.data.io.read_artifact` (only these and the keys)."""
    import dvc.api

    data = dvc.api.read(path, repo=str(repo), rev=rev, mode="rb")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / Path(path).name
        f.write_bytes(data)
        art = read_artifact(f, schema, columns=columns)
    return Artifact(frame=art.frame, metadata=art.metadata, path=Path(f"{rev}:{path}"))


def stage_metrics_at(repo: Path, rev: str, metrics_dir: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every stage's full metrics file at ``rev`` (``{stage: data}``) and notes on any that could not be read.

    Older iterations committed them to git; since the headline split (rlpipe/stages/headline.py) they are DVC
    outputs, found through that revision's dvc.lock and read through DVC like any artifact."""
    from rlpipe.run.gc import revision_outs

    metrics: dict[str, dict[str, Any]] = {}
    listing = git(repo, "ls-tree", "--name-only", f"{rev}:{metrics_dir}")
    for name in listing.stdout.split() if listing.returncode == 0 else []:
        if name.endswith(".json"):
            metrics[name.removesuffix(".json")] = json.loads(git(repo, "show", f"{rev}:{metrics_dir}/{name}").stdout)
    notes = []
    for out, _ in revision_outs(repo, rev):
        path = Path(out)
        if path.parent != Path(metrics_dir) or path.suffix != ".json" or path.stem in metrics:
            continue
        try:
            import dvc.api

            metrics[path.stem] = json.loads(dvc.api.read(out, repo=str(repo), rev=rev))
        except Exception as e:  # noqa: BLE001 - DVC raises many types (missing cache, no remote, ...)
            notes.append(f"could not read {path} at {rev} through DVC ({dvc_read_problem(e)})")
    return dict(sorted(metrics.items())), notes


def dvc_read_problem(e: Exception) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


# ----------------------------------------------------------------------------------------------
# Run metadata: what a reader of a report needs to know to reproduce or place it
# ----------------------------------------------------------------------------------------------

# (label, dotted params.yaml key) shown in a report's run table, when present.
RUN_PARAMS = (("iteration (params.yaml)", "iteration"), ("advantage.estimator", "advantage.estimator"),
              ("profile", "profile"), ("train.policy_loss", "train.policy_loss"),
              ("train.loss_aggregation", "train.loss_aggregation"), ("seed", "seed"),
              ("policy.path", "policy.path"))


def dotted(params: dict[str, Any], key: str) -> Any:
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def flatten(params: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}`` (lists stay values)."""
    if not isinstance(params, dict):
        return {prefix: params}
    out: dict[str, Any] = {}
    for k, v in params.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def git_state(root: Path, rev: str | None = None) -> dict[str, Any] | None:
    """Commit (12 hex digits), tags on it and, for the workspace, whether tracked files have uncommitted changes."""
    head = git(root, "rev-parse", "--short=12", f"{rev or 'HEAD'}^{{commit}}")
    if head.returncode != 0:
        return None
    commit = head.stdout.strip()
    tags = git(root, "tag", "--points-at", commit).stdout.split()
    state: dict[str, Any] = {"commit": commit, "tags": tags}
    if rev is None:
        state["uncommitted_changes"] = bool(git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip())
    return state


def run_metadata(root: Path | None, params: dict[str, Any] | None, *, rev: str | None = None,
                 base_metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Params that shape the rows, the policy version and sampling of the base table, and the git state."""
    out: dict[str, Any] = {"params": {}, "git": None, "revision": rev}
    if params:
        out["params"] = {key: dotted(params, key) for _, key in RUN_PARAMS if dotted(params, key) is not None}
    meta = base_metadata or {}
    for key in ("policy_version", "sampling", "engine"):
        if meta.get(key) is not None:
            out[key] = meta[key]
    if root is not None:
        out["git"] = git_state(root, rev)
    return out
