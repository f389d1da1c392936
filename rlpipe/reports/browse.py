"""The query layer of `rlpipe view`: one iteration's Parquet files scanned lazily, one page of rows at a time.

Why lazy: a 65,536-rollout x 1,000-token iteration holds gigabytes of token lists, and the table shows
scalar columns only. A page reads the key, filter and sort columns of every row, then the shown columns of
the page's rows (row groups picked by their key statistics), and never a token list unless a --where or
a sort names a per-token or derived column. A sample's token view reads one row's lists on demand.

The rows are the ones `rlpipe inspect` joins (rlpipe.reports.inspect: the same roles, the same derived
columns), and --where/--sort go through rlpipe.data.exprs exactly as inspect's do, so an expression means
the same in both and every column a table carries (user metadata included) can be filtered on. Unlike
inspect, keys that disagree between artifacts are not checked (a left join leaves nulls): reading every
key of every file would cost the first page its second.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from rlpipe.data.exprs import (
    ExpressionError,
    filter_frame,
    parse_expression,
    sort_frame,
)
from rlpipe.data.io import count_rows, read_metadata
from rlpipe.data.schema import SCHEMA_VERSION, get_schema
from rlpipe.errors import ArtifactError, RlpipeError
from rlpipe.reports import sources
from rlpipe.reports.inspect import (
    EVAL_ROLES,
    KEYS,
    TRAIN_ROLES,
    read_project_paths,
    with_derived_columns,
)

PREVIEW_CHARS = 240  # of each text column in the table; the token view shows the whole text
SEARCH_CONTEXT = 80  # characters shown before a search hit
MAX_PAGE = 500
# Shown first when present, in this order; every other scalar column follows in the tables' order.
LEADING = ("prompt_id", "sample_idx", "reward", "correct", "advantage", "completion_text", "completion_length",
           "finish_reason", "truncated", "prompt", "answer")


@dataclass(frozen=True)
class Iteration:
    """Where one iteration's rows are: role -> Parquet file (the base table first), and how to decode them."""

    label: str
    view: str  # "train" | "eval" | the artifact kind of a single file
    base: str
    files: dict[str, Path]
    root: Path | None = None
    rev: str | None = None
    model_dirs: list[Path] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # role -> path that does not exist
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> footer
    keys: tuple[str, ...] = KEYS  # of the base table: a single prompts file has prompt_id alone


@dataclass(frozen=True)
class Query:
    """One request for a page: the same --where and --sort inspect takes, a text search and the page's window."""

    where: str | None = None
    sort: str | None = None
    descending: bool = False
    search: str | None = None
    offset: int = 0
    limit: int = 50


def open_iteration(target: str | Path, *, rev: str | None = None, eval_view: bool = False,
                   workdir: Path | None = None) -> Iteration:
    """A project directory's iteration (at git revision ``rev``: files from DVC's cache) or one artifact file.

    ``workdir`` holds artifacts read out of git or a DVC remote (those not in the local cache) for ``rev``.
    Only footers are read here, so a wrong file is named before the server starts.
    """
    path = Path(target)
    if not path.exists():
        raise ArtifactError(f"{path}: no such file or directory")
    if path.is_file():
        if rev is not None:
            raise ArtifactError(f"--rev {rev}: give the project directory, not a file ({path})")
        meta = read_metadata(path)
        try:
            schema = get_schema(str(meta.get("artifact")))
        except KeyError:
            raise ArtifactError(f"{path}: footer names unknown artifact {meta.get('artifact')!r}") from None
        checked_footer(path, schema.name)
        project = next((d for d in path.resolve().parents if (d / "params.yaml").is_file()), None)
        return Iteration(label=str(path), view=schema.name, base=schema.name, files={schema.name: path},
                         metadata={schema.name: meta}, keys=tuple(schema.keys),
                         model_dirs=project_model_dirs(project) if project else [])
    if rev is not None:
        rev = sources.resolve_revision(path, rev, or_directory=False)
    paths = sources.project_paths(sources.read_params(path, rev))
    roles = EVAL_ROLES if eval_view else TRAIN_ROLES
    files, missing, metadata = {}, {}, {}
    for role, key, schema in roles:
        rel = paths.get(key)
        if not rel:
            continue
        file = path / rel if rev is None else artifact_file_at(path, rev, rel, workdir)
        if file is None or not file.is_file():
            missing[role] = str(file or f"{rev}:{rel}")
            continue
        files[role], metadata[role] = file, checked_footer(file, schema.name)
    base = roles[0][0]
    if base not in files:
        where = f" at revision {rev}" if rev else ""
        raise ArtifactError(f"{missing.get(base, base)}: not found{where}; run `dvc repro` (or `dvc checkout`, "
                            "`dvc fetch`) first")
    return Iteration(label=f"{path}@{rev}" if rev else str(path), view="eval" if eval_view else "train", base=base,
                     files=files, root=path, rev=rev, model_dirs=project_model_dirs(path), missing=missing,
                     metadata=metadata)


