"""No shared disk (`cluster.data: remote`): a stage's inputs and outputs travel by hash through the DVC remote.

On the driver, before a stage runs (`RemoteData.job_for`): every dep DVC tracks (another stage's output, a
``.dvc`` file's data, e.g. ``state/policy``) is pushed to the remote if missing there, and named in the job
by its hash; every other dep (the stage script, the code modules dvc.yaml lists, params.yaml) travels in
the job as bytes: small, and exactly what DVC hashed. On the node (`materialise`): a private working
directory under ``$RLPIPE_CLUSTER_WORKDIR/<node id>/`` (default: the temp dir) with its own DVC cache,
the deps pulled into it by hash and copied into place; then the command runs there. After it
(`publish`): the cached outs are added to the node's cache and pushed, and their hashes, plus the bytes of
the small uncached ones (headline metrics, plots), go back to the driver. The driver (`RemoteData.adopt`)
pulls those hashes into its own cache and puts the files where DVC expects them, so DVC hashes and records
the outputs as if the command had run there: dvc.lock and the run cache stay the driver's alone, and no
git or lock file is ever written on a node.

DVC is imported inside the functions: this module runs on nodes too.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from contextlib import chdir
from pathlib import Path
from typing import Any

from rlpipe.errors import RlpipeError

ENV_WORKDIR = "RLPIPE_CLUSTER_WORKDIR"  # on a node: where the private working dirs and the node's DVC cache live
_SKIPPED = ("__pycache__",)


class RemoteData:
    """The driver's side of `cluster.data: remote` for one project."""

    def __init__(self, root: Path, remote: str | None) -> None:
        self.root = Path(root)
        self.remote = remote

    def _remote_config(self, repo: Any) -> tuple[str, dict]:
        name = self.remote or repo.config["core"].get("remote")
        remotes = repo.config.get("remote", {})
        if not name or name not in remotes:
            raise RlpipeError(f"cluster.data: remote needs a DVC remote ({'cluster.remote: ' + name if name else 'no default remote'}"
                              f" is not one of {sorted(remotes)}): `dvc remote add -d NAME s3://bucket/path`")
        return name, {k: v for k, v in dict(remotes[name]).items()}

    def job_for(self, stage: Any) -> dict[str, Any]:
        """What a node needs to run ``stage`` without the project: deps by hash (pushed now) or by bytes."""
        repo = stage.repo
        name, config = self._remote_config(repo)
        tracked = {os.fspath(out.fs_path) for out in repo.index.outs}
        by_hash, files = [], {}
        for dep in stage.deps:
            path = os.fspath(dep.fs_path)
            rel = os.path.relpath(path, repo.root_dir)
            if path in tracked and dep.hash_info and dep.hash_info.value:
                by_hash.append({"path": rel, "md5": dep.hash_info.value})
            else:
                files.update(_read_tree(Path(repo.root_dir), rel))
        params = self.root / "params.yaml"
        files["params.yaml"] = params.read_bytes()
        if by_hash:
            result = repo.cloud.push(with_dir_entries(repo.cache.local, [d["md5"] for d in by_hash]), remote=name)
            if result.failed:
                raise RlpipeError(f"{stage.name}: could not push {len(result.failed)} input object(s) to the DVC "
                                  f"remote {name!r}")
        outs = [{"path": os.path.relpath(os.fspath(o.fs_path), repo.root_dir), "cache": bool(o.use_cache)}
                for o in stage.outs]
        return {"stage": stage.name, "remote": name, "remote_config": config, "deps": by_hash, "files": files,
                "outs": outs}

    def adopt(self, stage: Any, outs: dict[str, Any]) -> None:
        """Put the outputs the node pushed where DVC expects them (from the remote, by hash, via this cache)."""
        repo = stage.repo
        name, _ = self._remote_config(repo)
        hashes = outs.get("hashes", {})
        failed = pull(repo, list(hashes.values()), name)
        if failed:
            raise RlpipeError(f"{stage.name}: could not pull {failed} output object(s) from the DVC remote {name!r}")
        cache = repo.cache.local
        for rel, md5 in hashes.items():
            check_out(cache, md5, Path(repo.root_dir) / rel)
        for rel, data in outs.get("files", {}).items():
            _write(Path(repo.root_dir) / rel, data)


