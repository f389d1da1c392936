"""The reference_logprob stage's logic: per-token log-probs of each completion under pi_ref."""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import torch

from rlpipe.config import ReferenceLogprobConfig
from rlpipe.engines.logprobs import batched_completion_logprobs

_AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reference_logprobs(model: Any, rollouts: pl.DataFrame, cfg: ReferenceLogprobConfig, *, temperature: float,
                       pad_token_id: int, reference_version: int, progress: Any = None) -> pl.DataFrame:
    """Score every completion token under ``model`` from logits / temperature (the sampling temperature).

    Sequences are sorted by length and packed without padding into rows of at most
    ``cfg.max_tokens_per_batch`` prompt+completion tokens (attention kept inside each sequence, see
    rlpipe.engines.logprobs); the LM head runs in chunks of ``cfg.chunk_size`` positions, so no
    float32 [batch, seq, vocab] tensor ever exists. With ``cfg.dtype`` bfloat16/float16 the forward
    runs under autocast in that dtype (a no-op for weights already loaded in it); log-probs are
    float32 either way. Output rows are in input order. ``progress``: optional callback (sequences
    finished per batch), see rlpipe.progress.
    """
    logprobs, _ = batched_completion_logprobs(
        model, rollouts["prompt_token_ids"].to_list(), rollouts["completion_token_ids"].to_list(),
        pad_token_id=pad_token_id, temperature=temperature, max_tokens_per_batch=cfg.max_tokens_per_batch,
        chunk_size=cfg.chunk_size, with_entropy=False, device=cfg.device, progress=progress, packed=True,
        autocast_dtype=_AUTOCAST[cfg.dtype])
    return rollouts.select("prompt_id", "sample_idx").with_columns(
        pl.lit(reference_version, dtype=pl.Int64).alias("reference_version"),
        pl.Series("ref_logprobs", [np.asarray(x, dtype=np.float32) for x in logprobs], dtype=pl.List(pl.Float32)),
    )


def reference_metrics(ref: pl.DataFrame, rollouts: pl.DataFrame) -> dict[str, float]:
    """Mean ref log-prob and the sampler-vs-reference gap (a KL(pi_old || pi_ref) estimate, k1).

    Every completion token is scored (observation tokens of multi-turn rollouts too: the trainer's
    forward needs the whole sequence), but the statistics are over the policy's tokens only: an
    observation token has no sampler log-prob, and it never enters the KL.
    """
    ref_flat = ref["ref_logprobs"].explode()
    policy = rollouts["policy_mask"].explode()
    sampled_ref = ref_flat.filter(policy)
    sampler_flat = rollouts["sampler_logprobs"].explode().filter(policy)
    return {
        "num_samples": ref.height,
        "tokens": int(ref_flat.len()),
        "policy_tokens": int(sampled_ref.len()),
        "ref_logprob_mean": float(sampled_ref.mean()) if sampled_ref.len() else 0.0,
        "kl_sampler_ref_k1": float((sampler_flat - sampled_ref).mean()) if sampled_ref.len() else 0.0,
    }
