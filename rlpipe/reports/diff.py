"""`rlpipe diff A B`: what changed between two iterations, as data.

Each side is a project directory (its metrics/*.json and evaluate stage's eval_rollouts as they
are on disk) or a git revision of the project: a tag such as ``iteration-3`` (or just ``3``), a
branch, a commit. For a revision, params come from git (``git show REV:path``, committed by
``rlpipe iterate``) and the stage metrics and eval rollouts, DVC outputs, through
``dvc.api.read(path, rev=REV)``, which reads them from the local DVC cache (or a remote) without
touching the workspace (rlpipe.reports.sources). Each headline metric says which way is better
(``HEADLINES``: the one place), so a change can be called better or worse; the params that differ
between the sides are listed, and each flipped prompt comes with the `rlpipe inspect` command that
shows it on either side.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from rlpipe.data.io import read_artifact, read_json
from rlpipe.data.schema import EVAL_ROLLOUTS, PROMPTS
from rlpipe.errors import ArtifactError
from rlpipe.reports import sources

HIGHER, LOWER = "higher", "lower"  # which way a metric is better; None: a change to read, not to judge
# (label, stage, keys in metrics/<stage>.json (the first present wins), direction). KL, clip fraction,
# entropy, lengths and grad norm have no better side: a rise can be learning or drift.
HEADLINES = (
    ("eval accuracy", "evaluate", ("accuracy",), HIGHER),
    ("eval reward mean", "evaluate", ("reward_mean",), HIGHER),
    ("eval completion length", "evaluate", ("length_mean",), None),
    ("eval truncation rate", "evaluate", ("truncation_rate",), LOWER),
    ("train reward mean", "score", ("reward_mean",), HIGHER),
    ("train sample accuracy", "score", ("accuracy",), HIGHER),
    ("train completion length", "generate", ("length_mean",), None),
    ("train truncation rate", "generate", ("truncation_rate",), LOWER),
    ("zero-variance group share", "advantage", ("zero_variance_fraction",), LOWER),
    ("KL to reference (trainer, kl_ref)", "train", ("kl_ref",), None),
    ("KL sampler vs reference (k1)", "reference_logprob", ("kl_sampler_ref_k1",), None),
    ("clip fraction", "train", ("clip_fraction",), None),
    ("approx KL to pi_old", "train", ("approx_kl_old",), None),
    ("entropy (pi_old)", "train", ("entropy_old",), None),
    ("grad norm (mean)", "train", ("grad_norm_mean",), None),
    ("policy version evaluated", "evaluate", ("policy_version",), None),
)
# Multi-turn runs only (generate.environment): listed when either side measured them. More tool use or
# turns is neither better nor worse in itself.
MULTI_TURN_HEADLINES = (
    ("eval tool-use rate (rollouts with a tool call)", "evaluate", ("tool_use_rate",), None),
    ("eval turns per rollout (mean)", "evaluate", ("turns_mean",), None),
    ("train tool-use rate (rollouts with a tool call)", "generate", ("tool_use_rate",), None),
    ("train turns per rollout (mean)", "generate", ("turns_mean",), None),
)
STAGES = ("generate", "score", "reference_logprob", "advantage", "train", "evaluate")
# (Side attribute, params.yaml `paths` key, schema, the columns the flips read): only those, so an older
# run's eval rollouts, written before a column was added (turn_starts, tool_calls), still compare.
FLIP_COLUMNS = ["correct", "completion_text", "reward"]
SIDE_TABLES = (("eval_rollouts", "eval_rollouts", EVAL_ROLLOUTS, FLIP_COLUMNS),
               ("eval_prompts", "eval_prompts", PROMPTS, None))
SECONDS_DIRECTION = LOWER  # a stage's wall time


@dataclass
class Side:
    label: str
    metrics: dict[str, dict[str, Any]]
    eval_rollouts: pl.DataFrame | None
    eval_prompts: pl.DataFrame | None
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    inspect: str = ""  # the `rlpipe inspect` arguments that read this side: "DIR" or "REPO --rev REV"


def _read_dir(root: Path) -> Side:
    params = sources.read_params(root)
    paths = sources.project_paths(params)
    mdir = root / (paths.get("metrics_dir") or "metrics")
    metrics = {f.stem: read_json(f) for f in sorted(mdir.glob("*.json"))} if mdir.is_dir() else {}
    side = Side(label=str(root), metrics=metrics, eval_rollouts=None, eval_prompts=None, params=params,
                inspect=shlex.quote(str(root)))
    for attr, key, schema, columns in SIDE_TABLES:
        f = root / (paths.get(key) or "")
        if paths.get(key) and f.is_file():
            setattr(side, attr, read_artifact(f, schema, columns=columns).frame)
        else:
            side.notes.append(f"{root}: no {key} file ({f})")
    return side


def _read_revision(repo: Path, rev: str, label: str) -> Side:
    data = sources.read_params(repo, rev)
    paths = data.get("paths") or {}
    mdir = paths.get("metrics_dir") or "metrics"
    metrics, problems = sources.stage_metrics_at(repo, rev, mdir)
    side = Side(label=label, metrics=metrics, eval_rollouts=None, eval_prompts=None, params=data,
                inspect=f"{shlex.quote(str(repo))} --rev {shlex.quote(rev)}")
    side.notes += [f"{label}: {p}" for p in problems]
    if not metrics:
        side.notes.append(f"{label}: no metrics recorded under {mdir}/ at {rev}")
    for attr, key, schema, columns in SIDE_TABLES:
        if not paths.get(key):
            continue
        try:
            setattr(side, attr, sources.read_artifact_at(repo, rev, paths[key], schema, columns=columns).frame)
        except ArtifactError:
            raise
        except Exception as e:  # noqa: BLE001 - DVC raises many types (missing cache, no remote, ...)
            side.notes.append(f"{label}: could not read {paths[key]} at {rev} through DVC "
                              f"({sources.dvc_read_problem(e)})")
    return side


def resolve(spec: str, repo: Path) -> Side:
    """A diff side: a directory, else a git revision of ``repo`` (``3`` is short for ``iteration-3``)."""
    path = Path(spec)
    if path.is_dir():
        return _read_dir(path)
    rev = sources.resolve_revision(repo, spec)
    return _read_revision(repo, rev, spec if rev == spec else f"{spec} ({rev})")


def _metric(side: Side, stage: str, keys: tuple[str, ...]) -> Any:
    m = side.metrics.get(stage) or {}
    return next((m[k] for k in keys if k in m), None)


def judge(delta: float | None, direction: str | None) -> str | None:
    """'better', 'worse' or 'same' for a change of a metric whose better side is ``direction``; None: not judged."""
    if delta is None or direction is None:
        return None
    if delta == 0:
        return "same"
    return "better" if (delta > 0) == (direction == HIGHER) else "worse"


def _row(label: str, va: Any, vb: Any, direction: str | None) -> dict[str, Any]:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
    delta = vb - va if numbers else None
    return {"metric": label, "a": va, "b": vb, "delta": delta, "direction": direction,
            "change": judge(delta, direction)}


def headline_rows(a: Side, b: Side) -> list[dict[str, Any]]:
    rows = [_row(label, _metric(a, stage, keys), _metric(b, stage, keys), direction)
            for label, stage, keys, direction in HEADLINES]
    for label, stage, keys, direction in MULTI_TURN_HEADLINES:
        va, vb = _metric(a, stage, keys), _metric(b, stage, keys)
        if va is not None or vb is not None:
            rows.append(_row(label, va, vb, direction))
    for stage in STAGES:
        va = ((a.metrics.get(stage) or {}).get("seconds") or {}).get("total")
        vb = ((b.metrics.get(stage) or {}).get("seconds") or {}).get("total")
        if va is not None or vb is not None:
            rows.append(_row(f"seconds: {stage}", va, vb, SECONDS_DIRECTION))
    return rows


ABSENT = "(absent)"


def params_diff(a: Side, b: Side) -> list[dict[str, Any]]:
    """Every params.yaml key (dotted) whose value differs between the sides, in A's key order then B's."""
    fa, fb = sources.flatten(a.params), sources.flatten(b.params)
    keys = [*fa, *(k for k in fb if k not in fa)]
    return [{"key": k, "a": fa.get(k, ABSENT), "b": fb.get(k, ABSENT)} for k in keys
            if fa.get(k, ABSENT) != fb.get(k, ABSENT)]


def flips(a: Side, b: Side, *, show: int) -> dict[str, Any] | None:
    """Per-prompt changes of correctness on the held-out set (greedy eval rollouts of each side)."""
    if a.eval_rollouts is None or b.eval_rollouts is None:
        return None
    cols = ["prompt_id", "sample_idx", *FLIP_COLUMNS]
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
                 "reward_a": r["reward"], "reward_b": r["reward_b"],
                 "inspect_a": f"rlpipe inspect {a.inspect} --eval --prompt-id {r['prompt_id']}",
                 "inspect_b": f"rlpipe inspect {b.inspect} --eval --prompt-id {r['prompt_id']}"}
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
    return {"a": a.label, "b": b.label, "metrics": headline_rows(a, b), "params": params_diff(a, b),
            "flips": flips(a, b, show=show), "notes": [*a.notes, *b.notes]}

