"""The score stage's logic: run the configured reward functions on every rollout row.

A reward function that raises on one row marks that row (``score_error``, fallback reward) rather
than killing a stage that may have scored a million rows; only when more than
``max_error_fraction`` of rows failed does the stage stop, since then the reward itself is broken.

With ``workers > 1`` a thread pool scores several rows at once (worth it when a reward waits on
a subprocess, as `code_tests` does); rows are still assembled in input order, so the table and
metrics are the same for any worker count. Rewards run from several threads must be thread-safe
(the built-in ones are pure functions).

Batch rewards (`rlpipe.rewards.batch_reward`, e.g. `reward_model`) run first, once, on the main
thread with every row; the per-row pass then takes each row's value from them, so their values
too are the same for any worker count. A batch reward that raises stops the stage (the error
concerns every row); one that returns a non-finite value marks that row like a per-row reward.
With no batch reward configured nothing of this runs: rows stream through as before.

``row_timeout_s`` bounds the wall clock of one row (all its rewards): the call runs in a daemon
thread, and past the limit the row becomes a ``TimeoutError`` row error and the stage moves on.
Python cannot kill a thread, so a reward that truly hangs keeps its thread (and whatever it holds)
busy until the stage's process exits; a hung pure-Python loop also competes for the GIL. Rewards
that run untrusted code should bound themselves in a process, as `code_tests` does (its own
wall-clock and CPU limits, see docs/reliability.md); the row timeout is the backstop for any other.
"""
from __future__ import annotations

import functools
import json
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import polars as pl

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.data.lists import TokenIds, row_arrays
from rlpipe.data.quantiles import quantile_summary
from rlpipe.data.schema import ROLLOUTS
from rlpipe.errors import ArtifactError, ConfigError, InfrastructureError, RlpipeError, ScoringError
from rlpipe.rewards.base import Sample
from rlpipe.rewards.functions import REWARD_FUNCTIONS
from rlpipe.rewards.registry import (RewardSpec, batch_values, component_columns, is_batch_reward, prepare_rewards,
                                     reward_error_text, score_sample_details, user_code_line)


def reward_specs(entries: tuple[RewardEntry, ...]) -> list[RewardSpec]:
    return [RewardSpec(name=e.name, weight=e.weight, options=dict(e.options)) for e in entries]


def load_reward_functions(cfg: ScoreConfig) -> tuple[list[RewardSpec], list[Any], dict[str, str]]:
    """Resolve and check every reward before scoring a row; config mistakes become ConfigError."""
    specs = reward_specs(cfg.rewards)
    try:
        fns = prepare_rewards(specs)
        columns = component_columns(specs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"score.rewards: {e}") from None
    if cfg.accuracy_reward not in columns:
        raise ConfigError(f"score.accuracy_reward: {cfg.accuracy_reward!r} is not one of the configured rewards "
                          f"{list(columns)}")
    return specs, fns, columns


