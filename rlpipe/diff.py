"""`rlpipe diff A B`: what changed between two iterations, as data.

Each side is a project directory (its metrics/*.json and evaluate stage's eval_rollouts as they
are on disk) or a git revision of the project: a tag such as ``iteration-3`` (or just ``3``), a
branch, a commit. For a revision, metrics and params come from git (``git show REV:path``; the
metrics are committed by ``rlpipe iterate``) and the eval rollouts, a DVC output, through
``dvc.api.read(path, rev=REV)``, which reads them from the local DVC cache (or a remote) without
touching the workspace.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import yaml

from rlpipe.errors import ArtifactError
from rlpipe.inspect import read_project_paths
from rlpipe.io import read_artifact, read_json
from rlpipe.schema import EVAL_ROLLOUTS, PROMPTS, ArtifactSchema

# (label, stage, key in metrics/<stage>.json); the first key present wins.
HEADLINES = (
    ("eval accuracy", "evaluate", ("accuracy",)),
    ("eval reward mean", "evaluate", ("reward_mean",)),
    ("eval completion length", "evaluate", ("length_mean",)),
    ("eval truncation rate", "evaluate", ("truncation_rate",)),
    ("train reward mean", "score", ("reward_mean",)),
    ("train sample accuracy", "score", ("accuracy",)),
    ("train completion length", "generate", ("length_mean",)),
    ("train truncation rate", "generate", ("truncation_rate",)),
    ("zero-variance group share", "advantage", ("zero_variance_fraction",)),
    ("KL to reference (trainer, kl_ref)", "train", ("kl_ref",)),
    ("KL sampler vs reference (k1)", "reference_logprob", ("kl_sampler_ref_k1",)),
    ("clip fraction", "train", ("clip_fraction",)),
    ("approx KL to pi_old", "train", ("approx_kl_old",)),
    ("entropy (pi_old)", "train", ("entropy_old",)),
    ("grad norm (mean)", "train", ("grad_norm_mean",)),
    ("policy version evaluated", "evaluate", ("policy_version",)),
)
STAGES = ("generate", "score", "reference_logprob", "advantage", "train", "evaluate")


@dataclass
class Side:
    label: str
    metrics: dict[str, dict[str, Any]]
    eval_rollouts: pl.DataFrame | None
    eval_prompts: pl.DataFrame | None
    notes: list[str] = field(default_factory=list)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def _is_revision(repo: Path, rev: str) -> bool:
    return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0


def _read_dir(root: Path) -> Side:
    paths = read_project_paths(root)
    mdir = root / (paths.get("metrics_dir") or "metrics")
    metrics = {f.stem: read_json(f) for f in sorted(mdir.glob("*.json"))} if mdir.is_dir() else {}
    side = Side(label=str(root), metrics=metrics, eval_rollouts=None, eval_prompts=None)
    for attr, key, schema in (("eval_rollouts", "eval_rollouts", EVAL_ROLLOUTS), ("eval_prompts", "eval_prompts", PROMPTS)):
        f = root / (paths.get(key) or "")
        if paths.get(key) and f.is_file():
            setattr(side, attr, read_artifact(f, schema).frame)
        else:
            side.notes.append(f"{root}: no {key} file ({f})")
    return side


def _dvc_artifact(repo: Path, rev: str, path: str, schema: ArtifactSchema) -> pl.DataFrame:
    """An artifact as it was at ``rev``, read through DVC (local cache or remote), validated."""
    import dvc.api

    data = dvc.api.read(path, repo=str(repo), rev=rev, mode="rb")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / Path(path).name
        f.write_bytes(data)
        return read_artifact(f, schema).frame


def _read_revision(repo: Path, rev: str, label: str) -> Side:
    shown = _git(repo, "show", f"{rev}:params.yaml")
    if shown.returncode != 0:
        raise ArtifactError(f"{label}: no params.yaml at revision {rev} of {repo}")
    data = yaml.safe_load(shown.stdout) or {}
    paths = data.get("paths") or {}
    mdir = paths.get("metrics_dir") or "metrics"
    metrics: dict[str, dict[str, Any]] = {}
    listing = _git(repo, "ls-tree", "--name-only", f"{rev}:{mdir}")
    for name in listing.stdout.split() if listing.returncode == 0 else []:
        if name.endswith(".json"):
            metrics[name.removesuffix(".json")] = json.loads(_git(repo, "show", f"{rev}:{mdir}/{name}").stdout)
    side = Side(label=label, metrics=metrics, eval_rollouts=None, eval_prompts=None)
    if not metrics:
        side.notes.append(f"{label}: no metrics committed under {mdir}/ at {rev}")
    for attr, key, schema in (("eval_rollouts", "eval_rollouts", EVAL_ROLLOUTS), ("eval_prompts", "eval_prompts", PROMPTS)):
        if not paths.get(key):
            continue
        try:
            setattr(side, attr, _dvc_artifact(repo, rev, paths[key], schema))
        except ArtifactError:
            raise
        except Exception as e:  # noqa: BLE001 - DVC raises many types (missing cache, no remote, ...)
            side.notes.append(f"{label}: could not read {paths[key]} at {rev} through DVC "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return side


def resolve(spec: str, repo: Path) -> Side:
    """A diff side: a directory, else a git revision of ``repo`` (``3`` is short for ``iteration-3``)."""
    path = Path(spec)
    if path.is_dir():
        return _read_dir(path)
    if not (repo / ".git").exists() and _git(repo, "rev-parse", "--git-dir").returncode != 0:
        raise ArtifactError(f"{spec!r}: not a directory, and {repo} is not a git repository to look it up in")
    for rev in ([f"iteration-{spec}", spec] if spec.isdigit() else [spec]):
        if _is_revision(repo, rev):
            return _read_revision(repo, rev, spec if rev == spec else f"{spec} ({rev})")
    tags = _git(repo, "tag", "--list", "iteration-*").stdout.split()
    raise ArtifactError(f"{spec!r}: neither a directory nor a git revision of {repo}"
                        + (f"; iteration tags: {', '.join(tags)}" if tags else "; no iteration-* tags yet"))


def _metric(side: Side, stage: str, keys: tuple[str, ...]) -> Any:
    m = side.metrics.get(stage) or {}
    return next((m[k] for k in keys if k in m), None)


def headline_rows(a: Side, b: Side) -> list[dict[str, Any]]:
    rows = []
    for label, stage, keys in HEADLINES:
        va, vb = _metric(a, stage, keys), _metric(b, stage, keys)
        delta = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
        rows.append({"metric": label, "a": va, "b": vb, "delta": delta})
    for stage in STAGES:
        va = ((a.metrics.get(stage) or {}).get("seconds") or {}).get("total")
        vb = ((b.metrics.get(stage) or {}).get("seconds") or {}).get("total")
        if va is not None or vb is not None:
            rows.append({"metric": f"seconds: {stage}", "a": va, "b": vb,
                         "delta": vb - va if va is not None and vb is not None else None})
    return rows


def flips(a: Side, b: Side, *, show: int) -> dict[str, Any] | None:
    """Per-prompt changes of correctness on the held-out set (greedy eval rollouts of each side)."""
    if a.eval_rollouts is None or b.eval_rollouts is None:
        return None
    cols = ["prompt_id", "sample_idx", "correct", "completion_text", "reward"]
    joined = a.eval_rollouts.select(cols).join(b.eval_rollouts.select(cols), on=["prompt_id", "sample_idx"],
                                               how="inner", suffix="_b")
    both = joined.filter(pl.col("correct").is_not_null() & pl.col("correct_b").is_not_null())
    to_right = both.filter(~pl.col("correct") & pl.col("correct_b"))
    to_wrong = both.filter(pl.col("correct") & ~pl.col("correct_b"))
    prompts = b.eval_prompts if b.eval_prompts is not None else a.eval_prompts

    def listed(frame: pl.DataFrame) -> list[dict[str, Any]]:
        if prompts is not None:
            frame = frame.join(prompts.select("prompt_id", "prompt", "answer"), on="prompt_id", how="left")
        return [{"prompt_id": r["prompt_id"], "prompt": r.get("prompt"), "answer": r.get("answer"),
                 "completion_a": r["completion_text"], "completion_b": r["completion_text_b"],
                 "reward_a": r["reward"], "reward_b": r["reward_b"]}
                for r in frame.sort("prompt_id").head(show).iter_rows(named=True)]

    return {
        "compared": joined.height, "judged": both.height,
        "only_in_a": a.eval_rollouts.height - joined.height, "only_in_b": b.eval_rollouts.height - joined.height,
        "wrong_to_right": to_right.height, "right_to_wrong": to_wrong.height,
        "right_both": both.filter(pl.col("correct") & pl.col("correct_b")).height,
        "wrong_both": both.filter(~pl.col("correct") & ~pl.col("correct_b")).height,
        "accuracy_a": float(both["correct"].mean()) if both.height else None,
        "accuracy_b": float(both["correct_b"].mean()) if both.height else None,
        "examples_wrong_to_right": listed(to_right), "examples_right_to_wrong": listed(to_wrong),
    }


def diff_data(spec_a: str, spec_b: str, *, repo: str | Path = ".", show: int = 10) -> dict[str, Any]:
    """Everything `rlpipe diff` shows: headline metrics of both sides and held-out flips."""
    root = Path(repo)
    a, b = resolve(spec_a, root), resolve(spec_b, root)
    return {"a": a.label, "b": b.label, "metrics": headline_rows(a, b), "flips": flips(a, b, show=show),
            "notes": [*a.notes, *b.notes]}