def with_dir_entries(cache: Any, md5s: list[str]) -> list[Any]:
    """HashInfos of ``md5s`` and of every file of each ``.dir`` among them (read from ``cache``): DVC's
    transfer moves a directory's files only when they are named beside its ``.dir`` object."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.tree import Tree

    found = []
    for md5 in md5s:
        info = HashInfo("md5", md5)
        found.append(info)
        if info.isdir:
            found.extend(oid for _, _, oid in Tree.load(cache, info))
    return found


def pull(repo: Any, md5s: list[str], remote: str) -> int:
    """Fetch ``md5s`` (files and whole ``.dir`` trees) from ``remote`` into ``repo``'s cache; the number of
    objects that failed. Two steps: a directory's file list must be here before its files can be named."""
    from dvc_data.hashfile.hash_info import HashInfo

    dirs = [HashInfo("md5", m) for m in md5s if m.endswith(".dir")]
    failed = len(repo.cloud.pull(dirs, remote=remote).failed) if dirs else 0
    if failed:
        return failed
    return len(repo.cloud.pull(with_dir_entries(repo.cache.local, md5s), remote=remote).failed)


def _read_tree(root: Path, rel: str) -> dict[str, bytes]:
    """A file's bytes, or a directory's files' bytes, by path relative to ``root`` (caches of Python left out)."""
    top = root / rel
    if top.is_file():
        return {rel: top.read_bytes()}
    found = {}
    for path in sorted(top.rglob("*")):
        if path.is_file() and not any(part in _SKIPPED for part in path.parts) and path.suffix != ".pyc":
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def check_out(cache: Any, md5: str, dest: Path) -> None:
    """The file (or ``.dir`` tree) ``md5`` from DVC cache ``cache`` at ``dest``, each file written atomically."""
    if dest.is_dir():
        shutil.rmtree(dest)
    elif dest.exists():
        dest.unlink()
    if md5.endswith(".dir"):
        entries = json.loads(Path(cache.oid_to_path(md5)).read_text())
        for entry in entries:
            _write(dest / entry["relpath"], Path(cache.oid_to_path(entry["md5"])).read_bytes())
        dest.mkdir(parents=True, exist_ok=True)
    else:
        _write(dest, Path(cache.oid_to_path(md5)).read_bytes())


def node_dir() -> Path:
    """This node's directory for working dirs and its DVC cache (one per Ray node, also on one machine)."""
    import ray

    base = Path(os.environ.get(ENV_WORKDIR) or Path(tempfile.gettempdir()) / "rlpipe-cluster")
    return base / ray.get_runtime_context().get_node_id()[:16]


def _node_repo(workspace: Path, job: dict[str, Any]):
    """A DVC repo without git in ``workspace``, using the node's cache and the driver's remote."""
    from dvc.repo import Repo

    if (workspace / ".dvc").is_dir():  # made by `materialise`, used again by `publish`
        return Repo(os.fspath(workspace))
    Repo.init(os.fspath(workspace), no_scm=True).close()
    repo = Repo(os.fspath(workspace))
    with repo.config.edit("repo") as conf:
        conf["remote"][job["remote"]] = job["remote_config"]
        conf["core"]["remote"] = job["remote"]
        conf["core"]["analytics"] = False
        conf["cache"]["dir"] = os.fspath(node_dir() / "cache")
    repo.close()
    return Repo(os.fspath(workspace))


def materialise(job: dict[str, Any], env: dict[str, str]) -> str:
    """On a node: a private working directory holding exactly the stage's deps; returns its path."""
    workspace = node_dir() / "work" / f"{job['stage']}-{uuid.uuid4().hex[:12]}"
    workspace.mkdir(parents=True)
    for rel, data in job["files"].items():
        _write(workspace / rel, data)
    with chdir(workspace), _node_repo(workspace, job) as repo:
        failed = pull(repo, [d["md5"] for d in job["deps"]], job["remote"])
        if failed:
            raise RlpipeError(f"{failed} object(s) missing on the remote {job['remote']!r}")
        for dep in job["deps"]:
            check_out(repo.cache.local, dep["md5"], workspace / dep["path"])
    return os.fspath(workspace)


def publish(job: dict[str, Any], workspace: str, env: dict[str, str]) -> dict[str, Any]:
    """On a node, after the command: push the cached outs, return their hashes and the uncached outs' bytes;
    the working directory is removed (the node's cache keeps the objects for its next stages)."""
    ws = Path(workspace)
    cached = [o["path"] for o in job["outs"] if o["cache"]]
    files = {o["path"]: (ws / o["path"]).read_bytes() for o in job["outs"] if not o["cache"]}
    with chdir(ws), _node_repo(ws, job) as repo:
        hashes = {}
        if cached:
            for stage in repo.add(cached):
                for out in stage.outs:
                    hashes[os.path.relpath(os.fspath(out.fs_path), ws)] = out.hash_info.value
            repo.push(remote=job["remote"])
    shutil.rmtree(ws, ignore_errors=True)
    return {"hashes": hashes, "files": files}