def checked_footer(file: Path, artifact: str) -> dict[str, Any]:
    """``file``'s rlpipe footer, refused (naming the file) when it holds another artifact or schema version."""
    meta = read_metadata(file)
    if meta.get("artifact") != artifact:
        raise ArtifactError(f"{file}: holds artifact {meta.get('artifact')!r}, expected {artifact!r}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"{file}: schema version {meta.get('schema_version')} but this rlpipe reads version "
                            f"{SCHEMA_VERSION}; re-run the stage that produced it")
    return meta


def project_model_dirs(root: Path) -> list[Path]:
    """Where the workspace's tokenizer may be (the policy, the model, the checkpoint): a project's tokenizer
    does not change between iterations, so other revisions and single files use it too."""
    try:
        paths = read_project_paths(root)
    except ArtifactError:
        return []
    return [root / paths[k] for k in ("policy", "model_dir", "checkpoint") if paths.get(k)]


@functools.lru_cache(maxsize=8)
def dvc_cache_dir(root: Path) -> Path:
    """The project's DVC cache (`dvc cache dir`: it may be configured elsewhere, e.g. a shared disk)."""
    from rlpipe.run.gc import cache_dir

    try:
        return cache_dir(root)
    except (RlpipeError, OSError):  # no dvc executable, or not a DVC project: the default place
        return root / ".dvc" / "cache"


def artifact_file_at(root: Path, rev: str, rel: str, workdir: Path | None) -> Path | None:
    """The Parquet file of ``rel`` at ``rev``: the local DVC cache's object itself when it is there (nothing
    copied, so a 2 GB table opens as fast as the workspace's), else the bytes read through DVC into ``workdir``
    (a file committed to git, or one only in a DVC remote)."""
    from rlpipe.run.gc import object_path, revision_outs

    md5 = dict(revision_outs(root, rev)).get(rel)
    if md5:
        cached = object_path(dvc_cache_dir(root), md5)
        if cached.is_file():
            return cached
    if workdir is None:
        return None
    try:
        import dvc.api

        data = dvc.api.read(rel, repo=str(root), rev=rev, mode="rb")
    except Exception:  # noqa: BLE001 - DVC raises many types (not in the cache, no remote, not tracked, ...)
        return None
    out = workdir / rev / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def iteration_warnings(it: Iteration) -> list[str]:
    """What a reader should know before trusting the join: artifacts written for another policy version."""
    base_version = it.metadata.get(it.base, {}).get("policy_version")
    out = [f"{role}: not found ({path})" for role, path in it.missing.items()]
    for role, meta in it.metadata.items():
        version = meta.get("policy_version")
        if role not in (it.base, "prompts") and None not in (version, base_version) and version != base_version:
            out.append(f"{role} ({it.files[role]}) is for policy version {version} but {it.base} is for "
                       f"{base_version}: stale? run `dvc repro`")
    return out


def scan(it: Iteration, *, prompt_ids: list[Any] | None = None) -> pl.LazyFrame:
    """Every artifact joined lazily onto the base table on the keys, plus inspect's derived columns.

    ``prompt_ids``: read only those prompts' rows; the files are sorted by key, so the Parquet reader skips
    every row group whose prompt_id statistics leave them out.
    """
    def scan_one(file: Path) -> pl.LazyFrame:
        lf = pl.scan_parquet(file)
        return lf if prompt_ids is None else lf.filter(pl.col("prompt_id").is_in(prompt_ids))

    frame = scan_one(it.files[it.base])
    names = set(frame.collect_schema().names())
    for role, file in it.files.items():
        if role in (it.base, "prompts"):
            continue
        other = scan_one(file)
        columns = [c for c in other.collect_schema().names() if c not in names]
        if columns and set(KEYS) <= names:
            frame = frame.join(other.select(*KEYS, *columns), on=list(KEYS), how="left", maintain_order="left")
            names |= set(columns)
    if "prompts" in it.files and "prompt_id" in names:
        prompts = pl.scan_parquet(it.files["prompts"]).select("prompt_id", "prompt", "answer")
        columns = [c for c in ("prompt", "answer") if c not in names]
        if columns:
            frame = frame.join(prompts.select("prompt_id", *columns), on="prompt_id", how="left",
                               maintain_order="left")
    return with_derived_columns(frame)


def is_scalar(dtype: pl.DataType) -> bool:
    return not isinstance(dtype, (pl.List, pl.Array, pl.Struct))


