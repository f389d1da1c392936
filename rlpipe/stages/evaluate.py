"""The evaluate stage's logic: greedy answers of a policy on held-out prompts, judged like training rewards."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import polars as pl

from rlpipe.config import EvaluateConfig, Params, ScoreConfig
from rlpipe.data.io import read_artifact
from rlpipe.data.schema import PROMPTS
from rlpipe.data.view import prompt_view_columns, with_prompt_columns
from rlpipe.engines.base import GenerationEngine, PromptRequest, SamplingParams
from rlpipe.errors import ConfigError
from rlpipe.stages.generate import (GREEDY_TEMPERATURE, GenerateInputs, build_engine, multi_turn_setup, policy_tokens,
                                    resolve_engine, single_turn_columns)
from rlpipe.stages.score import score_rows


def evaluate_policy(engine: GenerationEngine, prompts: pl.DataFrame, *, cfg: EvaluateConfig, score_cfg: ScoreConfig,
                    policy_version: int, decode: Any, multi_turn: Any = None, messages_field: str | None = None
                    ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Greedy completions of every prompt by ``engine`` (see `rlpipe.stages.generate.build_engine`), scored.

    ``multi_turn``: a `rlpipe.stages.generate.MultiTurnSetup` (generate.environment) to evaluate multi-turn
    rollouts, each turn capped at ``evaluate.max_new_tokens``. ``messages_field``: as for `score_rows`
    (conversational prompts: the metadata field of their messages).
    """
    params = SamplingParams(temperature=GREEDY_TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=cfg.max_new_tokens)
    base = prompts.select("prompt_id", "prompt", "prompt_token_ids", "answer", "metadata")
    if multi_turn is not None:
        driver = multi_turn.driver(engine, sampling=params, group_size=1, keep_chunks=False)
        rollouts = driver.run(base, [0] * base.height)
        rows = base.join(rollouts.drop("prompt_token_ids"), on="prompt_id")
    else:
        requests = [PromptRequest(prompt_token_ids=tuple(ids), seed=0, n=1) for ids in prompts["prompt_token_ids"]]
        completions = [group[0] for group in engine.generate(requests, params)]
        rows = base.with_columns(
            pl.lit(0, dtype=pl.Int32).alias("sample_idx"),
            pl.Series("completion_token_ids", [c.token_ids for c in completions], dtype=pl.List(pl.Int32)),
            pl.Series("completion_text", [decode(c.token_ids) for c in completions], dtype=pl.String),
            pl.Series("completion_length", [len(c.token_ids) for c in completions], dtype=pl.Int32),
            pl.Series("truncated", [c.finish_reason == "length" for c in completions], dtype=pl.Boolean),
            pl.Series("finish_reason", [c.finish_reason for c in completions], dtype=pl.String),
        )
        rows = single_turn_columns(rows)
    scores, score_m = score_rows(rows, score_cfg, messages_field=messages_field)
    frame = rows.join(scores.select("prompt_id", "sample_idx", "reward", "correct"), on=["prompt_id", "sample_idx"])
    frame = frame.select("prompt_id", "sample_idx", pl.lit(policy_version, dtype=pl.Int64).alias("policy_version"),
                         "completion_token_ids", "completion_text", "completion_length", "truncated", "finish_reason",
                         "policy_mask", "num_turns", "turn_starts", "tool_calls",
                         pl.col("tool_calls").list.len().cast(pl.Int32).alias("num_tool_calls"), "reward", "correct")
    metrics = {
        "policy_version": policy_version,
        "num_prompts": frame.height,
        "accuracy": score_m["accuracy"],
        "reward_mean": score_m["reward_mean"],
        "length_mean": float(frame["completion_length"].mean()),
        "truncation_rate": float(frame["truncated"].mean()),
        "scorer_errors": score_m["errors"],
    }
    if cfg.metrics_by:
        metrics["by"] = metrics_by(frame, prompts, cfg.metrics_by)
        metrics["accuracy_by"] = {column: {value: m["accuracy"] for value, m in values.items()}
                                  for column, values in metrics["by"].items()}
    if multi_turn is not None:
        metrics.update({"tool_use_rate": float((frame["num_tool_calls"] > 0).mean()),
                        "turns_mean": float(frame["num_turns"].mean()),
                        "finish_reasons": {r: int(n) for r, n in
                                           frame["finish_reason"].value_counts().sort("finish_reason").iter_rows()}})
    return frame, metrics


