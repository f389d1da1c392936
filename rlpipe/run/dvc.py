"""DVC's repro, status and add through its Python API, with the CLI as the fallback.

Why in-process: each ``dvc`` command costs about a second of Python start-up and imports on the
2-core box before doing anything; `rlpipe run` issues several per iteration (repro, status, add).
The API is the same code the CLI runs (``dvc.repo.Repo``), so locks, the run cache and dvc.lock
behave exactly as with ``dvc repro``.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
from collections import OrderedDict
from collections.abc import Callable
from contextlib import ExitStack, chdir, contextmanager, nullcontext
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
def _replaced(module_name: str, attribute: str, make: Callable[[Any], Any]):
    """While inside, DVC's ``module_name.attribute`` (a function, or ``Class.method``) is ``make(original)``.

    Why one helper: each shortcut below swaps one DVC internal for the duration of a call and must put
    it back whatever happens. A DVC without the module or attribute (another version), or a ``make``
    that returns None (the original is not what it expects), leaves DVC as it is.
    """
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        yield
        return
    *path, leaf = attribute.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    original = owner.__dict__.get(leaf) if owner is not None else None
    replacement = make(original) if original is not None else None
    if replacement is None:
        yield
        return
    setattr(owner, leaf, replacement)
    try:
        yield
    finally:
        setattr(owner, leaf, original)


def _is_lock(path: Any) -> bool:
    return os.path.basename(os.fspath(path)) == "dvc.lock"


def _lockfile_read_by_the_c_loader():
    """While DVC updates dvc.lock after each stage, let it read the file with its fast (C) YAML loader.

    Why: DVC re-reads the whole lock with ruamel's pure-Python round-trip parser (to keep comments)
    before writing each stage's entry: ~0.15-0.35 s a stage on the 2-core box, for a file DVC writes
    itself and that carries no comments. The file DVC writes is byte-identical either way
    (tests/e2e/test_warm_servers.py checks it). Only dvc.lock files are affected; without the C
    loader (ruamel.yaml.clib) or with another DVC whose internals differ, nothing is changed.
    """
    def make(original):
        try:
            from dvc.utils.serialize import _yaml
            from ruamel.yaml import CSafeLoader  # noqa: F401  (present only with ruamel.yaml.clib)
        except ImportError:
            return None
        if not callable(original) or not hasattr(_yaml, "parse_yaml"):
            return None
        return lambda text, path: _yaml.parse_yaml(text, path) if _is_lock(path) else original(text, path)

    return _replaced("dvc.utils.serialize._yaml", "parse_yaml_for_update", make)


def _lockfile_written_atomically():
    """While DVC writes dvc.lock, write it to a temporary file beside it and rename that over it.

    Why: DVC truncates dvc.lock and then writes the new YAML into it, so a run killed at that moment
    (kill -9, a lost machine) leaves a half file that no later `dvc repro` can read. Renamed into
    place, the file is always either the old lock or the new one. Other files DVC writes are unchanged.
    """
    def make(original):
        if not callable(original):
            return None

        def dump(path, data, dumper, fs=None, **dumper_args):
            if not _is_lock(path):
                return original(path, data, dumper, fs=fs, **dumper_args)
            scratch = os.path.join(os.path.dirname(os.fspath(path)), ".rlpipe")  # git-ignored; same file system
            os.makedirs(scratch, exist_ok=True)
            tmp = os.path.join(scratch, "dvc.lock.tmp")
            with open(tmp, "w+", encoding="utf-8") as fd:
                dumper(data, fd, **dumper_args)
            os.replace(tmp, path)

        return dump

    return _replaced("dvc.utils.serialize._common", "_dump_data", make)


def _lockfile_emitted_a_stage_at_a_time():
    """While DVC writes dvc.lock, emit only the stage entries that changed since the last write.

    Why: DVC re-emits the whole lock with ruamel's pure-Python emitter after each stage, 7 times an
    iteration, though one entry changed: ~50 ms a write on the 2-core box for this pipeline, 1.9 s an
    iteration of the 0.5B shape on an H100 host (with the reading). Each entry of a block mapping is
    emitted alone exactly as within the whole document, so the file is the concatenation of cached
    pieces, byte-identical to DVC's (tests/run/test_dvc_inprocess.py). Data that a piece could render
    differently (objects shared between entries: anchors; types other than plain YAML ones) is
    emitted whole, as DVC does.
    """
    def make(original):
        if not callable(original):
            return None
        return lambda data, stream, *args, **kwargs: (
            None if not args and not kwargs and _emit_lock_by_stage(data, stream, original)
            else original(data, stream, *args, **kwargs))

    return _replaced("dvc.utils.serialize._yaml", "_dump", make)


_LOCK_PIECES: dict[tuple[str, str], str] = {}  # (stage name, its entry as JSON) -> the entry's YAML text


def _emit_lock_by_stage(data: Any, stream: Any, dump: Callable[[Any, Any], Any]) -> bool:
    """Write ``data`` (a lock document: schema, then stages) to ``stream`` from per-stage pieces; False
    (nothing written) for data of another shape, which the caller then emits whole."""
    if (not isinstance(data, dict) or list(data) != ["schema", "stages"] or not isinstance(data["schema"], str)
            or type(data["stages"]) not in (dict, OrderedDict) or not data["stages"]):
        return False
    seen: set[int] = set()

    def plain(value: Any) -> bool:
        if type(value) in (dict, OrderedDict, list):
            if id(value) in seen:
                return False  # shared: DVC's emitter would write an anchor and an alias
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            return all((type(k) is str or isinstance(value, list)) and plain(v) for k, v in items)  # JSON keys: str
        return value is None or type(value) in (str, int, float, bool)

    if not all(type(name) is str and plain(entry) for name, entry in data["stages"].items()):
        return False

    def emitted(document: Any) -> str:
        out = io.StringIO()
        dump(document, out)
        return out.getvalue()

    header = emitted({"schema": data["schema"]})
    pieces: dict[tuple[str, str], str] = {}
    for name, entry in data["stages"].items():
        key = (name, json.dumps(entry, allow_nan=True))
        piece = _LOCK_PIECES.get(key)
        if piece is None:
            text = emitted({"stages": {name: entry}})
            if not text.startswith("stages:\n"):
                return False
            piece = text[len("stages:\n"):]
        pieces[key] = piece
    _LOCK_PIECES.clear()
    _LOCK_PIECES.update(pieces)  # only the current entries: the cache stays one lock's size
    stream.write(header + "stages:\n" + "".join(pieces.values()))
    return True


def _new_paths_hashed_as_md5():
    """While DVC loads stages, give a dependency or output path that a stage's dvc.lock entry does not
    list yet the hash name DVC 3 records for it anyway (md5), not DVC 2's legacy name (md5-dos2unix).

    Why: DVC reads a path missing from a stage's lock entry as a 2.x entry (legacy name), hashes it
    under that name, then switches it to md5 when the stage runs and hashes it again; its hash cache
    keeps one name per path, so each stage that depends on the path repeats both. When `policy.path`
    becomes ``state/policy`` (iteration 1), generate and train hashed the policy directory four times:
    about 9 s for a Qwen2.5-0.5B shape on the 2-core box. Applied only to lock entries that DVC 3
    wrote (some path with ``hash: md5``); dvc.lock comes out byte-identical (tests/run/test_dvc_inprocess.py).
    """
    def make(original):
        if not isinstance(original, staticmethod):
            return None

        def fill_from_lock(stage, lock_data=None):
            original.__func__(stage, lock_data)
            if not isinstance(lock_data, dict):
                return
            listed = {key: [item for item in lock_data.get(key) or [] if isinstance(item, dict)]
                      for key in ("deps", "outs")}
            if not any(item.get("hash") == "md5" for items in listed.values() for item in items):
                return  # a DVC 2.x entry: DVC's own reading
            for key, items in (("deps", stage.deps), ("outs", stage.outs)):
                paths = {item.get("path") for item in listed[key]}
                for item in items:
                    if (getattr(item, "hash_name", None) == "md5-dos2unix"
                            and getattr(item, "def_path", None) not in paths
                            and hasattr(item, "_compute_hash_info_from_meta")):
                        item.hash_name, item.hash_info = item._compute_hash_info_from_meta("md5")

        return staticmethod(fill_from_lock)

    return _replaced("dvc.stage.loader", "StageLoader.fill_from_lock", make)


PARALLEL_HASH_MIN_BYTES = 16 * 2**20  # smaller files hash in well under a tenth of a second


def _large_outputs_hashed_in_parallel():
    """Before DVC hashes a stage's outputs, hash their large files at once, one thread each, with DVC's
    own function, and record the results in DVC's hash cache, where DVC then finds them.

    Why: DVC hashes the files of one directory with ``core.checksum_jobs`` threads (half the CPUs, at
    most 4: one on a 2-core box) and the directories of an output one after another. A bf16 checkpoint
    is two files of equal size in two directories (the weights, and ``master/``'s low bits): 2 x 1.17 s
    for the 0.5B shape on the 2-core box, every iteration. Hashing releases the GIL, so threads overlap.
    Only DVC 3's plain md5 outputs in the workspace are touched; DVC's cache entry keeps the file's
    inode, size and mtime, so a file that changes afterwards is hashed again as usual.
    """
    def make(original):
        try:
            from dvc_data.hashfile.hash import file_md5
            from dvc_data.hashfile.hash_info import HashInfo
        except ImportError:
            return None
        if not callable(original):
            return None

        def save(stage, *args, **kwargs):
            try:
                _hash_large_outputs(stage, file_md5, HashInfo)
            except Exception:  # noqa: BLE001 - a shortcut only: DVC hashes whatever was not recorded
                pass
            return original(stage, *args, **kwargs)

        return save

    return _replaced("dvc.stage", "Stage.save", make)


def _hash_large_outputs(stage: Any, file_md5, hash_info_type) -> int:
    """Hash ``stage``'s large output files missing from DVC's hash cache in parallel and record them;
    returns how many were recorded (none when fewer than two need hashing: nothing to overlap)."""
    from concurrent.futures import ThreadPoolExecutor

    state = stage.repo.state
    todo: list[tuple[str, Any]] = []
    for out in stage.outs:
        if (not getattr(out, "use_cache", False) or getattr(out, "hash_name", None) != "md5"
                or getattr(out.fs, "protocol", None) != "local"):
            continue
        top = os.fspath(out.fs_path)
        paths = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for path in paths:
            if (os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) >= PARALLEL_HASH_MIN_BYTES
                    and state.get(path, out.fs)[1] is None):
                todo.append((path, out.fs))
    if len(todo) < 2:
        return 0
    with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda item: file_md5(item[0], item[1], name="md5"), todo))
    for (path, fs), digest in zip(todo, digests):
        state.save(path, fs, hash_info_type("md5", digest))
    return len(todo)


# What `_dvc_phases` times: (phase, DVC's module, its function or Class.method) -> the phase its seconds go to.
DVC_PHASES = (("commands", "dvc.stage.run", "cmd_run"),  # the stages' commands (their processes, start to exit)
              ("changed", "dvc.stage", "Stage.changed"),  # deciding whether a stage must run (hashes its deps)
              ("remove_outs", "dvc.stage", "Stage.remove_outs"),  # deleting a stage's old outs before it runs
              ("hash", "dvc.stage", "Stage.save_deps"),  # hashing the deps before the command,
              ("hash", "dvc.stage", "Stage.save"),  # and deps and outs after it (and the run-cache entry)
              ("cache", "dvc.stage", "Stage.commit"),  # moving the outs into DVC's cache, linking them back
              ("lock", "dvc.stage", "Stage.dump"))  # writing the stage's dvc.lock entry


@contextmanager
def _dvc_phases(phases: dict[str, float] | None):
    """While DVC reproduces, add the wall seconds of each of its phases (`DVC_PHASES`) to ``phases``;
    ``phases["dvc_other"]`` gets the rest of the call (loading the pipeline, the run cache's lookups).

    Why: `rlpipe run` spends seconds a stage inside `dvc repro` besides the stages' own processes
    (12.4 s an iteration for the 0.5B shape on an H200); `benchmarks/fixed_cost.py` reports this split so
    that the fixed cost can be attributed without a profiler. Wraps DVC's functions without changing
    what they do; a function a DVC version lacks is left out of the split.
    """
    if phases is None:
        yield
        return
    import time

    depth = {"n": 0}  # nested phases (a stage's save inside another phase) count once, in the outer one

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            if depth["n"]:
                return fn(*args, **kwargs)
            depth["n"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth["n"] -= 1
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    with ExitStack() as stack:  # each wrapped function restored on the way out, also when entering fails midway
        for name, module_name, attribute in DVC_PHASES:
            stack.enter_context(_replaced(module_name, attribute,
                                          lambda fn, name=name: timed(name, fn) if callable(fn) else None))
        before = dict(phases)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            timed_total = sum(phases.get(name, 0.0) - before.get(name, 0.0) for name in {p[0] for p in DVC_PHASES})
            phases["dvc_other"] = phases.get("dvc_other", 0.0) + max(0.0, time.perf_counter() - t0 - timed_total)


def _commands_on(executor: Any):
    """While DVC reproduces, run each stage's command through ``executor`` (a
    `rlpipe.cluster.executor.ClusterExecutor`: the Ray cluster) instead of DVC's own subprocess; None: DVC's.

    Why DVC's ``cmd_run`` and nothing else: everything around it (deciding what runs, hashing, the cache,
    the run cache, dvc.lock) stays DVC's own, on the driver, exactly as in a run on one machine.
    """
    if executor is None:
        return nullcontext()
    from rlpipe.cluster.executor import dvc_cmd_run

    def make(original):
        if not callable(original):
            return None
        return lambda stage, dry=False, run_env=None: dvc_cmd_run(executor, original, stage, dry=dry, run_env=run_env)

    return _replaced("dvc.stage.run", "cmd_run", make)


def repro(root: str | os.PathLike, targets: list[str] | None = None, *,
          phases: dict[str, float] | None = None, executor: Any = None, single_item: bool = False) -> list[str]:
    """``dvc repro [targets]``; returns the names of the stages that ran (or were restored from the run cache).

    ``phases``: a dict that gets the seconds of DVC's phases added (`_dvc_phases`; in-process DVC only).
    ``executor``: where the stages' commands run (`_commands_on`; None: here, as DVC runs them).
    ``single_item``: ``--single-item`` (only the targets, not what they depend on).
    """
    root = Path(root).resolve()
    if executor is not None and not _api_available():
        raise RlpipeError("a cluster run needs DVC's Python API on the driver: pip install 'rlpipe[dvc]'")
    if not _api_available():
        _cli(["repro", *(["--single-item"] if single_item else []), *(targets or [])], root, capture=False)
        return []
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    with (chdir(root), _lockfile_read_by_the_c_loader(), _lockfile_written_atomically(),  # cwd: DVC resolves stage dirs
          _lockfile_emitted_a_stage_at_a_time(), _new_paths_hashed_as_md5(), _large_outputs_hashed_in_parallel(),
          _commands_on(executor), _dvc_phases(phases)):
        try:
            with Repo(str(root)) as repo:
                stages = repo.reproduce(targets or None, single_item=single_item)
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

    with chdir(root), _new_paths_hashed_as_md5():  # cwd: DVC resolves stage working directories against it
        try:
            with Repo(str(root)) as repo:
                return dict(repo.status())
        except DvcException as e:
            raise RlpipeError(f"`dvc status` failed: {e}") from None


def default_remote(root: str | os.PathLike) -> str | None:
    """The name of the project's default DVC remote (``core.remote``, from .dvc/config or config.local), or None."""
    proc = subprocess.run(["dvc", "config", "core.remote"], cwd=Path(root), capture_output=True, text=True)
    name = proc.stdout.strip()
    return name if proc.returncode == 0 and name else None