def table_columns(it: Iteration) -> dict[str, str]:
    """The table's columns and dtypes: every stored scalar column (derived ones need token lists: not shown,
    but they can still be filtered and sorted on), the LEADING ones first."""
    stored = scan(it).collect_schema()
    scalars = [c for c, t in stored.items() if is_scalar(t) and not c.startswith("seq_")]
    ordered = [c for c in LEADING if c in scalars] + [c for c in scalars if c not in LEADING]
    return {c: str(stored[c]) for c in ordered}


def column_docs(it: Iteration) -> dict[str, str]:
    """What each stored column means, from rlpipe.data.schema (the one place it is written), with the table
    holding it: the table header's tooltips. A key column is described by the base table."""
    docs: dict[str, str] = {}
    for role, meta in it.metadata.items():
        schema = get_schema(str(meta.get("artifact")))
        for column in schema.columns:
            docs.setdefault(column.name, f"{column.doc} ({schema.name}, written by {schema.owner})")
        if schema.dynamic_prefix:
            names = pl.scan_parquet(it.files[role]).collect_schema().names()
            docs.update({c: f"{schema.dynamic_doc} ({schema.name}, written by {schema.owner})" for c in names
                         if c.startswith(schema.dynamic_prefix) and c not in docs})
    return docs


def filter_columns(it: Iteration) -> dict[str, str]:
    """Every column a --where can name (per-token lists included), with its dtype."""
    return {c: str(t) for c, t in scan(it).collect_schema().items()}


def selected(it: Iteration, query: Query) -> pl.LazyFrame:
    """The rows of ``query`` in its order, lazily; bad input raises ExpressionError naming the problem.

    The --where and --sort are checked by inspect's own functions on an empty frame of the same schema,
    so a mistake gives the message `rlpipe inspect` gives, before anything is read.
    """
    frame = scan(it)
    empty = pl.DataFrame(schema=frame.collect_schema())
    if query.where:
        filter_frame(empty, query.where)
        frame = frame.filter(parse_expression(query.where))
    if query.search:
        if "completion_text" not in empty.columns:
            raise ExpressionError(f"search {query.search!r}: the {it.base} table has no completion_text column")
        frame = frame.filter(pl.col("completion_text").str.contains(f"(?i){re.escape(query.search)}"))
    if query.sort:
        sort_frame(empty, query.sort, descending=query.descending)
        frame = frame.sort(query.sort, descending=query.descending, nulls_last=True, maintain_order=True)
    return frame


def _collect(frame: pl.LazyFrame, query: Query) -> pl.DataFrame:
    """Collect, reporting what polars finds only at run time (a type that does not fit) as the user's mistake."""
    try:
        return frame.collect()
    except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError, pl.exceptions.SchemaError) as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ExpressionError(f"--where {query.where!r}: {type(e).__name__}: {first}") from None


def page(it: Iteration, query: Query) -> dict[str, Any]:
    """One page of the table: ``{"columns", "rows", "matched", "total", "offset", "limit"}``, rows as dicts.

    Two passes: the page's keys from the key/filter/sort columns of every row, then the shown columns of
    those rows only. Text columns are cut to PREVIEW_CHARS (``*_chars`` says each one's full length).
    """
    if not 1 <= query.limit <= MAX_PAGE or query.offset < 0:
        raise ExpressionError(f"limit must be 1..{MAX_PAGE} and offset >= 0 (got limit {query.limit}, "
                              f"offset {query.offset})")
    rows = selected(it, query)
    total = count_rows(it.files[it.base])
    unfiltered = not (query.where or query.search)
    matched = total if unfiltered else int(_collect(rows.select(pl.len()), query).item())
    keys = _collect(rows.select(it.keys).slice(query.offset, query.limit), query).with_row_index("_order")
    columns = table_columns(it)
    shown = _page_rows(it, keys, columns, search=query.search)
    return {"columns": columns, "rows": shown, "matched": matched, "total": total, "offset": query.offset,
            "limit": query.limit}


