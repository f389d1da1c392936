"""The evaluate stage's logic: greedy answers of a policy on held-out prompts, judged like training rewards."""
from __future__ import annotations

from typing import Any

import polars as pl

from rlpipe.config import EvaluateConfig, ScoreConfig
from rlpipe.engines.base import GenerationEngine, PromptRequest, SamplingParams
from rlpipe.generate import GREEDY_TEMPERATURE
from rlpipe.scoring import score_rows


def evaluate_policy(engine: GenerationEngine, prompts: pl.DataFrame, *, cfg: EvaluateConfig, score_cfg: ScoreConfig,
                    policy_version: int, decode: Any) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Greedy completions of every prompt by ``engine`` (see `rlpipe.generate.build_engine`), scored."""
    params = SamplingParams(temperature=GREEDY_TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=cfg.max_new_tokens)
    requests = [PromptRequest(prompt_token_ids=tuple(ids), seed=0, n=1) for ids in prompts["prompt_token_ids"]]
    results = engine.generate(requests, params)
    completions = [group[0] for group in results]
    rows = prompts.select("prompt_id", "prompt", "prompt_token_ids", "answer", "metadata").with_columns(
        pl.lit(0, dtype=pl.Int32).alias("sample_idx"),
        pl.Series("completion_token_ids", [c.token_ids for c in completions], dtype=pl.List(pl.Int32)),
        pl.Series("completion_text", [decode(c.token_ids) for c in completions], dtype=pl.String),
        pl.Series("completion_length", [len(c.token_ids) for c in completions], dtype=pl.Int32),
        pl.Series("truncated", [c.finish_reason == "length" for c in completions], dtype=pl.Boolean),
    )
    scores, score_m = score_rows(rows, score_cfg)
    frame = rows.join(scores.select("prompt_id", "sample_idx", "reward", "correct"), on=["prompt_id", "sample_idx"])
    frame = frame.select("prompt_id", "sample_idx", pl.lit(policy_version, dtype=pl.Int64).alias("policy_version"),
                         "completion_token_ids", "completion_text", "completion_length", "truncated", "reward",
                         "correct")
    metrics = {
        "policy_version": policy_version,
        "num_prompts": frame.height,
        "accuracy": score_m["accuracy"],
        "reward_mean": score_m["reward_mean"],
        "length_mean": float(frame["completion_length"].mean()),
        "truncation_rate": float(frame["truncated"].mean()),
        "scorer_errors": score_m["errors"],
    }
    return frame, metrics
