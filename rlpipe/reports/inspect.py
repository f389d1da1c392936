"""`rlpipe inspect`: one iteration's artifacts joined on (prompt_id, sample_idx), summarised as data.

Plain functions returning polars frames and JSON-ready dicts; ``rlpipe.reports.render`` draws them (rich,
HTML) and ``rlpipe.cli`` only parses options. A project directory is read through the paths in
its params.yaml (read leniently, so an older run's params still work), as it is on disk or as it
was at a git revision (``rev``: params from git, artifacts through DVC); a single artifact file is
read alone, identified by the schema named in its footer. Which rows ``show`` picks, when no sort
is asked for, is ``rlpipe.reports.selection``'s informative order.

Columns added to the joined rows (documented in docs/inspect.md), usable in --where/--sort/--color-by:
  per token   log_ratio = new - old log-prob (what training changed), sampler_mismatch = old - sampler
              log-prob (trainer vs sampler numerics), ref_log_ratio = sampler - ref log-prob;
  per row     seq_logprob (sum of sampler log-probs), seq_kl_ref (mean of ref_log_ratio),
              seq_mismatch_max (largest |sampler_mismatch|), seq_log_ratio_max (largest |log_ratio|),
              seq_entropy (mean entropy).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from rlpipe.data.decode import TokenDecoder, fallback_pieces, find_decoder
from rlpipe.data.io import Artifact, count_rows, join_on_keys, read_artifact, read_metadata, stream_artifact
from rlpipe.data.schema import (ADVANTAGES, EVAL_ROLLOUTS, PROMPTS, REF_LOGPROBS, ROLLOUTS, SCORES, TRAIN_TOKEN_STATS,
                           component_column, get_schema)
from rlpipe.data.view import prompt_view_columns, with_prompt_columns
from rlpipe.errors import ArtifactError
from rlpipe.reports import sources
from rlpipe.reports.look_here import look_here
from rlpipe.reports.selection import informative_order, one_sample_per_prompt
from rlpipe.reports.token_stats import (TOKEN_COLUMNS, StreamedTokenStatistics, finite_or_none, series_stats,
                                        token_statistics)
from rlpipe.reports.turn_view import turn_records, turn_summary

KEYS = ("prompt_id", "sample_idx")
# (role, params.yaml `paths` key, schema) of one iteration, the first being the table joined onto.
TRAIN_ROLES = (("rollouts", "rollouts", ROLLOUTS), ("scores", "scores", SCORES),
               ("ref_logprobs", "ref_logprobs", REF_LOGPROBS), ("advantages", "advantages", ADVANTAGES),
               ("token_stats", "token_stats", TRAIN_TOKEN_STATS), ("prompts", "train_prompts", PROMPTS))
EVAL_ROLES = (("eval_rollouts", "eval_rollouts", EVAL_ROLLOUTS), ("prompts", "eval_prompts", PROMPTS))

# Per-token columns a completion can be coloured by, and how their colour scale reads.
COLOR_COLUMNS = {"token_advantages": "diverging", "sampler_logprobs": "logprob", "old_logprobs": "logprob",
                 "new_logprobs": "logprob", "ref_logprobs": "logprob", "log_ratio": "diverging",
                 "sampler_mismatch": "diverging", "ref_log_ratio": "diverging", "entropy": "magnitude"}
COLOR_ALIASES = {"advantage": "token_advantages", "advantages": "token_advantages"}
# Whatever the colouring, each shown sample marks its least likely sampled tokens: the unlikely digit that
# broke an answer hides under GRPO's colours (one advantage for the whole sample).
LEAST_LIKELY_COUNT = 3
LEAST_LIKELY_BELOW = -1.0  # sampler log-prob; p < 0.37: a near-certain token is never "least likely"


@dataclass
class Loaded:
    """The artifacts found for one inspection: role -> validated table."""

    label: str
    view: str  # "train" | "eval" | the artifact kind of a single file
    base: str  # role of the table every other one is joined onto
    artifacts: dict[str, Artifact]
    missing: dict[str, str] = field(default_factory=dict)  # role -> path that does not exist
    model_dirs: list[Path] = field(default_factory=list)  # where a tokenizer may be found, in order
    root: Path | None = None  # the project directory (None: a file outside any project)
    params: dict[str, Any] | None = None  # its params.yaml (at ``rev``), read leniently
    rev: str | None = None  # the git revision read, None for the files on disk
    notes: list[str] = field(default_factory=list)  # why an artifact could not be read at ``rev``
    # role -> (rows, whole schema) where ``artifacts`` holds only the row-level columns (`streamed_view`)
    shapes: dict[str, tuple[int, dict[str, pl.DataType]]] = field(default_factory=dict)


def read_project_paths(root: Path) -> dict[str, Any]:
    """params.yaml's `paths` plus the policy's path, read without the strict loader.

    Why lenient: inspect and diff also read older runs, whose params may predate a key.
    """
    return sources.project_paths(sources.read_params(root))


def _find_project(start: Path) -> Path | None:
    for d in [start, *start.parents, Path.cwd()]:
        if (d / "params.yaml").is_file():
            return d
    return None


def _model_dirs(root: Path, paths: dict[str, Any]) -> list[Path]:
    return [root / p for p in (paths.get("policy"), paths.get("model_dir"), paths.get("checkpoint")) if p]


def load(target: str | Path, *, eval_view: bool = False, rev: str | None = None) -> Loaded:
    """Read a project directory's iteration artifacts (train side, or eval with ``eval_view``) or one file.

    With ``rev``, the directory's params.yaml and artifacts as they were at that git revision.
    """
    path = Path(target)
    if not path.exists():
        raise ArtifactError(f"{path}: no such file or directory")
    if rev is not None:
        if path.is_file():
            raise ArtifactError(f"--rev {rev}: give the project directory, not a file ({path})")
        return _load_revision(path, rev, eval_view=eval_view)
    if path.is_file():
        meta = read_metadata(path)
        try:
            schema = get_schema(str(meta.get("artifact")))
        except KeyError:
            raise ArtifactError(f"{path}: footer names unknown artifact {meta.get('artifact')!r}") from None
        project = _find_project(path.resolve().parent)
        params = None
        try:  # only to find a tokenizer: a broken params.yaml elsewhere must not stop reading the file
            params = sources.read_params(project) if project else None
            dirs = _model_dirs(project, sources.project_paths(params)) if project else []
        except ArtifactError:
            dirs = []
        return Loaded(label=str(path), view=schema.name, base=schema.name,
                      artifacts={schema.name: read_artifact(path, schema)}, model_dirs=dirs, root=project,
                      params=params)
    params = sources.read_params(path)
    paths = sources.project_paths(params)
    roles = EVAL_ROLES if eval_view else TRAIN_ROLES
    found, missing = {}, {}
    for role, key, schema in roles:
        rel = paths.get(key)
        if not rel:
            continue
        file = path / rel
        if file.is_file():
            found[role] = read_artifact(file, schema)
        else:
            missing[role] = str(file)
    base = roles[0][0]
    if base not in found:
        raise ArtifactError(f"{missing.get(base, base)}: not found; run `dvc repro` (or `dvc checkout`) first")
    return Loaded(label=str(path), view="eval" if eval_view else "train", base=base, artifacts=found,
                  missing=missing, model_dirs=_model_dirs(path, paths), root=path, params=params)


def _load_revision(root: Path, spec: str, *, eval_view: bool) -> Loaded:
    """The iteration artifacts of ``root`` at a git revision (``3`` = ``iteration-3``), read through DVC.

    The tokenizer is the workspace's (a project's tokenizer does not change between iterations).
    """
    rev = sources.resolve_revision(root, spec, or_directory=False)
    params = sources.read_params(root, rev)
    paths = sources.project_paths(params)
    roles = EVAL_ROLES if eval_view else TRAIN_ROLES
    found, missing, notes = {}, {}, []
    for role, key, schema in roles:
        rel = paths.get(key)
        if not rel:
            continue
        try:
            found[role] = sources.read_artifact_at(root, rev, rel, schema)
        except ArtifactError:
            raise
        except Exception as e:  # noqa: BLE001 - DVC raises many types (not in the cache, no remote, ...)
            missing[role] = f"{rev}:{rel}"
            notes.append(f"{rev}:{rel}: not readable through DVC ({sources.dvc_read_problem(e)})")
    base = roles[0][0]
    if base not in found:
        raise ArtifactError(f"{missing.get(base, base)}: not found at revision {rev} "
                            f"({'; '.join(notes) or 'no such path in params.yaml'}); `dvc fetch` it or check the tag")
    try:
        dirs = _model_dirs(root, read_project_paths(root))
    except ArtifactError:
        dirs = []
    return Loaded(label=f"{root}@{rev}", view="eval" if eval_view else "train", base=base, artifacts=found,
                  missing=missing, model_dirs=dirs, root=root, params=params, rev=rev, notes=notes)


def joined_frame(loaded: Loaded) -> tuple[pl.DataFrame, list[str]]:
    """All artifacts joined onto the base table on the keys, plus derived columns; and warnings.

    An artifact whose keys or list lengths disagree with the base is left out with a warning
    (inspection should show what it can), as is one written for another policy version.
    """
    warnings: list[str] = []
    base = loaded.artifacts[loaded.base]
    frame = base.frame
    base_version = base.metadata.get("policy_version")
    for role, art in loaded.artifacts.items():
        if role in (loaded.base, "prompts"):
            continue
        version = art.metadata.get("policy_version")
        if None not in (version, base_version) and version != base_version:
            warnings.append(f"{role} ({art.path}) is for policy version {version} but {loaded.base} is for "
                            f"{base_version}: stale? run `dvc repro`")
        columns = [c for c in art.frame.columns if c not in frame.columns]
        try:
            frame = join_on_keys(base.with_frame(frame), art, columns=columns)
        except ArtifactError as e:
            warnings.append(f"{role} not joined: {e}")
    prompts = loaded.artifacts.get("prompts")
    if prompts is not None and "prompt_id" in frame.columns:
        frame = with_prompt_columns(frame, prompts.frame)  # the rollout view (rlpipe.data.view)
        unknown = frame.filter(pl.col("prompt").is_null())["prompt_id"].unique()
        if unknown.len():
            warnings.append(f"{unknown.len()} prompt_id(s) not in {prompts.path}, e.g. {unknown[0]}")
    return with_derived_columns(frame), warnings


def with_derived_columns(frame: pl.DataFrame) -> pl.DataFrame:
    """Add the per-token and per-row columns of the module docstring where their inputs exist.

    ``frame`` may be lazy (`rlpipe view` scans): the columns are read from the schema, not the data."""
    cols = set(frame.collect_schema().names())
    token = {"log_ratio": ("new_logprobs", "old_logprobs"), "sampler_mismatch": ("old_logprobs", "sampler_logprobs"),
             "ref_log_ratio": ("sampler_logprobs", "ref_logprobs")}
    frame = frame.with_columns([(pl.col(a) - pl.col(b)).alias(name) for name, (a, b) in token.items()
                                if a in cols and b in cols])
    cols = set(frame.collect_schema().names())
    extra = []
    if "sampler_logprobs" in cols:
        extra.append(pl.col("sampler_logprobs").list.sum().alias("seq_logprob"))
    if "ref_log_ratio" in cols:
        extra.append(pl.col("ref_log_ratio").list.mean().alias("seq_kl_ref"))
    if "sampler_mismatch" in cols:
        extra.append(pl.col("sampler_mismatch").list.eval(pl.element().abs()).list.max().alias("seq_mismatch_max"))
    if "log_ratio" in cols:
        extra.append(pl.col("log_ratio").list.eval(pl.element().abs()).list.max().alias("seq_log_ratio_max"))
    if "entropy" in cols:
        extra.append(pl.col("entropy").list.mean().alias("seq_entropy"))
    return frame.with_columns(extra)


def color_column(frame: pl.DataFrame, requested: str | None) -> str | None:
    """The per-token column to colour by: the requested one (validated) or the most useful available."""
    if requested is None:
        for name in ("token_advantages", "sampler_logprobs"):
            if name in frame.columns:
                return name
        return None
    name = COLOR_ALIASES.get(requested, requested)
    if name not in COLOR_COLUMNS:
        raise ArtifactError(f"--color-by {requested!r}: not a per-token column; choose one of "
                            f"{sorted([*COLOR_COLUMNS, *COLOR_ALIASES])}")
    if name not in frame.columns:
        available = [c for c in COLOR_COLUMNS if c in frame.columns]
        raise ArtifactError(f"--color-by {requested!r}: column {name!r} is not in the inspected artifacts "
                            f"(available: {available})")
    return name


# ----------------------------------------------------------------------------------------------
# Summary statistics
# ----------------------------------------------------------------------------------------------

def group_table(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per prompt: group size, reward mean/std, number correct, whether all rewards are equal."""
    aggs = [pl.len().alias("size")]
    if "reward" in frame.columns:
        aggs += [pl.col("reward").mean().alias("reward_mean"), pl.col("reward").std().alias("reward_std"),
                 (pl.col("reward").max() == pl.col("reward").min()).alias("zero_variance")]
    if "correct" in frame.columns:
        aggs.append(pl.col("correct").cast(pl.Int32).sum().alias("num_correct"))
    identity = next((c for c in ("completion_token_ids", "completion_text") if c in frame.columns), None)
    if identity:
        aggs.append(pl.col(identity).n_unique().alias("distinct"))
    return frame.group_by("prompt_id").agg(aggs).sort("prompt_id")


