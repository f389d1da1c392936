"""The rollout view: each per-sample row with its prompt's columns (rendered text, answer, the user's columns).

Why a view and not columns of the per-sample tables: a rollout table holds G samples per prompt and, at scale,
67M-1B tokens. A prompt's text repeated G times costs more than its token ids do once, and written into
rollouts, scores and eval rollouts alike it would be stored three times over, and re-written whenever a stage
re-runs. The prompt tables hold each prompt once, with the user's columns typed as the file gave them
(schema.PROMPTS), and every per-sample table carries ``prompt_id``: one join gives every row its prompt's
columns, with no copy on disk and nothing for generate or score to carry through.

The one definition, in SQL that polars (`pl.SQLContext`, `scan_view`) and DuckDB run alike:

    SELECT s.*, p.* EXCLUDE (prompt_id, prompt_token_ids, metadata)
    FROM samples s LEFT JOIN prompts p USING (prompt_id)

``samples`` is any table keyed by (prompt_id, sample_idx) (rollouts, scores, eval rollouts, or several joined
on the keys), ``prompts`` the prompt table it was drawn from. `rlpipe inspect` joins the same columns
(`with_prompt_columns`), so a ``--where`` on ``difficulty`` means the same thing in all three.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

# Prompt-table columns the view leaves out: the sample tables have their own token ids; the JSON of every
# field is what reward functions read, its fields being typed columns of their own.
LEFT_OUT = ("prompt_token_ids", "metadata")


def view_sql(samples: str, prompts: str) -> str:
    """The view's SQL over two tables (names, or DuckDB's quoted Parquet paths)."""
    return (f"SELECT s.*, p.* EXCLUDE (prompt_id, {', '.join(LEFT_OUT)}) "
            f"FROM {samples} s LEFT JOIN {prompts} p USING (prompt_id)")


def prompt_view_columns(columns: Sequence[str]) -> list[str]:
    """The prompt-table columns the view adds to each sample row, in the table's order."""
    return [c for c in columns if c != "prompt_id" and c not in LEFT_OUT]


def with_prompt_columns(samples: pl.DataFrame, prompts: pl.DataFrame) -> pl.DataFrame:
    """``samples`` (rows in their order) with their prompt's view columns; null where the prompt is not found."""
    return samples.join(prompts.select("prompt_id", *prompt_view_columns(prompts.columns)), on="prompt_id",
                        how="left", maintain_order="left")


def scan_view(samples: str | Path, prompts: str | Path) -> pl.LazyFrame:
    """The view over two Parquet files, lazily: ``scan_view(rollouts, train_prompts).filter(...)``."""
    context = pl.SQLContext(samples=pl.scan_parquet(samples), prompts=pl.scan_parquet(prompts))
    return context.execute(view_sql("samples", "prompts"))
