"""Advance from iteration k to k+1: the trained policy becomes the next sampler (DeepSeekMath's iterative GRPO).

Why a command and not a DVC stage: DVC graphs are acyclic, but an iteration feeds its output back
as the next iteration's input. So after ``dvc repro`` finishes iteration k, ``rlpipe iterate``:
  1. records iteration k's headline metrics in the history file and commits iteration k
     (dvc.lock, metrics, params) to git with the tag ``iteration-k``, so that
     ``git checkout iteration-k && dvc checkout`` restores every artifact of it;
  2. copies the trained checkpoint to ``state/policy`` (tracked with ``dvc add``) and, every
     ``reference.refresh_every`` iterations, to ``state/reference``;
  3. rewrites ``iteration``, ``policy.path`` (and ``reference.*``) in params.yaml, keeping its comments,
     and commits that as the start of iteration k+1.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from rlpipe.config import Params, load_params
from rlpipe.errors import RlpipeError
from rlpipe.io import atomic_path, read_json

STATE_POLICY = "state/policy"
STATE_REFERENCE = "state/reference"


def tag_name(iteration: int) -> str:
    return f"iteration-{iteration}"


def set_params(path: str | Path, updates: dict[str, Any]) -> None:
    """Set scalar values by dotted key (``iteration``, ``policy.path``) in place, keeping comments and layout.

    Why not yaml.dump: params.yaml is documentation too; a round trip through a YAML writer
    would drop every comment.
    """
    p = Path(path)
    lines = p.read_text().splitlines(keepends=True)
    for dotted, value in updates.items():
        parts = dotted.split(".")
        lines = _set_line(lines, parts, value, dotted, p)
    text = "".join(lines)
    data = yaml.safe_load(text)
    for dotted, value in updates.items():
        node = data
        for part in dotted.split("."):
            node = node[part]
        if node != value:
            raise RlpipeError(f"{p}: failed to set {dotted} (read back {node!r})")
    with atomic_path(p) as tmp:
        tmp.write_text(text)


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value if re.fullmatch(r"[A-Za-z0-9_./-]+", value) else json.dumps(value)
    return yaml.safe_dump(value).split("\n")[0]


def _set_line(lines: list[str], parts: list[str], value: Any, dotted: str, path: Path) -> list[str]:
    """Replace the value of a top-level key or of a direct child of a top-level section."""
    if len(parts) not in (1, 2):
        raise RlpipeError(f"{path}: cannot set {dotted}: only `key` or `section.key` are supported")
    key = parts[-1]
    lo, hi, indent = 0, len(lines), ""
    if len(parts) == 2:
        header = re.compile(rf"^{re.escape(parts[0])}:\s*(#.*)?$")
        lo = next((i + 1 for i, ln in enumerate(lines) if header.match(ln.rstrip("\n"))), None)
        if lo is None:
            raise RlpipeError(f"{path}: section {parts[0]!r} not found")
        hi = next((i for i in range(lo, len(lines)) if lines[i].strip() and not lines[i][0].isspace()
                   and not lines[i].startswith("#")), len(lines))
        first = next((ln for ln in lines[lo:hi] if ln.strip() and not ln.lstrip().startswith("#")), "")
        indent = first[: len(first) - len(first.lstrip())]
    pattern = re.compile(rf"^{re.escape(indent)}{re.escape(key)}:[ \t]*[^#\n]*?([ \t]*#.*)?$")
    for i in range(lo, hi):
        m = pattern.match(lines[i].rstrip("\n"))
        if m:
            lines[i] = f"{indent}{key}: {_render(value)}{m.group(1) or ''}\n"
            return lines
    raise RlpipeError(f"{path}: key {dotted} not found")


def _run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RlpipeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def pipeline_is_current(root: Path) -> bool:
    out = _run(["dvc", "status", "--json"], root).strip()
    return out in ("", "{}")


def history_row(params: Params, root: Path) -> dict[str, Any]:
    """The headline numbers of the finished iteration, from the stage metrics files."""
    mdir = root / params.paths.metrics_dir
    train, evaluate = read_json(mdir / "train.json"), read_json(mdir / "evaluate.json")
    gen, score = read_json(mdir / "generate.json"), read_json(mdir / "score.json")
    return {
        "iteration": params.iteration,
        "eval_accuracy": evaluate["accuracy"],
        "eval_reward_mean": evaluate["reward_mean"],
        "train_reward_mean": score["reward_mean"],
        "train_accuracy": score["accuracy"],
        "length_mean": gen["length_mean"],
        "truncation_rate": gen["truncation_rate"],
        "approx_kl_old": train["approx_kl_old"],
        "kl_ref": train["kl_ref"],
        "clip_fraction": train["clip_fraction"],
        "entropy_old": train["entropy_old"],
        "reference_version": params.reference.version,
    }


def _replace_dir(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copytree(src, tmp)


def advance(root: str | Path = ".", *, params_file: str = "params.yaml", commit: bool = True) -> dict[str, Any]:
    """Finish iteration k and set up k+1 (see module docstring); returns the history row of k."""
    root = Path(root)
    params = load_params(root / params_file)
    k = params.iteration
    ckpt = root / params.paths.checkpoint
    info = ckpt / "rlpipe.json"
    if not info.is_file():
        raise RlpipeError(f"{ckpt}: no trained checkpoint; run `dvc repro` for iteration {k} first")
    version = json.loads(info.read_text())["policy_version"]
    if version != k + 1:
        raise RlpipeError(f"{ckpt}: holds policy version {version}, expected {k + 1}; run `dvc repro` first")
    if not pipeline_is_current(root):
        raise RlpipeError("the pipeline is not up to date (`dvc status` lists changes); run `dvc repro` first")

    row = history_row(params, root)
    hist = root / params.paths.history
    hist.parent.mkdir(parents=True, exist_ok=True)
    previous = hist.read_text() if hist.is_file() else ""
    kept = [ln for ln in previous.splitlines() if ln.strip() and json.loads(ln)["iteration"] != k]
    with atomic_path(hist) as tmp:
        tmp.write_text("".join(line + "\n" for line in [*kept, json.dumps(row, sort_keys=True)]))
    if commit:
        _commit(root, f"rlpipe: iteration {k} (eval accuracy {row['eval_accuracy']})", params, tag=tag_name(k))

    _replace_dir(ckpt, root / STATE_POLICY)
    _run(["dvc", "add", STATE_POLICY], root)
    updates: dict[str, Any] = {"iteration": k + 1, "policy.path": STATE_POLICY}
    K = params.reference.refresh_every
    if K > 0 and (k + 1) % K == 0:
        _replace_dir(ckpt, root / STATE_REFERENCE)
        _run(["dvc", "add", STATE_REFERENCE], root)
        updates.update({"reference.path": STATE_REFERENCE, "reference.version": k + 1})
    set_params(root / params_file, updates)
    if commit:
        _commit(root, f"rlpipe: start iteration {k + 1}", params, tag=None)
    return row


def _commit(root: Path, message: str, params: Params, *, tag: str | None) -> None:
    paths = [p for p in ("params.yaml", "dvc.lock", params.paths.metrics_dir, params.paths.plots_dir,
                         params.paths.history, "state") if (root / p).exists()]
    _run(["git", "add", "--", *paths], root)
    _run(["git", "commit", "-q", "--allow-empty", "-m", message], root)
    if tag:
        _run(["git", "tag", "-f", tag], root)