def score_rows(rows: pl.DataFrame, cfg: ScoreConfig, *, progress: Any = None, messages_field: str | None = None
               ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Score rows holding prompt, completion_text, answer, metadata, completion_length, truncated
    (and prompt_token_ids, completion_token_ids where a reward needs tokens, e.g. `reward_model`).

    Returns the key columns plus reward, correct, score_error and one ``reward_<name>`` column per
    component, and metrics (means per component, error counts by exception type, and per component
    the counts of the detail labels its `RewardResult`s carried, e.g. code_tests' failure kinds).
    ``progress``: optional callback, called with 1 per row (see rlpipe.progress). ``messages_field``: for
    conversational prompts, the metadata field holding each prompt's messages (the prompt table's footer
    `rlpipe.data.schema.PROMPT_MESSAGES_KEY`); rewards then get `Sample.prompt_messages`.
    """
    return score_batches([rows], cfg, progress=progress, messages_field=messages_field)


def score_batches(batches: Iterable[pl.DataFrame], cfg: ScoreConfig, *, progress: Any = None,
                  messages_field: str | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """`score_rows` over the rows of every batch, in order: one batch in memory at a time (the stage reads
    the rollouts a batch at a time, `rlpipe.data.io.stream_artifact`). A batch reward (the reward model)
    sees one batch of rows per call."""
    specs, fns, columns = load_reward_functions(cfg)
    tally = _Tally(columns, cfg)
    keys = []
    for rows in batches:
        precomputed = _batch_rewards(rows, specs, fns, messages_field)
        score_one = functools.partial(_score_row, specs=specs, fns=fns, timeout_s=cfg.row_timeout_s,
                                      precomputed=precomputed, messages_field=messages_field)
        for result in _ordered_map(score_one, enumerate(row_dicts(rows)), cfg.workers):
            if progress is not None:
                progress(1)
            tally.add(result)
        keys.append(rows.select("prompt_id", "sample_idx"))
    frame = tally.frame(pl.concat(keys) if keys else pl.DataFrame(schema={"prompt_id": pl.Int64,
                                                                           "sample_idx": pl.Int32}))
    num_errors = sum(tally.errors_by_kind.values())
    error_fraction = num_errors / max(frame.height, 1)
    if error_fraction > cfg.max_error_fraction:
        example = frame.filter(pl.col("score_error").is_not_null()).row(0, named=True)
        raise ScoringError(
            f"{num_errors} of {frame.height} rows ({error_fraction:.1%}) failed in a reward function, more than "
            f"score.max_error_fraction={cfg.max_error_fraction}; first error at prompt_id={example['prompt_id']} "
            f"sample_idx={example['sample_idx']}: {example['score_error']}")
    metrics = score_metrics(frame, columns, tally.errors_by_kind, tally.details)
    info = reward_info(specs, fns)
    if info:
        metrics["reward_info"] = info
    return frame, metrics


class _Tally:
    """Every row's reward, accuracy, error and components as they come, and the error and label counts."""

    def __init__(self, columns: dict[str, str], cfg: ScoreConfig):
        self.columns, self.cfg = columns, cfg
        self.out: dict[str, list] = {"reward": [], "correct": [], "score_error": []}
        self.out.update({col: [] for col in columns.values()})
        self.errors_by_kind: dict[str, int] = {}
        self.details: dict[str, dict[str, int]] = {}

    def add(self, result: tuple | Exception) -> None:
        out, cfg = self.out, self.cfg
        if isinstance(result, Exception):  # a reward raised on this row
            kind = type(result).__name__
            self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1
            out["reward"].append(cfg.fallback_reward)
            out["correct"].append(None)
            out["score_error"].append(reward_error_text(result))
            for col in self.columns.values():
                out[col].append(None)
            return
        components, total, row_details = result
        for name, label in row_details.items():
            self.details.setdefault(name, {})
            self.details[name][label] = self.details[name].get(label, 0) + 1
        out["reward"].append(float(total))
        out["correct"].append(bool(components[cfg.accuracy_reward] >= 1.0))
        out["score_error"].append(None)
        for name, col in self.columns.items():
            out[col].append(float(components[name]))

    def frame(self, keys: pl.DataFrame) -> pl.DataFrame:
        out = dict(self.out)
        return keys.with_columns(
            pl.Series("reward", out.pop("reward"), dtype=pl.Float64),
            pl.Series("correct", out.pop("correct"), dtype=pl.Boolean),
            pl.Series("score_error", out.pop("score_error"), dtype=pl.String),
            *[pl.Series(col, vals, dtype=pl.Float64) for col, vals in out.items()],
        )


def reward_info(specs: list[RewardSpec], fns: Any) -> dict[str, Any]:
    """Per reward that offers one (a ``run_info(**options)`` attribute, e.g. code_tests' sandbox
    protections on this host), what it says about how it scored; {} when none does."""
    return {spec.name: fns[spec.name].run_info(**spec.options) for spec in specs
            if callable(getattr(fns[spec.name], "run_info", None))}


# what a reward reads of a rollout (plus the prompt's text, answer and metadata); log-probs and masks stay on disk
SCORED_ROLLOUT_COLUMNS = ["prompt_token_ids", "completion_token_ids", "completion_text", "completion_length",
                          "finish_reason", "truncated", "turn_texts", "turn_rewards", "tool_calls", "environment_error"]
TOKEN_ID_COLUMNS = ("prompt_token_ids", "completion_token_ids")
# built-in rewards that never read the token ids (the reward model does; a reward of your own may)
REWARDS_WITHOUT_TOKEN_IDS = frozenset(REWARD_FUNCTIONS) - {"reward_model"}


def scored_rollout_columns(cfg: ScoreConfig) -> list[str]:
    """The rollout columns score reads: without the token ids when no configured reward can read them.

    Why: the ids are most of a rollout table (at 67M tokens, 85% of what score would read), and only the
    reward model and rewards of your own see them; with neither, `Sample`'s ids are None.
    """
    if all(entry.name in REWARDS_WITHOUT_TOKEN_IDS for entry in cfg.rewards):
        return [c for c in SCORED_ROLLOUT_COLUMNS if c not in TOKEN_ID_COLUMNS]
    return list(SCORED_ROLLOUT_COLUMNS)


def row_dicts(rows: pl.DataFrame) -> Iterator[dict[str, Any]]:
    """Each row as a dict, its token ids as `TokenIds` views: no Python int per token unless a reward reads them
    (and no per-token column it never reads)."""
    ids = {c: row_arrays(rows[c], np.int64) for c in TOKEN_ID_COLUMNS if c in rows.columns}
    unread = [c for c in rows.columns if c in ids or c in ROLLOUTS.per_token_columns]
    for i, row in enumerate(rows.drop(unread).iter_rows(named=True)):
        for column, arrays in ids.items():
            row[column] = TokenIds(arrays[i])
        yield row


def _sample(row: dict[str, Any], messages_field: str | None = None) -> Sample:
    """A reward's view of a row; a multi-turn rollout is judged on its final model turn (``turns[-1]``).
    ``messages_field``: the metadata field of a conversational prompt's messages (None: prompt strings)."""
    turns = row.get("turn_texts")
    metadata = json.loads(row["metadata"]) if row["metadata"] else {}
    return Sample(prompt=row["prompt"], completion=turns[-1] if turns else row["completion_text"],
                  answer=row["answer"], metadata=metadata,
                  prompt_messages=None if messages_field is None else metadata[messages_field],
                  completion_tokens=row["completion_length"], truncated=row["truncated"],
                  prompt_token_ids=row.get("prompt_token_ids"), completion_token_ids=row.get("completion_token_ids"),
                  turns=turns, tool_calls=row.get("tool_calls"), turn_rewards=row.get("turn_rewards"))


def _batch_rewards(rows: pl.DataFrame, specs: list[RewardSpec], fns: Any, messages_field: str | None
                   ) -> dict[str, list[float | Exception]]:
    """Every batch reward's per-row values (or per-row errors), by spec name; {} when none is configured."""
    batch_specs = [spec for spec in specs if is_batch_reward(fns[spec.name])]
    if not batch_specs:
        return {}
    samples = [_sample(row, messages_field) for row in row_dicts(rows)]
    out = {}
    for spec in batch_specs:
        try:
            out[spec.name] = batch_values(samples, spec, fns[spec.name])
        except RlpipeError:
            raise  # names the file or setting at fault already
        except Exception as e:  # noqa: BLE001 - user code; the message names the reward and its line
            where = user_code_line(e)
            raise ScoringError(f"batch reward {spec.name!r} failed on the whole batch of {len(samples)} rows: "
                               f"{type(e).__name__}: {e}{f' (at {where})' if where else ''}"
                               f"{_first_failing_row(rows, samples, spec, fns[spec.name])}") from e
    return out


FAILING_ROW_SEARCH = 256  # rows a failed batch reward is tried on alone, to name the first one it fails on


def _first_failing_row(rows: pl.DataFrame, samples: list[Sample], spec: RewardSpec, fn: Any) -> str:
    """"; first failing row: prompt_id P, sample_idx S, completion '...'" for the first of the first
    FAILING_ROW_SEARCH rows the reward raises on alone, else "" (it fails only on the batch, or later)."""
    for i, sample in enumerate(samples[:FAILING_ROW_SEARCH]):
        try:
            fn([sample], **spec.options)
        except Exception:  # noqa: BLE001 - the reward's own error: what this search looks for
            excerpt = sample.completion if len(sample.completion) <= 80 else sample.completion[:77] + "..."
            return (f"; first failing row: prompt_id {rows['prompt_id'][i]}, sample_idx {rows['sample_idx'][i]}, "
                    f"completion {excerpt!r}")
    return ""


def _score_row(item: tuple[int, dict[str, Any]], specs: list[RewardSpec], fns: Any, timeout_s: float | None,
               precomputed: dict[str, list[float | Exception]], messages_field: str | None = None
               ) -> tuple | Exception:
    """One row's (components, total, details), or the exception a reward raised on it (or a TimeoutError).

    ``item`` is (row index, row); ``precomputed`` holds the batch rewards' values of every row.
    """
    i, row = item
    if row.get("finish_reason") == "infra_error":  # the environment failed, not the model: never a reward
        return InfrastructureError(f"the environment failed, not the model: {row.get('environment_error')}")
    sample = _sample(row, messages_field)
    args = (sample, specs, fns, {name: values[i] for name, values in precomputed.items()})
    if timeout_s is None:
        return _caught(score_sample_details, *args)
    box: list = []
    worker = threading.Thread(target=lambda: box.append(_caught(score_sample_details, *args)),
                              name="score-row", daemon=True)  # daemon: a hung reward cannot block the exit
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive() or not box:
        return TimeoutError(f"the row's rewards ran past score.row_timeout_s={timeout_s} s and were abandoned")
    return box[0]


def _caught(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure of user code is a per-row error
        return e


def _ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> Iterator[Any]:
    """fn over items, results in input order; with workers > 1 on a thread pool, at most 4 x workers in flight."""
    if workers == 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="score") as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def score_metrics(frame: pl.DataFrame, columns: dict[str, str], errors_by_kind: dict[str, int],
                  details: dict[str, dict[str, int]]) -> dict[str, Any]:
    # a NaN reward (score.fallback_reward: .nan, for advantage.nan_rewards: zero_advantage) is unscorable:
    # it is counted, and left out of the mean and std
    scored = frame["reward"].fill_nan(None).drop_nulls()
    return {
        "num_samples": frame.height,
        "reward_mean": float(scored.mean()) if scored.len() else 0.0,
        "reward_std": float(scored.std()) if scored.len() > 1 else 0.0,
        "reward_quantiles": quantile_summary(scored),  # the per-iteration distribution chart (dvc.yaml plots)
        "unscorable": frame.height - scored.len(),
        "accuracy": float(frame["correct"].mean()) if frame["correct"].null_count() < frame.height else None,
        "components": {name: float(frame[col].mean()) if frame[col].null_count() < frame.height else None
                       for name, col in columns.items()},
        "errors": sum(errors_by_kind.values()),
        "errors_by_kind": dict(sorted(errors_by_kind.items())),
        "details": {name: dict(sorted(details[name].items())) for name in columns if name in details},
    }


def rows_to_score(rollouts: pl.DataFrame, prompts: pl.DataFrame, *, rollouts_path: str, prompts_path: str
                  ) -> pl.DataFrame:
    """Every rollout row (of a batch) with its prompt's text, answer and metadata (what a reward reads); a
    rollout whose prompt_id the prompt table lacks is an error naming both files."""
    rows = rollouts.join(prompts.select("prompt_id", "prompt", "answer", "metadata"), on="prompt_id",
                               how="left")
    missing = rows.filter(rows["prompt"].is_null())
    if missing.height:
        raise ArtifactError(f"{rollouts_path}: {missing.height} row(s) have a prompt_id not in {prompts_path}, "
                            f"e.g. {missing['prompt_id'][0]}")
    return rows