def _length_histogram(lengths: pl.Series, max_bins: int = 16) -> list[dict[str, Any]]:
    if lengths.len() == 0:
        return []
    lo, hi = int(lengths.min()), int(lengths.max())
    width = max(1, math.ceil((hi - lo + 1) / max_bins))
    counts = dict(((lengths - lo) // width).value_counts().iter_rows())
    # every bin from the shortest to the longest, the empty ones too: a gap in the lengths is information
    return [{"from": lo + b * width, "to": lo + b * width + width - 1, "count": int(counts.get(b, 0))}
            for b in range((hi - lo) // width + 1)]


def summarize(loaded: Loaded, frame: pl.DataFrame, *, total_rows: int, warnings: list[str],
              tokens: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-ready statistics of ``frame`` (the selected rows), with the artifacts' schemas and row counts.

    ``tokens``: the token statistics (`rlpipe.reports.token_stats`) when ``frame`` holds the row-level columns
    only and they were streamed (`streamed_view`); else they are taken from ``frame``."""
    cols = set(frame.columns)
    out: dict[str, Any] = {
        "source": loaded.label, "view": loaded.view, "rows_selected": frame.height, "rows_total": total_rows,
        "artifacts": [{"role": role, "path": str(a.path), "artifact": a.metadata.get("artifact"),
                       "rows": loaded.shapes[role][0] if role in loaded.shapes else a.frame.height,
                       "policy_version": a.metadata.get("policy_version"),
                       "columns": {c: str(t) for c, t in (loaded.shapes[role][1] if role in loaded.shapes
                                                          else a.frame.schema).items()}}
                      for role, a in loaded.artifacts.items()],
        "missing": loaded.missing, "warnings": warnings,
    }
    if "reward" in cols:
        out["reward"] = series_stats(frame["reward"])
        out["components"] = {c.removeprefix("reward_"): series_stats(frame[c]) for c in sorted(cols)
                             if c.startswith("reward_")}
    if "correct" in cols:
        judged = frame["correct"].drop_nulls()
        out["accuracy"] = finite_or_none(judged.cast(pl.Float64).mean()) if judged.len() else None
    groups = group_table(frame) if {"prompt_id", "sample_idx", "reward"} <= cols else None
    if groups is not None and (groups["size"] > 1).any():  # one sample per prompt (eval): no groups to describe
        multi = groups.filter(pl.col("size") > 1)
        out["groups"] = {
            "count": groups.height, "size_mean": finite_or_none(groups["size"].mean()),
            "zero_variance_share": (finite_or_none(multi["zero_variance"].cast(pl.Float64).mean()) if multi.height
                                    else None),
            "singletons": groups.height - multi.height,
            "group_mean": series_stats(groups["reward_mean"]),
            "within_group_std_mean": finite_or_none(multi["reward_std"].mean()),
        }
        if "num_correct" in groups.columns:
            counts = groups.group_by("size", "num_correct").len().sort("size", "num_correct")
            out["groups"]["correct_per_group"] = [{"correct": int(k), "of": int(g), "groups": int(n)}
                                                  for g, k, n in counts.iter_rows()]
    if "advantage" in cols:
        out["advantage"] = series_stats(frame["advantage"])
    if tokens is None:
        tokens = token_statistics(frame, token_advantages="advantage" in out and out["advantage"]["count"] == 0)
    if "advantage" in cols and "token_advantage" in tokens:
        # GAE and REINFORCE++ give each token its own advantage: the sequence column is null by design.
        out["token_advantage"] = tokens["token_advantage"]
        estimator = sources.dotted(loaded.params or {}, "advantage.estimator")
        who = f"advantage.estimator {estimator}" if estimator else "this estimator"
        out["advantage_note"] = (f"per token only: {who} gives each token its own advantage, so the "
                                 "sequence-level `advantage` column is empty; rows show the mean of their "
                                 "token advantages")
    if "filtered_reason" in cols:
        reasons = frame["filtered_reason"].drop_nulls().value_counts().sort("filtered_reason")
        out["filtered"] = {r: int(n) for r, n in reasons.iter_rows()}
    if "completion_length" in cols:
        lengths = frame["completion_length"]
        out["length"] = {**series_stats(lengths),
                         "p50": finite_or_none(lengths.quantile(0.5)) if lengths.len() else None,
                         "p90": finite_or_none(lengths.quantile(0.9)) if lengths.len() else None,
                         "histogram": _length_histogram(lengths)}
    if "truncated" in cols:
        out["truncation_rate"] = finite_or_none(frame["truncated"].cast(pl.Float64).mean())
    if "score_error" in cols:
        kinds = frame["score_error"].drop_nulls().str.extract(r"^([^:]+)", 1).value_counts().sort("score_error")
        out["scorer_errors"] = {k: int(n) for k, n in kinds.iter_rows()}
    out.update({k: v for k, v in tokens.items() if k != "token_advantage"})
    turns = turn_summary(frame)
    if turns:
        out["turns"] = turns
    return out


# ----------------------------------------------------------------------------------------------
# The statistics of an iteration too large to hold
# ----------------------------------------------------------------------------------------------
# Why: the joined frame of a 67M-token iteration is 2.4-2.8 GiB (of a 1B-token one, ~40 GiB), but the statistics
# need a few numbers per row (rewards, lengths, flags) and, per token, counts, maxima and sums. So the row-level
# columns are read and joined whole, by `joined_frame` itself, and the token columns a batch of rows at a time, in
# two passes (`token_stats.StreamedTokenStatistics`): the same numbers as the whole frame gives, bit for bit.

STREAM_BATCH_TOKENS = 1 << 22  # completion tokens per batch, about
EXCERPT_KEEP = 81  # characters of a completion `look_here` needs for its excerpt (80, or 79 and an ellipsis)


class NotStreamable(Exception):
    """The tables do not line up row by row, or one is broken: the whole-frame path reads them and says why."""


def row_level_columns(schema: dict[str, pl.DataType]) -> list[str]:
    """An artifact's columns of one value (or a short list: tool calls) per row: not its token lists, nor texts."""
    return [c for c, t in schema.items() if c not in KEYS and c != "completion_text"
            and (not isinstance(t, pl.List) or c == "tool_calls")]


def load_row_level(path: Path, *, eval_view: bool) -> Loaded | None:
    """`load` of a project directory with the row-level columns only (and the prompts whole); None without a
    prompt table (the whole frame's columns then keep their row groups as chunks, which a streamed sum of
    them would not repeat)."""
    params = sources.read_params(path)
    paths = sources.project_paths(params)
    roles = EVAL_ROLES if eval_view else TRAIN_ROLES
    found, missing, shapes = {}, {}, {}
    for role, key, schema in roles:
        file = path / paths[key] if paths.get(key) else None
        if file is None or not file.is_file():
            if file is not None:
                missing[role] = str(file)
            continue
        if role == "prompts":
            found[role] = read_artifact(file, schema)
            continue
        whole = dict(read_artifact(file, schema, rows=(0, 0)).frame.schema)
        shapes[role] = (count_rows(file), whole)
        found[role] = read_artifact(file, schema, columns=row_level_columns(whole))
    if roles[0][0] not in found or "prompts" not in found:
        return None
    return Loaded(label=str(path), view="eval" if eval_view else "train", base=roles[0][0], artifacts=found,
                  missing=missing, model_dirs=_model_dirs(path, paths), root=path, params=params, shapes=shapes)


def token_plan(loaded: Loaded, *, token_advantages: bool) -> list[tuple[str, list[str], list[str]]]:
    """(role, token columns read, list columns whose lengths `join_on_keys` checks) of each joined table, the
    columns a table brings as `joined_frame` takes them (the first table with a column gives it)."""
    base = loaded.artifacts[loaded.base]
    keys = base.frame.select(KEYS)
    wanted = [c for c in TOKEN_COLUMNS if token_advantages or c != "token_advantages"]
    seen: set[str] = set()
    plan = []
    for role, art in loaded.artifacts.items():
        if role == "prompts":
            continue
        if role != loaded.base and not art.frame.select(KEYS).equals(keys):
            if art.frame.select(KEYS).sort(list(KEYS)).equals(keys.sort(list(KEYS))):
                raise NotStreamable(f"{art.path}: rows in another order than {base.path}")
            continue  # not joined: `joined_frame` warned
        schema = loaded.shapes[role][1]
        brings = [c for c in schema if c not in seen]
        seen.update(schema)
        checked = [c for c in brings if isinstance(schema[c], pl.List)] if role != loaded.base else []
        plan.append((role, [c for c in brings if c in wanted], checked))
    return plan


def exact_batches(batches: Iterator[pl.DataFrame], rows: int) -> Iterator[pl.DataFrame]:
    """The frames of ``batches`` cut again into frames of exactly ``rows`` rows (the last one shorter)."""
    pending, size = [], 0
    for batch in batches:
        pending.append(batch)
        size += batch.height
        while size >= rows:
            joined = pl.concat(pending) if len(pending) > 1 else pending[0]
            rest = joined[rows:]
            yield joined[:rows]
            pending, size = ([rest] if rest.height else []), rest.height
    if size:
        yield pl.concat(pending)


def token_batches(loaded: Loaded, plan: list[tuple[str, list[str], list[str]]], lengths: pl.Series | None,
                  rows: int, *, first_pass: bool) -> Iterator[pl.DataFrame]:
    """The joined token columns, ``rows`` rows at a time (and in the first pass the list columns `join_on_keys`
    checks and the completion texts); refused (`NotStreamable`) where the tables disagree."""
    streams = []
    for role, columns, checked in plan:
        art = loaded.artifacts[role]
        read = columns + [c for c in checked if c not in columns] if first_pass else columns
        if first_pass and role == loaded.base and "completion_text" in loaded.shapes[role][1]:
            read = [*read, "completion_text"]
        stream = stream_artifact(art.path, get_schema(str(art.metadata.get("artifact"))), columns=read,
                                 batch_rows=rows)
        streams.append(exact_batches(stream.batches, rows))
    start = 0
    for parts in zip(*streams):
        batch = parts[0]
        for (role, columns, checked), part in zip(plan[1:], parts[1:]):
            if not part.select(KEYS).equals(batch.select(KEYS)):
                raise NotStreamable(f"{loaded.artifacts[role].path}: keys differ from the base table's")
            if first_pass and lengths is not None:
                own = lengths[start:start + part.height]
                for c in checked:
                    if (part[c].is_not_null() & (part[c].list.len() != own)).any():
                        raise NotStreamable(f"{loaded.artifacts[role].path}: column {c!r} disagrees with the lengths")
            batch = batch.hstack(part.select(columns))
        start += batch.height
        yield with_derived_columns(batch)


def streamed_view(target: str | Path, *, eval_view: bool
                  ) -> tuple[Loaded, pl.DataFrame, list[str], dict[str, Any], pl.DataFrame] | None:
    """What `inspect_data` summarises, for a project directory, without holding a token column whole: the
    loaded tables (row-level columns), the joined rows (their per-row token maxima and text excerpts added),
    the warnings, the token statistics, and an empty frame with every column of the whole joined frame (what
    --color-by may name). None where the whole-frame path must read the tables (see `NotStreamable`)."""
    path = Path(target)
    if not path.is_dir():
        return None
    loaded = load_row_level(path, eval_view=eval_view)
    if loaded is None:
        return None
    frame, warnings = joined_frame(loaded)
    advantages_by_token = "advantage" in frame.columns and frame["advantage"].drop_nulls().len() == 0
    try:
        plan = token_plan(loaded, token_advantages=advantages_by_token)
        read = {c: t for role, columns, _ in plan for c, t in loaded.shapes[role][1].items() if c in columns}
        stats = StreamedTokenStatistics(with_derived_columns(pl.DataFrame(schema=read)).columns,
                                        token_advantages=advantages_by_token)
        lengths = frame["completion_length"] if "completion_length" in frame.columns else None
        mean_length = float(lengths.mean() or 1) if lengths is not None and lengths.len() else 1.0
        rows = max(1, int(STREAM_BATCH_TOKENS // max(1.0, mean_length)))
        per_row: dict[str, list[pl.Series]] = {"seq_mismatch_max": [], "seq_log_ratio_max": [], "completion_text": []}
        for batch in token_batches(loaded, plan, lengths, rows, first_pass=True):
            stats.count(batch)
            for name, parts in per_row.items():
                if name in batch.columns:
                    parts.append(batch[name].str.slice(0, EXCERPT_KEEP) if name == "completion_text" else batch[name])
        for batch in token_batches(loaded, plan, lengths, rows, first_pass=False):
            stats.add(batch)
    except (NotStreamable, ArtifactError):
        return None
    joined = {c: t for role, _, _ in plan for c, t in loaded.shapes[role][1].items()}
    whole = with_derived_columns(pl.DataFrame(schema={**joined, **frame.schema}))
    frame = frame.with_columns([pl.concat(parts).alias(name) if parts else pl.Series(name, [], dtype=whole.schema[name])
                                for name, parts in per_row.items() if parts or name in whole.columns])
    return loaded, frame, [*loaded.notes, *warnings], stats.result(), whole


# ----------------------------------------------------------------------------------------------
# Rows to show: decoded prompt and completion, one value per token
# ----------------------------------------------------------------------------------------------

ORDER_NOTES = {
    "informative": "most informative first: mixed-reward groups before zero-variance ones, largest |advantage| "
                   "first; the best and the worst distinct completion of each group, then the next ones",
    "informative_single": "one sample per prompt: lowest reward first, so the wrong answers lead",
    "sorted": "in --sort order",
    "prompt": "every sample of the --prompt-id prompts, in sample order",
}


def select_rows(frame: pl.DataFrame, *, show: int | None, prompt_ids: list[int] | None,
                sorted_by_user: bool = False) -> tuple[pl.DataFrame, str, dict[tuple, list[int]]]:
    """The rows to print, how they were picked (a key of ORDER_NOTES) and each row's identical completions.

    ``--prompt-id``: every sample of those prompts (the first ``show``); ``--sort``: the first ``show``
    rows in that order; otherwise ``show`` rows in informative order, each distinct completion once.
    """
    if prompt_ids:
        if "prompt_id" not in frame.columns:
            raise ArtifactError("--prompt-id: the inspected table has no prompt_id column")
        present = frame["prompt_id"].unique().sort()
        frame = frame.filter(pl.col("prompt_id").is_in(prompt_ids))
        if frame.height == 0:
            asked = ", ".join(map(str, prompt_ids))
            some = ", ".join(map(str, present.head(5).to_list()))
            raise ArtifactError(f"--prompt-id {asked}: no such prompt among the selected rows ({present.len()} "
                                f"prompts{f', e.g. {some}' if some else ''}: an iteration samples "
                                "generate.prompts_per_iteration of the train prompts)")
        return (frame if show is None else frame.head(show)), "prompt", {}
    if sorted_by_user:
        return (frame if show is None else frame.head(show)), "sorted", {}
    rows, dups = informative_order(frame, show)
    return rows, "informative_single" if one_sample_per_prompt(frame) else "informative", dups


SCALAR_FIELDS = ("prompt_id", "sample_idx", "reward", "correct", "advantage", "completion_length", "finish_reason",
                 "num_turns", "environment_error",
                 "truncated", "filtered_reason", "score_error", "completion_text", "answer", "group_size",
                 "group_reward_mean", "group_reward_std", "policy_version", "seq_logprob", "seq_kl_ref",
                 "seq_mismatch_max", "seq_log_ratio_max", "seq_entropy")


def user_columns(loaded: Loaded) -> list[str]:
    """The prompt file's own columns (difficulty, source, ...) that the joined rows hold (schema.PROMPTS)."""
    prompts = loaded.artifacts.get("prompts")
    if prompts is None:
        return []
    return [c for c in prompt_view_columns(prompts.frame.columns) if PROMPTS.is_user_column(c)]


def row_records(rows: pl.DataFrame, *, decoder: TokenDecoder | None, color_by: str | None,
                duplicates: dict[tuple, list[int]] | None = None,
                weights: dict[str, float] | None = None, prompt_columns: list[str] = ()
                ) -> list[dict[str, Any]]:
    """JSON-ready rows: scalar fields, reward components, prompt text, token texts and per-token values.

    ``same_completion`` lists the sample_idx of the group's other samples with identical tokens (only
    when the informative order collapsed them); ``token_advantage_mean`` is set where the estimator
    has no sequence advantage; ``least_likely`` holds the least likely sampled tokens (``least_likely``);
    ``component_weights`` the reward weights (``weights``: component -> weight) when known;
    ``prompt_columns`` holds the row's values of those user columns.
    """
    per_token = [c for c in COLOR_COLUMNS if c in rows.columns]
    records = []
    for row in rows.iter_rows(named=True):
        rec: dict[str, Any] = {k: _json_value(row[k]) for k in SCALAR_FIELDS if k in row}
        rec["same_completion"] = list((duplicates or {}).get((row.get("prompt_id"), row.get("sample_idx")), []))
        rec["prompt_columns"] = {c: _json_value(row[c]) for c in prompt_columns if c in row}
        if row.get("advantage") is None and row.get("token_advantages") is not None:
            tokens = [v for v in row["token_advantages"] if v is not None]
            rec["token_advantage_mean"] = finite_or_none(sum(tokens) / len(tokens)) if tokens else None
        rec["components"] = {k.removeprefix("reward_"): _json_value(v) for k, v in row.items()
                             if k.startswith("reward_")}
        prompt = row.get("prompt")
        if prompt is None and row.get("prompt_token_ids") is not None:
            ids = list(row["prompt_token_ids"])
            prompt = decoder.text(ids) if decoder else " ".join(map(str, ids))
        rec["prompt"] = prompt
        ids = row.get("completion_token_ids")
        if ids is not None:
            ids = list(ids)
            rec["token_ids"] = ids
            rec["tokens"] = decoder.pieces(ids) if decoder else fallback_pieces(row.get("completion_text"), ids)
        mask = row.get("policy_mask")  # observation tokens get no value: only the policy's tokens are coloured
        rec["per_token"] = {c: token_values(row[c], mask) for c in per_token if row[c] is not None}
        rec["least_likely"] = least_likely(rec["per_token"].get("sampler_logprobs"))
        if weights:
            rec["component_weights"] = dict(weights)
        rec["turns"] = turn_records(row)
        rec["color_by"] = color_by
        records.append(rec)
    return records


def token_values(values: list[float | None], mask: list[bool] | None) -> list[float | None]:
    """A per-token column as JSON-ready floats: None where there is no value, the value is not finite,
    or the token is not the policy's (``mask`` false). Vectorised: a page of a whole iteration has millions."""
    array = np.asarray(values, dtype=np.float64)  # None -> NaN
    missing = ~np.isfinite(array)
    if mask is not None:
        missing |= ~np.asarray(mask, dtype=bool)[:array.size]
    out = array.tolist()
    for i in np.flatnonzero(missing).tolist():
        out[i] = None
    return out


def least_likely(logprobs: list[float | None] | None, *, count: int = LEAST_LIKELY_COUNT,
                 below: float = LEAST_LIKELY_BELOW) -> list[dict[str, Any]]:
    """The ``count`` lowest sampled log-probs under ``below``, lowest first (ties: the earlier token first)."""
    ranked = sorted((v, i) for i, v in enumerate(logprobs or []) if v is not None and v < below)
    return [{"position": i, "logprob": v} for v, i in ranked[:count]]


def reward_weights(params: dict[str, Any] | None) -> dict[str, float]:
    """Each reward component's weight from params.yaml's ``score.rewards``, keyed like the ``reward_<name>``
    columns (without the prefix); {} when the params do not say (a single file, an older run)."""
    entries = sources.dotted(params or {}, "score.rewards")
    if not isinstance(entries, list):
        return {}
    out = {}
    for e in entries:
        if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("weight"), (int, float)):
            out[component_column(e["name"]).removeprefix("reward_")] = float(e["weight"])
    return out


def weights_mismatch(frame: pl.DataFrame, weights: dict[str, float]) -> str | None:
    """A warning when ``reward`` is not the weighted sum of the components (params changed since score ran)."""
    columns = {f"reward_{k}": w for k, w in weights.items()}
    if not weights or "reward" not in frame.columns or not set(columns) <= set(frame.columns):
        return None
    rows = frame.filter(pl.all_horizontal([pl.col(c).is_not_null() for c in columns])
                        & (pl.col("score_error").is_null() if "score_error" in frame.columns else pl.lit(True)))
    total = pl.sum_horizontal([pl.col(c) * w for c, w in columns.items()])
    off = rows.filter((pl.col("reward") - total).abs() > 1e-4).height
    if not off:
        return None
    return (f"{off} row(s) have a reward that is not the weighted sum of their components under params.yaml's "
            f"score.rewards weights ({weights}): were the weights changed after `score` ran?")


def _json_value(v: Any) -> Any:
    if isinstance(v, float):
        return finite_or_none(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if v is None or isinstance(v, (str, int, bool)):
        return v
    return str(v)  # a user column's date, time, decimal, bytes...: its text


def inspect_data(target: str | Path, *, eval_view: bool = False, where: str | None = None, sort: str | None = None,
                 descending: bool = False, show: int | None = None, prompt_ids: list[int] | None = None,
                 color_by: str | None = None, tokenizer: str | None = None, rev: str | None = None) -> dict[str, Any]:
    """Everything `rlpipe inspect` shows, as data: ``{"summary", "rows", "groups", "color_by", "tokenizer"}``.

    ``rows`` is empty unless ``show`` or ``prompt_ids`` asks for rows; ``groups`` holds the full-group
    statistics (size, reward mean/std, number correct, distinct completions, rows shown) of every
    prompt that has a shown row. ``summary["run"]`` says where the rows come from (params, policy
    version, git commit) and ``summary["selection"]`` how they were selected and ordered.
    """
    from rlpipe.data.exprs import filter_frame, sort_frame

    statistics_only = show is None and not prompt_ids and not where and not sort and rev is None
    view = streamed_view(target, eval_view=eval_view) if statistics_only else None
    if view is not None:  # the token columns were read a batch at a time: the same numbers, bounded memory
        loaded, full, warnings, tokens, columns = view
    else:
        loaded = load(target, eval_view=eval_view, rev=rev)
        full, warnings = joined_frame(loaded)
        warnings, tokens, columns = [*loaded.notes, *warnings], None, full
    frame = full
    if where:
        frame = filter_frame(frame, where)
    if sort:
        frame = sort_frame(frame, sort, descending=descending)
    summary = summarize(loaded, frame, total_rows=full.height, warnings=warnings, tokens=tokens)
    weights = reward_weights(loaded.params)
    if weights:
        summary["reward_weights"] = weights
        mismatch = weights_mismatch(frame, weights)
        if mismatch:
            summary["warnings"].append(mismatch)
    command = f"rlpipe inspect {target}" + (f" --rev {rev}" if rev else "") + (" --eval" if eval_view else "")
    summary["look_here"] = look_here(frame, command=command)
    base = loaded.artifacts[loaded.base]
    summary["run"] = sources.run_metadata(loaded.root, loaded.params, rev=loaded.rev, base_metadata=base.metadata)
    summary["selection"] = {"where": where, "sort": sort, "descending": bool(sort and descending),
                            "prompt_ids": list(prompt_ids or []), "show": show, "order": None, "order_note": None,
                            "rows_shown": 0}
    result: dict[str, Any] = {"summary": summary, "rows": [], "groups": {}, "color_by": None, "tokenizer": None}
    color = color_column(columns if view is not None else frame, color_by)  # validated even with no row shown
    decoder = find_decoder(loaded.model_dirs, tokenizer) if tokenizer else None
    if show is None and not prompt_ids:
        return result
    decoder = decoder or find_decoder(loaded.model_dirs)
    rows, order, dups = select_rows(frame, show=show, prompt_ids=prompt_ids, sorted_by_user=bool(sort))
    summary["selection"].update(order=order, order_note=ORDER_NOTES[order], rows_shown=rows.height)
    result["rows"] = row_records(rows, decoder=decoder, color_by=color, duplicates=dups, weights=weights,
                                 prompt_columns=user_columns(loaded))
    result["color_by"] = color
    result["tokenizer"] = str(decoder.path) if decoder else None
    if "prompt_id" in full.columns and rows.height:
        shown_pids = rows["prompt_id"].unique().to_list()
        groups = group_table(full.filter(pl.col("prompt_id").is_in(shown_pids)))
        shown = rows.group_by("prompt_id").len()
        shown_count = dict(zip(shown["prompt_id"].to_list(), shown["len"].to_list()))
        result["groups"] = {str(g["prompt_id"]): {**{k: _json_value(v) for k, v in g.items()},
                                                  "shown": shown_count.get(g["prompt_id"], 0)}
                            for g in groups.iter_rows(named=True)}
    return result