def _page_rows(it: Iteration, keys: pl.DataFrame, columns: dict[str, str], *,
               search: str | None) -> list[dict[str, Any]]:
    """The shown columns of the page's rows, text cut to PREVIEW_CHARS: from the start, or, when searching,
    from SEARCH_CONTEXT characters before the first hit (``completion_text_from`` says where)."""
    if keys.height == 0:
        return []
    frame = scan(it, prompt_ids=keys["prompt_id"].unique().to_list())
    texts = [c for c, t in columns.items() if t == "String"]
    start = {c: pl.lit(0) for c in texts}
    if search and "completion_text" in texts:
        prefix = pl.col("completion_text").str.extract(f"(?is)^(.*?){re.escape(search)}", 1)
        before = prefix.str.len_chars().cast(pl.Int64)  # characters, not bytes (str.find counts bytes)
        start["completion_text"] = (before - SEARCH_CONTEXT).clip(lower_bound=0).fill_null(0)
    exprs = [pl.col(c).str.slice(start[c], PREVIEW_CHARS) if c in texts else pl.col(c) for c in columns]
    exprs += [pl.col(c).str.len_chars().alias(f"{c}_chars") for c in texts]
    if search and "completion_text" in texts:
        exprs.append(start["completion_text"].alias("completion_text_from"))
    rows = frame.select(exprs).join(keys.lazy(), on=list(it.keys), how="inner").sort("_order").drop("_order").collect()
    return [{k: json_value(v) for k, v in r.items()} for r in rows.iter_rows(named=True)]


def json_value(v: Any) -> Any:
    """A cell as JSON holds it: NaN/inf as null, anything else polars gives (dates, decimals) as text."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


def sample_row(it: Iteration, prompt_id: int, sample_idx: int) -> pl.DataFrame:
    """One sample with every column (token lists too): what its token view draws; LookupError if absent."""
    if "sample_idx" not in it.keys:
        raise ArtifactError(f"{it.label}: a {it.base} table has no samples to draw")
    row = scan(it, prompt_ids=[prompt_id]).filter(pl.col("sample_idx") == sample_idx).collect()
    if row.height == 0:
        raise LookupError(f"no sample (prompt_id {prompt_id}, sample_idx {sample_idx}) in {it.label}")
    return row


# ----------------------------------------------------------------------------------------------
# One prompt across iterations
# ----------------------------------------------------------------------------------------------

HISTORY_COLUMNS = ("sample_idx", "reward", "correct", "advantage", "completion_length", "finish_reason",
                   "completion_text")


def iteration_revisions(root: Path) -> list[str]:
    """The tagged iterations of a project (``iteration-N``, oldest first); [] outside git."""
    if sources.git(root, "rev-parse", "--git-dir").returncode != 0:
        return []
    tags = sources.git(root, "tag", "--list", "iteration-*").stdout.split()
    numbered = sorted((int(m.group(1)), t) for t in tags if (m := re.fullmatch(r"iteration-(\d+)", t)))
    return [t for _, t in numbered]


def workspace_tag(root: Path) -> str | None:
    """The iteration tag the workspace is, when it is one: HEAD carries it and nothing tracked has changed
    (dvc.lock records the artifacts, so new outputs show as a change). None: the workspace is new."""
    state = sources.git_state(root)
    if state is None or state["uncommitted_changes"]:
        return None
    return next((t for t in reversed(iteration_revisions(root)) if t in state["tags"]), None)


def prompt_rows(it: Iteration, prompt_id: int) -> list[dict[str, Any]]:
    """Every sample of one prompt in one iteration: the HISTORY_COLUMNS it has, text cut to PREVIEW_CHARS."""
    frame = scan(it, prompt_ids=[prompt_id])
    names = frame.collect_schema().names()
    exprs = [pl.col(c).str.slice(0, PREVIEW_CHARS) if c == "completion_text" else pl.col(c)
             for c in HISTORY_COLUMNS if c in names]
    rows = frame.select(exprs).sort("sample_idx").collect()
    return [{k: json_value(v) for k, v in r.items()} for r in rows.iter_rows(named=True)]


def history_columns(it: Iteration) -> dict[str, str]:
    """The HISTORY_COLUMNS an iteration has, with their dtypes (so 1.0 is drawn as a float, not as 1)."""
    schema = scan(it).collect_schema()
    return {c: str(schema[c]) for c in HISTORY_COLUMNS if c in schema}


def prompt_history(iterations: list[tuple[str, Iteration | str]], prompt_id: int) -> list[dict[str, Any]]:
    """One prompt in each iteration: ``[{"iteration", "policy_version", "columns", "rows", "note"}]``.

    ``iterations`` pairs a name with an opened iteration, or with the reason it could not be opened
    (shown as the note). A prompt absent from an iteration (not sampled then) gets no rows and says so.
    """
    out = []
    for name, it in iterations:
        if isinstance(it, str):
            out.append({"iteration": name, "policy_version": None, "columns": {}, "rows": [], "note": it})
            continue
        rows = prompt_rows(it, prompt_id)
        out.append({"iteration": name, "policy_version": it.metadata.get(it.base, {}).get("policy_version"),
                    "columns": history_columns(it), "rows": rows, "note": None if rows else f"prompt {prompt_id} was not sampled in this iteration"})
    return out
