"""The reference_logprob stage's logic: per-token log-probs of each completion under pi_ref, in one process
or data parallel over torchrun's ranks (`score_in_shares`), with byte-identical output."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import polars as pl
import torch

from rlpipe.config import ReferenceLogprobConfig
from rlpipe.distributed import Dist
from rlpipe.engines.logprobs import batched_completion_logprobs, token_budget_batches

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


def score_in_shares(frame: Any, score: Callable[[Any], Any], dist: Dist, *, max_tokens_per_batch: int,
                    progress: Callable[[int], None] | None = None) -> Any:
    """Data-parallel scoring of a rollout frame: on rank 0 the concatenated results, elsewhere None.

    ``score(sub_frame) -> frame`` is the single-process scorer (`reference_logprobs`). The rows
    are cut into the packed token-budget batches that one process would make over the whole frame
    (`token_budget_batches`, longest first), the batches are dealt round-robin, and each batch is
    scored by its own ``score`` call: a sequence then shares its batch, and so its floating-point
    rounding, with exactly the sequences it shares it with in a single process, and the written
    table is byte-identical. Row order is not kept (write_artifact sorts by key). ``progress``:
    called on rank 0 with the other ranks' row count once they are gathered.
    """
    lengths = (frame["prompt_token_ids"].list.len() + frame["completion_token_ids"].list.len()).to_list()
    batches = token_budget_batches(lengths, max_tokens_per_batch, packed=True)
    mine = [score(frame[sorted(rows)]) for rows in batches[dist.rank::dist.world_size]]
    parts = dist.gather(mine)
    if not dist.is_main:
        return None
    if progress is not None:  # ``score`` reported rank 0's own rows; the other ranks' arrive all at once
        progress(sum(part.height for rank_parts in parts[1:] for part in rank_parts))
    return pl.concat([part for rank_parts in parts for part in rank_parts])


def reference_table(model: Any, rollouts: pl.DataFrame, cfg: ReferenceLogprobConfig, *, temperature: float,
                    pad_token_id: int, reference_version: int, dist: Dist | None,
                    progress: Callable[[int], None] | None = None) -> pl.DataFrame | None:
    """The REF_LOGPROBS rows of ``rollouts``: scored here, or in shares under torchrun (None on ranks but 0)."""
    def score(frame: pl.DataFrame) -> pl.DataFrame:
        return reference_logprobs(model, frame, cfg, temperature=temperature, pad_token_id=pad_token_id,
                                  reference_version=reference_version, progress=progress)

    if dist is None:
        return score(rollouts)
    return score_in_shares(rollouts, score, dist, max_tokens_per_batch=cfg.max_tokens_per_batch, progress=progress)
