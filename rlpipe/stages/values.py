"""The PPO critic: loading it for the values stage and the trainer, and what the values stage writes.

The critic is a `rlpipe.models.value_model.ScalarHeadModel`. In the first PPO iteration ``critic.path``
is a causal-LM directory (usually the policy's start), so the critic gets that body and a fresh
head; train writes the updated critic, and `rlpipe iterate` points ``critic.path`` at it.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import polars as pl

from rlpipe.config import ValuesConfig
from rlpipe.data.io import CHECKPOINT_INFO, atomic_path, read_json
from rlpipe.models.loading import load_tokenizer
from rlpipe.models.value_model import batched_values, is_scalar_model_dir, load_scalar_model, save_scalar_model

# The fresh head's seed is derived from the run seed, so two runs with one seed start the same critic.
HEAD_SEED_OFFSET = 17


def critic_info(path: str) -> dict[str, Any]:
    """Where a critic came from: a trained one (with the iteration that wrote it) or a fresh head."""
    if is_scalar_model_dir(path):
        info = read_json(f"{path}/rlpipe.json")
        return {"path": path, "fresh_head": False, "critic_version": info.get("critic_version")}
    return {"path": path, "fresh_head": True, "critic_version": 0}


def load_critic(path: str, *, seed: int, device: str, dtype: str = "float32"):
    return load_scalar_model(path, seed=seed + HEAD_SEED_OFFSET, device=device, dtype=dtype)


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


def save_critic(critic_model, tokenizer: Any, out_dir: str, *, version: int, estimator: str) -> None:
    """The trained critic; without one (``critic_model`` None: every estimator but gae) a directory whose
    rlpipe.json says why it holds no model (DVC needs the train stage's declared output either way)."""
    if critic_model is not None:
        save_scalar_model(critic_model, tokenizer, out_dir, info={"critic_version": version})
        return
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        (tmp / CHECKPOINT_INFO).write_text(json.dumps(
            {"kind": "none", "reason": f"advantage.estimator {estimator!r} trains no critic"}, sort_keys=True) + "\n")