def metrics_by(frame: pl.DataFrame, prompts: pl.DataFrame, columns: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The eval numbers per value of each prompt column of ``columns`` (evaluate.metrics_by), as verl reports its
    validation metrics per data_source: ``{column: {value: {num_prompts, accuracy, reward_mean, length_mean}}}``.

    The rows get their prompt's columns through the rollout view (`rlpipe.data.view`); values are keyed by their
    text (null: "null"; booleans: "true"/"false"), in the column's sort order, null last. Accuracy is over the
    judged rows, as the overall one is (None when none was judged).
    """
    check_metrics_by(prompts, columns)
    viewed = with_prompt_columns(frame, prompts)
    out: dict[str, dict[str, Any]] = {}
    for column in columns:
        groups = viewed.group_by(column).agg(
            pl.len().alias("num_prompts"), pl.col("correct").mean().alias("accuracy"),
            pl.col("reward").mean().alias("reward_mean"), pl.col("completion_length").cast(pl.Float64).mean()
            .alias("length_mean")).sort(column, nulls_last=True)
        out[column] = {value_key(row.pop(column)): row for row in groups.iter_rows(named=True)}
    return out


def check_metrics_by(prompts: pl.DataFrame, columns: Sequence[str]) -> None:
    """Refuse an evaluate.metrics_by column the eval prompt table lacks, or one of lists (before any generation)."""
    known = prompt_view_columns(prompts.columns)
    for column in columns:
        if column not in known:
            raise ConfigError(f"evaluate.metrics_by: the eval prompt table has no column {column!r}; its columns: "
                              f"{', '.join(known)}")
        if prompts.schema[column].is_nested():
            raise ConfigError(f"evaluate.metrics_by: column {column!r} holds {prompts.schema[column]}; name a "
                              "column of single values (text, numbers, booleans)")


def value_key(value: Any) -> str:
    """A column value as a metrics key: its text; booleans as JSON writes them, null as "null"."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return str(value)


def read_inputs(p: Params, prompts_path: str, policy: str) -> GenerateInputs:
    """The held-out prompts, the policy's tokenizer and EOS ids, checked to fit its context; for multi-turn
    (generate.environment) the same environment and limits as generate, before any weight is loaded."""
    table = read_artifact(prompts_path, PROMPTS).frame
    check_metrics_by(table, p.evaluate.metrics_by)
    env = p.generate.environment
    tokenizer, eos = policy_tokens(
        policy, table, max_new_tokens=env.max_total_tokens if env.multi_turn else p.evaluate.max_new_tokens,
        source=prompts_path,
        setting="generate.environment.max_total_tokens" if env.multi_turn else "evaluate.max_new_tokens")
    # multi-turn: greedy turns with the same environment and limits as generate
    setup = multi_turn_setup(p.generate, tokenizer, eos_token_ids=eos, source=policy) if env.multi_turn else None
    return GenerateInputs(table, tokenizer, eos, setup)


def greedy_engine(p: Params, policy: str, inputs: GenerateInputs) -> GenerationEngine:
    """evaluate's own engine (its device, dtype and batch size), decoding greedily."""
    cfg = p.evaluate
    return build_engine(resolve_engine(cfg.engine, cfg.device), device=cfg.device, dtype=cfg.dtype,
                        batch_size=cfg.batch_size, vllm=p.generate.vllm, temperature=GREEDY_TEMPERATURE,
                        model_dir=policy, eos_token_ids=inputs.eos_token_ids,
                        pad_token_id=inputs.tokenizer.pad_token_id, section="evaluate")