def push(root: str | os.PathLike) -> None:
    """``dvc push``: the workspace's outputs and tracked state to the default remote (what is there is skipped)."""
    _cli(["push", "-q"], Path(root).resolve(), capture=True)


def add(root: str | os.PathLike, path: str, *, linked_from: str | None = None) -> None:
    """``dvc add path`` (track a directory such as state/policy in the DVC cache, with a .dvc file for git).

    ``linked_from``: a directory DVC has hashed (a stage output) of which ``path`` is a hard-linked copy;
    DVC then reuses those hashes instead of reading the files again (`_reuse_hashes`), and leaves the
    links in place instead of replacing them by copies of the same bytes from its cache.
    """
    root = Path(root).resolve()
    if not _api_available():
        _cli(["add", path], root, capture=True)
        return
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    with chdir(root):  # DVC resolves stage working directories against the cwd
        try:
            with Repo(str(root)) as repo:
                # `rlpipe iterate` commits the .dvc file itself: no "To track the changes with git, run: ..."
                if hasattr(repo, "scm_context") and hasattr(repo.scm_context, "quiet"):
                    repo.scm_context.quiet = True
                if linked_from is None:
                    repo.add(path)
                else:
                    _reuse_hashes(repo, linked_from, path)
                    # DVC replaces a hard-linked file by a copy from its cache unless its cache links (the
                    # default, reflink or copy, does not): 3.2 GB more written for nothing, the same bytes
                    repo.add(path, relink=False)
        except DvcException as e:
            raise RlpipeError(f"`dvc add {path}` failed: {e}") from None


