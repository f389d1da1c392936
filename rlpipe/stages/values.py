"""The values stage's logic: the PPO critic's per-token values V_t of the rollouts, before GAE.

The critic itself (loading, saving, where it came from) is `rlpipe.models.critic`'s.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from rlpipe.config import ValuesConfig
from rlpipe.engines.scalar_head import batched_values
from rlpipe.models.critic import critic_info, load_critic
from rlpipe.models.loading import load_tokenizer

def critic_values(rollouts: pl.DataFrame, critic_path: str, cfg: ValuesConfig, *, seed: int
                  ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """V_t for every completion token of ``rollouts`` (the VALUES table) and the critic's provenance."""
    model = load_critic(critic_path, seed=seed, device=cfg.device, dtype=cfg.dtype)
    pad_id = load_tokenizer(critic_path).pad_token_id
    values = batched_values(model, rollouts["prompt_token_ids"].to_list(), rollouts["completion_token_ids"].to_list(),
                            pad_token_id=pad_id, max_tokens_per_batch=cfg.max_tokens_per_batch)
    frame = rollouts.select("prompt_id", "sample_idx").with_columns(
        pl.Series("values", [v.tolist() for v in values], dtype=pl.List(pl.Float32)))
    return frame, critic_info(critic_path)


def values_metrics(frame: pl.DataFrame) -> dict[str, Any]:
    flat = np.concatenate([np.asarray(v, dtype=np.float64) for v in frame["values"].to_list()] or [np.zeros(0)])
    return {"num_samples": frame.height, "tokens": int(flat.size),
            "value_mean": float(flat.mean()) if flat.size else 0.0,
            "value_std": float(flat.std()) if flat.size else 0.0}