def _reuse_hashes(repo: Any, source: str, copy: str) -> int:
    """Record in DVC's hash cache, for each file of ``copy`` that is a hard link of ``source``'s file at
    the same place, the hash DVC holds for that file; returns how many it recorded.

    Why: DVC keys its cache of file hashes by path, so a hard-linked copy of a checkpoint it has just
    hashed (``state/policy``, made by `rlpipe iterate`) is read and hashed again: 3.2 GB, about 4 s,
    every iteration for a Qwen2.5-0.5B shape with its float32 master copy. A hard link is the same
    file (same inode, size and modification time): DVC's own entry for the source, which DVC checks
    against the file's current state, holds for it. Only DVC's internal State API is used; where it
    differs, nothing is recorded and DVC hashes as before.
    """
    state, fs = getattr(repo, "state", None), getattr(repo, "fs", None)
    if state is None or fs is None or not hasattr(state, "get") or not hasattr(state, "save"):
        return 0
    base = Path(repo.root_dir)
    recorded = 0
    for dirpath, _dirs, files in os.walk(base / copy):
        for name in files:
            linked = Path(dirpath) / name
            original = base / source / linked.relative_to(base / copy)
            try:
                a, b = linked.lstat(), original.lstat()
                if not linked.is_file() or linked.is_symlink() or (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                    continue
                _meta, hash_info = state.get(os.fspath(original), fs)
                if hash_info is None:
                    continue
                state.save(os.fspath(linked), fs, hash_info)
            except (OSError, TypeError, ValueError, AttributeError):
                continue
            recorded += 1
    return recorded
