"""The advantage stage's logic: group statistics, advantages per sample and per token, DAPO filters,
and for the token-reward estimators (reinforce_plus_plus, gae) the KL-in-reward with its adaptive
controller. Above `STREAM_ABOVE_TOKENS` completion tokens (`TOKEN_STREAM_ABOVE_TOKENS` for REINFORCE++ and
GAE) the stage streams (`stream_advantages`, the second half of this module): the same numbers, a chunk of
rows at a time.

numpy/polars only (no torch, no model), so this stage starts and finishes in about a second and a
reward change re-runs it cheaply.

The KL penalty in the reward uses the *sampler's* log-probs as log pi_old: the trainer recomputes
pi_old only inside train, after this stage. With the HF engine the two agree to ~1e-7 on CPU; with
vLLM the gap is reported every iteration (train metrics ``sampler_mismatch_*``).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from rlpipe.algorithms import ragged
from rlpipe.algorithms.advantages import adaptive_kl_beta, as_rewards, group_metrics, group_stats
from rlpipe.algorithms.estimators import get_advantage_estimator
from rlpipe.algorithms.group_advantages import baseline_centred_rewards, gdpo_weighted_sum
from rlpipe.algorithms.ragged import Layout
from rlpipe.algorithms.pairwise_sum import StreamedSum
from rlpipe.algorithms.streamed_sum import Whitening, whitening_from_sums
from rlpipe.config import AdvantageConfig, Params
from rlpipe.data.io import Artifact, join_on_keys, read_artifact, require_critic_values, write_artifact_parts
from rlpipe.data.lists import flat_values, list_column
from rlpipe.data.schema import ADVANTAGES, REF_LOGPROBS, ROLLOUTS, SCORES, TOKEN_FLOATS, VALUES, component_column
from rlpipe.errors import ArtifactError

FILTER_ZERO_VARIANCE = "zero_variance_group"
FILTER_TRUNCATED = "truncated"
FILTER_INFRA_ERROR = "infra_error"  # the rollout's environment failed (docs/multi-turn.md): not the model's doing


def estimator_options(cfg: AdvantageConfig, reward_weights: list[float] | None = None) -> dict[str, Any]:
    """The hyperparameters each estimator reads, from one config section (``reward_weights``: the
    score.rewards weights of the components, for the multi-reward estimators)."""
    whitening = {"whiten_form": cfg.whiten_form, "whiten_eps": cfg.whiten_eps}
    group = {"std_mode": cfg.std_mode, "eps": cfg.eps}
    return {
        "grpo": {**group, "singleton_groups": cfg.singleton_groups, "std_scope": cfg.std_scope},
        "dr_grpo": {"singleton_groups": cfg.singleton_groups},
        "reinforce_plus_plus": whitening,
        "gae": {"gamma": cfg.gamma, "lam": cfg.lam, "whiten": cfg.whiten, **whitening},
        "grpo_passk": group,
        "reinforce_plus_plus_baseline": {"singleton_groups": cfg.singleton_groups, **whitening},
        "gdpo": {**group, "singleton_groups": cfg.singleton_groups, **whitening, "reward_weights": reward_weights},
        "grpo_normalize_then_sum": {**group, "reward_weights": reward_weights},
    }.get(cfg.estimator, {})


def kl_controller_state(cfg: AdvantageConfig, kl_B: np.ndarray | None) -> dict[str, Any]:
    """The KL-in-reward controller's record for this iteration: the beta used and the next one.

    ``kl_B``: each sequence's KL penalty summed over its tokens (None when the estimator puts no KL
    in the reward). The next beta is what `rlpipe iterate` writes back to params.yaml, so the
    controller's state travels with the project (git) from iteration to iteration and machine to machine.
    """
    k = cfg.kl_in_reward
    state: dict[str, Any] = {"in_reward": kl_B is not None, "beta": k.beta, "estimator": k.estimator,
                             "adaptive": k.adaptive, "target": k.target, "horizon": k.horizon}
    if kl_B is None:
        return {**state, "observed_kl": None, "num_samples": 0, "next_beta": k.beta}
    observed = float(kl_B.mean()) if kl_B.size else 0.0
    next_beta = (adaptive_kl_beta(k.beta, observed_kl=observed, target_kl=k.target, horizon=k.horizon,
                                  num_samples=int(kl_B.size)) if k.adaptive else k.beta)
    return {**state, "observed_kl": observed, "num_samples": int(kl_B.size), "next_beta": next_beta}


def check_finite_rewards(rows: pl.DataFrame, source: str, *, allow_nan: bool = False) -> None:
    """Refuse NaN/inf rewards, naming the rows (``allow_nan``: only inf and null; advantage.nan_rewards).

    Why refuse rather than treat: one NaN reward makes its whole group's mean and std NaN, so every
    advantage of the group, and any loss it enters, is NaN. Dropping or zeroing such rows would
    train quietly on a reward that is broken; the score stage never writes one (a reward returning
    NaN is a row error with the fallback reward), so a NaN here means the table was produced or
    edited elsewhere, and the user must look at it. Unless the user asked for TRL's handling
    (``advantage.nan_rewards: zero_advantage`` with ``score.fallback_reward: .nan``): then a NaN row
    is left out of its group's statistics and gets advantage 0 (`compute_advantages`).
    """
    bad = rows.filter((~pl.col("reward").is_finite() & ~(pl.col("reward").is_nan() & allow_nan))
                      | pl.col("reward").is_null())
    if bad.height:
        shown = ", ".join(f"(prompt_id={r['prompt_id']}, sample_idx={r['sample_idx']}, reward={r['reward']})"
                          for r in bad.head(5).iter_rows(named=True))
        raise ArtifactError(f"{source}: column 'reward' has {bad.height} non-finite value(s) (NaN/inf/null): {shown}"
                            + (" ..." if bad.height > 5 else ""))


def left_out(rows: pl.DataFrame, cfg: AdvantageConfig) -> tuple[np.ndarray, np.ndarray]:
    """(infra_error, unscorable) per row: the rows no estimator sees (see `compute_advantages`)."""
    infra = ((rows["finish_reason"] == FILTER_INFRA_ERROR).to_numpy() if "finish_reason" in rows.columns
             else np.zeros(rows.height, dtype=bool))
    unscorable = (rows["reward"].is_nan().fill_null(True).to_numpy() if cfg.nan_rewards == "zero_advantage"
                  else np.zeros(rows.height, dtype=bool))
    return infra, unscorable


def group_statistics(rows: pl.DataFrame, cfg: AdvantageConfig) -> tuple[pl.DataFrame, np.ndarray]:
    """Keys and each row's group size, reward mean and spread, and its DAPO filter reason (None: trained)."""
    ddof = 1 if cfg.std_mode == "sample" else 0
    stats = rows.select(
        "prompt_id", "sample_idx", "truncated",
        pl.len().over("prompt_id").cast(pl.Int32).alias("group_size"),
        pl.col("reward").mean().over("prompt_id").alias("group_reward_mean"),
        pl.col("reward").std(ddof=ddof).over("prompt_id").fill_null(0.0).fill_nan(0.0).alias("group_reward_std"),
    )
    reason = np.full(rows.height, None, dtype=object)
    if cfg.drop_truncated:
        reason[stats["truncated"].to_numpy()] = FILTER_TRUNCATED
    if cfg.drop_zero_variance_groups:
        reason[stats["group_reward_std"].to_numpy() == 0.0] = FILTER_ZERO_VARIANCE
    return stats.drop("truncated"), reason


def left_out_rows(left: pl.DataFrame, stats: pl.DataFrame, infra: np.ndarray) -> pl.DataFrame:
    """The left-out rows' keys, their group's statistics (0 for a group left out whole) and filter reason."""
    groups = stats.group_by("prompt_id").agg(pl.col("group_size", "group_reward_mean", "group_reward_std").first())
    return left.select("prompt_id", "sample_idx").join(groups, on="prompt_id", how="left").with_columns(
        pl.col("group_size").fill_null(0), pl.col("group_reward_mean", "group_reward_std").fill_null(0.0),
        pl.Series("filtered_reason", [FILTER_INFRA_ERROR if bad else None for bad in infra], dtype=pl.String))


def outcome_metrics(cfg: AdvantageConfig, reasons: pl.Series, seq_adv: np.ndarray | None,
                    estimator_metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics every estimator reports: rows, trained rows, filter counts, the sequence advantages' spread."""
    return {
        "estimator": cfg.estimator,
        "num_samples": reasons.len(),
        "num_trained": int(reasons.is_null().sum()),
        "filtered": {k: int((reasons == k).sum()) for k in (FILTER_ZERO_VARIANCE, FILTER_TRUNCATED, FILTER_INFRA_ERROR)},
        "advantage_mean": float(np.mean(seq_adv)) if seq_adv is not None else None,
        "advantage_abs_mean": float(np.mean(np.abs(seq_adv))) if seq_adv is not None else None,
        **estimator_metrics,
    }


def kl_reward_metrics(kl_state: dict[str, Any], token_reward_mean: float) -> dict[str, Any]:
    return {"kl_reward_beta": kl_state["beta"], "kl_reward_observed": kl_state["observed_kl"],
            "kl_reward_next_beta": kl_state["next_beta"], "token_reward_mean": token_reward_mean}


def compute_advantages(rows: pl.DataFrame, cfg: AdvantageConfig, reward_weights: dict[str, float] | None = None
                       ) -> tuple[pl.DataFrame, dict[str, Any], dict[str, Any]]:
    """Advantage table, metrics and KL-controller record for one iteration.

    ``rows``: keys, reward, completion_length, truncated, policy_mask and finish_reason (rollouts
    joined with scores), sorted by keys; plus sampler_logprobs and ref_logprobs for
    reinforce_plus_plus / gae, and values for gae.

    Multi-turn rollouts: only the policy's tokens (``policy_mask``) are valid tokens here, so a
    sequence advantage is broadcast to them alone, GAE steps over observation tokens (they are
    neither terminal nor rewarded: `gae_advantages` skips masked positions), and token statistics
    count policy tokens. A row whose environment failed (finish_reason ``infra_error``) is left out
    of everything, its group's statistics included, and marked ``filtered_reason: infra_error``.
    With ``advantage.nan_rewards: zero_advantage`` a row whose reward is NaN (unscorable) is left
    out of the statistics the same way but stays trainable with advantage 0 (TRL's handling).

    ``reward_weights``: {reward_<name> column: weight} of the multi-reward estimators (gdpo,
    grpo_normalize_then_sum), whose rows then carry those columns too.
    """
    infra, unscorable = left_out(rows, cfg)
    left = infra | unscorable
    if not left.any():
        return _compute_advantages(rows, cfg, reward_weights)
    frame, metrics, kl_state = _compute_advantages(rows.filter(~pl.Series(left)), cfg, reward_weights)
    left_frame = rows.filter(pl.Series(left))
    lengths = left_frame["completion_length"].to_numpy()
    zeros = list_column("token_advantages", np.zeros(int(lengths.sum()), dtype=np.float32), lengths, TOKEN_FLOATS)
    extra = left_out_rows(left_frame, frame, infra[left]).with_columns(
        pl.lit(None if cfg.uses_token_rewards else 0.0, dtype=pl.Float32).alias("advantage"),
        zeros,
        zeros.alias("returns") if cfg.needs_critic else pl.Series("returns", [None] * left_frame.height,
                                                                   dtype=TOKEN_FLOATS),
    ).select(frame.columns)
    metrics["num_samples"] = rows.height
    metrics["num_trained"] += int((unscorable & ~infra).sum())
    metrics["filtered"][FILTER_INFRA_ERROR] = int(infra.sum())
    metrics["unscorable"] = int((unscorable & ~infra).sum())
    return pl.concat([frame, extra]).sort(["prompt_id", "sample_idx"]), metrics, kl_state


def _compute_advantages(rows: pl.DataFrame, cfg: AdvantageConfig, reward_weights: dict[str, float] | None
                        ) -> tuple[pl.DataFrame, dict[str, Any], dict[str, Any]]:
    rewards = rows["reward"].to_numpy().astype(np.float64)
    groups = rows["prompt_id"].to_numpy()
    lengths = rows["completion_length"].to_numpy().astype(np.int64)
    layout = Layout.from_lengths(lengths)
    # observation tokens of multi-turn rollouts are not the policy's actions
    mask = (flat_values(rows["policy_mask"], bool) if "policy_mask" in rows.columns
            else np.ones(layout.num_tokens, dtype=bool))
    token_rewards = values = kl_B = None
    if cfg.uses_token_rewards:
        # float32 as stored: token_kl takes each to float64 itself (the same values, one N-sized copy fewer each)
        old = flat_values(rows["sampler_logprobs"], np.float32)
        ref = flat_values(rows["ref_logprobs"], np.float32)
        k = cfg.kl_in_reward
        kl = ragged.token_kl(old, ref, mask, estimator=k.estimator)
        del old, ref
        kl_B = ragged.row_sums(kl, layout)
        token_rewards = ragged.penalized_rewards(rewards, kl, mask, layout, beta=k.beta)  # in place: kl is gone
    if cfg.needs_critic:
        values = flat_values(rows["values"], np.float32)  # as stored: gae takes its float64 copy itself
    stats, reason = group_statistics(rows, cfg)
    # Token-level estimators normalise over the batch's tokens: rows left out of the loss stay out of
    # those statistics too (a group estimator's rows only see their own group).
    kept_B = np.array([r is None for r in reason], dtype=bool)
    estimator_mask = mask & layout.broadcast(kept_B) if cfg.uses_token_rewards else mask
    components = weights = None
    if cfg.uses_reward_components:
        if not reward_weights:
            raise ArtifactError(f"advantage.estimator {cfg.estimator!r} needs the reward_<name> columns of the scores")
        components = np.stack([rows[c].cast(pl.Float64).fill_null(np.nan).to_numpy() for c in reward_weights], axis=1)
        weights = list(reward_weights.values())
    estimator = get_advantage_estimator(cfg.estimator)
    result = estimator(rewards_B=rewards, group_index_B=groups, layout=layout, mask_N=estimator_mask,
                       token_rewards_N=token_rewards, values_N=values, component_rewards_BK=components,
                       options=estimator_options(cfg, weights))
    del values
    seq_adv = result.sequence_advantages_B
    returns = (list_column("returns", result.returns_N.astype(np.float32), lengths, TOKEN_FLOATS)
               if result.returns_N is not None else pl.Series("returns", [None] * rows.height, dtype=TOKEN_FLOATS))
    frame = stats.with_columns(
        pl.Series("advantage", [None] * rows.height if seq_adv is None else seq_adv.astype(np.float32),
                  dtype=pl.Float32),
        list_column("token_advantages", result.token_advantages_as(np.float32), lengths, TOKEN_FLOATS),
        returns,
        pl.Series("filtered_reason", reason.tolist(), dtype=pl.String),
    )
    metrics = outcome_metrics(cfg, frame["filtered_reason"], seq_adv, result.metrics)
    kl_state = kl_controller_state(cfg, kl_B)
    if kl_B is not None:
        metrics.update(kl_reward_metrics(kl_state, masked_mean(token_rewards, mask)))
    if seq_adv is None:  # token-level estimators: report the token advantages' spread instead
        metrics["advantage_mean"] = masked_mean(result.tokens_N, estimator_mask)
        metrics["advantage_abs_mean"] = masked_mean(result.tokens_N, estimator_mask, absolute=True)
    return frame, metrics, kl_state


def masked_mean(values_N: np.ndarray, mask_N: np.ndarray, *, absolute: bool = False) -> float:
    """``float(values_N[mask_N].mean())`` (of the absolute values with ``absolute``; 0.0 for an empty mask),
    bit for bit, a chunk of tokens at a time: no N-sized copy beside the arrays the stage already holds."""
    total = StreamedSum(int(np.count_nonzero(mask_N)))
    for start in range(0, values_N.size, CHUNK_TOKENS):
        piece = values_N[start:start + CHUNK_TOKENS][mask_N[start:start + CHUNK_TOKENS]]
        total.add(np.abs(piece, out=piece) if absolute else piece)
    return mean_of(total, total.n)


# --------------------------------------------------------------------------------------------
# the stage's inputs, as stages/advantage.py reads them


def reward_weights(p: Params) -> dict[str, float] | None:
    """The weight of each reward component's column, for the estimators that read components (else None)."""
    if not p.advantage.uses_reward_components:
        return None
    return {component_column(e.name): e.weight for e in p.score.rewards}


def _required(path: str | None, option: str, estimator: str) -> str:
    if not path:
        raise ArtifactError(f"advantage.estimator {estimator!r} needs {option}")
    return path


def token_sources(cfg: AdvantageConfig, *, rollouts: str, ref_logprobs: str | None, values: str | None) -> Sources:
    """The token input files the estimator reads, each refused before any reading when its option is missing.

    Why here: the in-memory and the streamed stage both start from it, so both name the missing option
    (the streamed one would otherwise fail later, on a missing file)."""
    return Sources(rollouts,
                   _required(ref_logprobs, "--ref-logprobs", cfg.estimator) if cfg.uses_token_rewards else None,
                   _required(values, "--values", cfg.estimator) if cfg.needs_critic else None)


def read_rows(p: Params, *, rollouts: str, scores: str, ref_logprobs: str | None, values: str | None,
              weights: dict[str, float] | None) -> tuple[Artifact, pl.DataFrame]:
    """The rollouts, and one row per sample with exactly the columns the estimator reads: rewards (checked
    finite), and the reference log-probs and critic values for the estimators that need them."""
    cfg = p.advantage
    needed = ["completion_length", "truncated", "policy_mask", "finish_reason"]
    roll = read_artifact(rollouts, ROLLOUTS, columns=needed + (["sampler_logprobs"] if cfg.uses_token_rewards else []))
    score_columns = ["reward", *(weights or {})]
    rows = join_on_keys(roll, read_artifact(scores, SCORES, columns=score_columns), columns=score_columns)
    check_finite_rewards(rows, scores, allow_nan=cfg.nan_rewards == "zero_advantage")
    wanted = ["prompt_id", "sample_idx", "reward", "completion_length", "truncated", "policy_mask",
              "finish_reason", *(weights or {})]
    if cfg.uses_token_rewards:
        rows = join_on_keys(roll.with_frame(rows),
                            read_artifact(_required(ref_logprobs, "--ref-logprobs", cfg.estimator), REF_LOGPROBS,
                                          columns=["ref_logprobs"]),
                            columns=["ref_logprobs"])
        wanted += ["sampler_logprobs", "ref_logprobs"]
    if cfg.needs_critic:
        table = require_critic_values(read_artifact(_required(values, "--values", cfg.estimator), VALUES,
                                                    columns=["values"]))
        rows = join_on_keys(roll.with_frame(rows), table, columns=["values"])
        wanted += ["values"]
    return roll, rows.select(wanted)


def read_row_level(p: Params, *, rollouts: str, scores: str, weights: dict[str, float] | None
                   ) -> tuple[Artifact, pl.DataFrame]:
    """`read_rows` without the token columns: what the streamed stage (`rlpipe.stages.advantage_stream`) holds
    for the whole iteration; its token columns are read a chunk of rows at a time."""
    roll = read_artifact(rollouts, ROLLOUTS, columns=["completion_length", "truncated", "finish_reason"])
    score_columns = ["reward", *(weights or {})]
    rows = join_on_keys(roll, read_artifact(scores, SCORES, columns=score_columns), columns=score_columns)
    check_finite_rewards(rows, scores, allow_nan=p.advantage.nan_rewards == "zero_advantage")
    return roll, rows.select("prompt_id", "sample_idx", "reward", "completion_length", "truncated", "finish_reason",
                             *(weights or {}))


# --------------------------------------------------------------------------------------------
# the streamed stage: an iteration too large to hold. The row-level work once, the token work a chunk of
# rows at a time, the same numbers as `compute_advantages`.
#
# Why: at 1B tokens the in-memory stage needs 10 GiB (GRPO) to 60 GiB (GAE). What an estimator needs across
# rows is per row (rewards, groups, lengths: 1M rows is megabytes); what needs every token is a sum over them
# (whitening's mean and spread, the metrics' token means), which `rlpipe.algorithms.streamed_sum` takes bit for
# bit as numpy takes it over the whole array. So each pass reads a chunk of rows (`read_artifact(rows=)`), does
# the row-local token math of `rlpipe.algorithms.ragged` on it with the whole iteration's padded width (row sums
# and reward-to-go depend on it), and adds to the sums; the last pass writes the chunk (`write_artifact_parts`).
# Passes: a count (the policy masks alone), then for token estimators the sums and the squared deviations
# (whitening), then the output. Time for memory: the token columns are read up to four times.
#
# Chunks end at row boundaries, so a row's tokens are in one chunk, and the rows keep their order.

STREAM_ABOVE_TOKENS = 1 << 27  # iterations with more completion tokens take this path (134M: above 67-78M sets)
# REINFORCE++ and GAE keep several float64 token arrays in memory: at 67M tokens 3.2x and 2.7x what they read and
# write, where streamed they held 0.8-0.9 GiB (BENCHMARKS.md). They stream from 16.8M tokens on.
TOKEN_STREAM_ABOVE_TOKENS = 1 << 24
STREAM_ENV = "RLPIPE_STREAM_ABOVE_TOKENS"  # overrides both (benchmarks, tests): never changes a result
CHUNK_TOKENS = 1 << 22  # completion tokens per chunk, about (4M: ~0.2 GiB of float64 temporaries)
TOKEN_ESTIMATORS = ("reinforce_plus_plus", "gae")
WHITENED_SEQUENCE_ESTIMATORS = ("reinforce_plus_plus_baseline", "gdpo")


@dataclass(frozen=True)
class Sources:
    """The stage's token input files (ref log-probs: the KL in the reward; values: gae)."""

    rollouts: str
    ref_logprobs: str | None
    values: str | None


@dataclass
class RowPlan:
    """Per row, what every pass needs: which file rows the estimator sees (``kept``), their rewards, groups
    and filter state, the chunks of file rows, and the padded width of the in-memory stage."""

    kept: np.ndarray  # bool [B]: not left out (infra error, unscorable)
    lengths: np.ndarray  # int64 [B]: completion lengths of every file row
    rewards: np.ndarray  # float64 [B_kept]
    trained: np.ndarray  # bool [B_kept]: no filter reason
    width: int  # the longest kept completion
    chunks: list[tuple[int, int]]  # file rows [start, stop)

    def kept_rows(self, index: int) -> tuple[np.ndarray, slice]:
        """The kept flags of chunk ``index``'s file rows, and where its kept rows sit among all kept rows."""
        start, stop = self.chunks[index]
        kept = self.kept[start:stop]
        first = int(np.count_nonzero(self.kept[:start]))
        return kept, slice(first, first + int(np.count_nonzero(kept)))


def streams(rollouts: str, estimator: str) -> bool:
    """Whether the advantage stage streams this rollout table: more completion tokens than the estimator's threshold."""
    default = TOKEN_STREAM_ABOVE_TOKENS if estimator in TOKEN_ESTIMATORS else STREAM_ABOVE_TOKENS
    threshold = int(os.environ.get(STREAM_ENV, default))
    lengths = read_artifact(rollouts, ROLLOUTS, columns=["completion_length"]).frame["completion_length"]
    return int(lengths.sum()) > threshold


def chunks_of(lengths: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Row ranges of about ``chunk_tokens`` completion tokens each (a longer row gets a chunk of its own)."""
    bounds, start, tokens = [], 0, 0
    for i, n in enumerate(np.asarray(lengths).tolist()):
        if tokens and tokens + n > chunk_tokens:
            bounds.append((start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths) or not bounds:
        bounds.append((start, len(lengths)))
    return bounds


def read_chunk(sources: Sources, cfg: AdvantageConfig, rows: tuple[int, int], *, mask_only: bool = False
               ) -> dict[str, np.ndarray]:
    """The flat token arrays of file rows [start, stop): the policy mask, and unless ``mask_only`` the
    log-probs and values the estimator reads."""
    columns = ["policy_mask"] + (["sampler_logprobs"] if cfg.uses_token_rewards and not mask_only else [])
    roll = read_artifact(sources.rollouts, ROLLOUTS, columns=columns, rows=rows).frame
    out = {"mask": flat_values(roll["policy_mask"], bool)}
    if mask_only:
        return out
    if cfg.uses_token_rewards:
        out["old"] = flat_values(roll["sampler_logprobs"], np.float64)
        ref = read_artifact(sources.ref_logprobs, REF_LOGPROBS, columns=["ref_logprobs"], rows=rows).frame
        out["ref"] = flat_values(ref["ref_logprobs"], np.float64)
    if cfg.needs_critic:
        values = read_artifact(sources.values, VALUES, columns=["values"], rows=rows).frame
        out["values"] = flat_values(values["values"], np.float64)
    return out


def kept_tokens(arrays: dict[str, np.ndarray], lengths: np.ndarray, kept: np.ndarray) -> dict[str, np.ndarray]:
    """The chunk's arrays without the tokens of its left-out rows (the estimator never sees them)."""
    if kept.all():
        return arrays
    keep = np.repeat(kept, lengths)
    return {name: values[keep] for name, values in arrays.items()}


@dataclass
class ChunkTokens:
    """One chunk's kept rows: their layout (the iteration's width), masks, and token values."""

    layout: Layout
    mask: np.ndarray  # the policy's tokens
    estimator_mask: np.ndarray  # ... of trained rows (token estimators), as the in-memory stage masks
    raw: np.ndarray | None = None  # what is whitened (returns, GAE's A, or A_i spread), 0 outside the mask
    returns: np.ndarray | None = None  # gae's critic targets
    kl_B: np.ndarray | None = None
    token_rewards: np.ndarray | None = None


def chunk_token_math(plan: RowPlan, cfg: AdvantageConfig, sources: Sources, index: int, *,
                 sequence_values: np.ndarray | None = None, mask_only: bool = False) -> ChunkTokens:
    """The row-local token math of one chunk, as the in-memory stage does it on the whole iteration."""
    kept, rows = plan.kept_rows(index)
    lengths = plan.lengths[plan.chunks[index][0]:plan.chunks[index][1]]
    arrays = kept_tokens(read_chunk(sources, cfg, plan.chunks[index], mask_only=mask_only), lengths, kept)
    layout = Layout.from_lengths(lengths[kept], width=plan.width)
    mask = arrays["mask"]
    estimator_mask = mask & layout.broadcast(plan.trained[rows]) if cfg.uses_token_rewards else mask
    chunk = ChunkTokens(layout, mask, estimator_mask)
    if mask_only:
        return chunk
    if sequence_values is not None:  # a sequence estimator: A_i at each valid token
        chunk.raw = layout.broadcast(np.asarray(sequence_values[rows], dtype=np.float64))
        chunk.raw[~estimator_mask] = 0.0
        return chunk
    k = cfg.kl_in_reward
    kl = ragged.token_kl(arrays["old"], arrays["ref"], mask, estimator=k.estimator)
    chunk.kl_B = ragged.row_sums(kl, layout)
    chunk.token_rewards = ragged.penalized_rewards(plan.rewards[rows], kl, mask, layout, beta=k.beta)
    if cfg.estimator == "gae":
        chunk.raw, chunk.returns = ragged.gae(chunk.token_rewards, arrays["values"], estimator_mask, layout,
                                             gamma=cfg.gamma, lam=cfg.lam)
    else:
        chunk.raw = ragged.reward_to_go(chunk.token_rewards, estimator_mask, layout)
    return chunk


def row_plan(rows: pl.DataFrame, cfg: AdvantageConfig, chunk_size: int) -> tuple[RowPlan, pl.DataFrame]:
    """The kept rows' group statistics and filter reasons, exactly as `_compute_advantages` takes them, and
    the plan; ``rows``: one row per file row (keys, reward, completion_length, truncated, finish_reason)."""
    infra, unscorable = left_out(rows, cfg)
    kept = ~(infra | unscorable)
    inside = rows if kept.all() else rows.filter(pl.Series(kept))
    stats, reason = group_statistics(inside, cfg)
    stats = stats.with_columns(pl.Series("filtered_reason", reason.tolist(), dtype=pl.String))
    lengths = rows["completion_length"].to_numpy().astype(np.int64)
    plan = RowPlan(kept=kept, lengths=lengths, rewards=inside["reward"].to_numpy().astype(np.float64),
                   trained=np.array([r is None for r in reason], dtype=bool),
                   width=int(lengths[kept].max()) if kept.any() else 0, chunks=chunks_of(lengths, chunk_size))
    return plan, stats


def sequence_values_of(cfg: AdvantageConfig, plan: RowPlan, groups: np.ndarray, components: np.ndarray | None,
                       options: dict) -> tuple[np.ndarray, dict]:
    """A_i and the metrics of a sequence estimator, per kept row (the whitened ones: A_i before whitening)."""
    rewards = plan.rewards
    if cfg.estimator == "reinforce_plus_plus_baseline":
        return baseline_centred_rewards(rewards, groups, singleton_groups=options["singleton_groups"])
    if cfg.estimator == "gdpo":
        total = gdpo_weighted_sum(components, groups, weights_K=np.asarray(options["reward_weights"], dtype=np.float64),
                                  std_mode=options["std_mode"], eps=options["eps"],
                                  singleton_groups=options["singleton_groups"])
        _, size_g, _, singleton_g, zero_var_g = group_stats(as_rewards(rewards), groups)
        return total, {**group_metrics(size_g, singleton_g, zero_var_g), "reward_components": int(components.shape[1])}
    # the plain sequence estimators read no token: a layout of empty rows gives their A_i and metrics
    result = get_advantage_estimator(cfg.estimator)(
        rewards_B=rewards, group_index_B=groups, layout=Layout.from_lengths(np.zeros(rewards.size, dtype=np.int64)),
        mask_N=np.zeros(0, dtype=bool), token_rewards_N=None, values_N=None, component_rewards_BK=components,
        options=options)
    return result.sequence_advantages_B, dict(result.metrics)


@dataclass
class TokenSums:
    """What the token passes found: counts, KL row sums, and the float64 sums the metrics and whitening use."""

    n_mask: int = 0
    n_est: int = 0
    kl_B: np.ndarray | None = None
    token_reward_mean: float = 0.0
    raw_mean: float = 0.0
    return_mean: float = 0.0
    whitening: Whitening | None = None
    has_valid: np.ndarray | None = None  # bool per kept row: a token in the estimator's mask


def count_pass(plan: RowPlan, cfg: AdvantageConfig, sources: Sources) -> TokenSums:
    """The masks alone: how many policy and estimator tokens there are, and which rows have one."""
    sums, has_valid = TokenSums(), []
    for index in range(len(plan.chunks)):
        chunk = chunk_token_math(plan, cfg, sources, index, mask_only=True)
        sums.n_mask += int(np.count_nonzero(chunk.mask))
        sums.n_est += int(np.count_nonzero(chunk.estimator_mask))
        counts = np.zeros(chunk.layout.num_rows, dtype=np.int64)
        rows_of_tokens = np.repeat(np.arange(chunk.layout.num_rows), chunk.layout.lengths)
        np.add.at(counts, rows_of_tokens[chunk.estimator_mask], 1)
        has_valid.append(counts > 0)
    sums.has_valid = np.concatenate(has_valid) if has_valid else np.zeros(0, dtype=bool)
    return sums


def mean_of(total: StreamedSum, n: int) -> float:
    """np.mean's value: the pairwise sum over the count (0.0 for no values, as the stage reports it)."""
    return float(np.float64(total.total()) / n) if n else 0.0


def sums_pass(plan: RowPlan, cfg: AdvantageConfig, sources: Sources, sums: TokenSums,
              sequence_values: np.ndarray | None, whiten: bool) -> None:
    """Token estimators: KL row sums and the token means; whitening's centre and scale (two passes)."""
    raw, rewards = StreamedSum(sums.n_est), StreamedSum(sums.n_mask)
    returns = StreamedSum(sums.n_est)
    kl = []
    for index in range(len(plan.chunks)):
        chunk = chunk_token_math(plan, cfg, sources, index, sequence_values=sequence_values)
        raw.add(chunk.raw[chunk.estimator_mask])
        if chunk.kl_B is not None:
            kl.append(chunk.kl_B)
            rewards.add(chunk.token_rewards[chunk.mask])
        if chunk.returns is not None:
            returns.add(chunk.returns[chunk.estimator_mask])
    if sequence_values is None:
        sums.kl_B = np.concatenate(kl) if kl else np.zeros(0)
        sums.token_reward_mean = mean_of(rewards, sums.n_mask)
        sums.raw_mean = mean_of(raw, sums.n_est) if cfg.needs_critic else 0.0
        if cfg.needs_critic:
            sums.return_mean = mean_of(returns, sums.n_est)
    if not whiten:
        return
    n = sums.n_est
    mean = np.float64(raw.total()) / n if n else np.float64(0.0)
    squares = StreamedSum(n)
    for index in range(len(plan.chunks)):
        chunk = chunk_token_math(plan, cfg, sources, index, sequence_values=sequence_values)
        deviations = chunk.raw[chunk.estimator_mask]
        deviations -= mean
        np.square(deviations, out=deviations)
        squares.add(deviations)
    sums.whitening = whitening_from_sums(float(mean), squares.total() if n else 0.0, n, form=cfg.whiten_form,
                                         eps=cfg.whiten_eps)


def full_rows(rows: pl.DataFrame, plan: RowPlan, stats: pl.DataFrame, cfg: AdvantageConfig) -> pl.DataFrame:
    """Every file row's row-level columns, left-out rows with their group's statistics (as
    `compute_advantages` fills them), in key order."""
    if plan.kept.all():
        return stats
    left = rows.filter(pl.Series(~plan.kept))
    extra = left_out_rows(left, stats, left_out(left, cfg)[0])
    return pl.concat([stats, extra.select(stats.columns)]).sort(["prompt_id", "sample_idx"])


def spread_into(values_kept: np.ndarray, lengths: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """A chunk's token values for every file row: the kept rows' values, 0 at the left-out rows' tokens."""
    if kept.all():
        return values_kept
    out = np.zeros(int(lengths.sum()), dtype=values_kept.dtype)
    out[np.repeat(kept, lengths)] = values_kept
    return out


def output_frames(plan: RowPlan, cfg: AdvantageConfig, sources: Sources, full: pl.DataFrame, sums: TokenSums,
                  sequence_values: np.ndarray | None, advantage_B: np.ndarray | None,
                  adv_sum: StreamedSum | None, abs_sum: StreamedSum | None) -> Iterator[pl.DataFrame]:
    """The advantage table a chunk at a time; adds the token estimators' final advantages to the sums."""
    plain_sequence = cfg.estimator not in TOKEN_ESTIMATORS + WHITENED_SEQUENCE_ESTIMATORS
    for index, (start, stop) in enumerate(plan.chunks):
        kept, rows = plan.kept_rows(index)
        lengths = plan.lengths[start:stop]
        chunk = chunk_token_math(plan, cfg, sources, index, mask_only=plain_sequence,
                             sequence_values=None if plain_sequence else sequence_values)
        if plain_sequence:  # as `AdvantageResult.token_advantages_as(np.float32)`: A_i cast, then spread
            tokens = chunk.layout.broadcast(sequence_values[rows].astype(np.float32))
            tokens[~chunk.estimator_mask] = 0
        else:
            final = sums.whitening.apply(chunk.raw, chunk.estimator_mask) if sums.whitening else chunk.raw
            if adv_sum is not None:
                valid = final[chunk.estimator_mask]
                adv_sum.add(valid)
                abs_sum.add(np.abs(valid))
            tokens = final.astype(np.float32)
        frame = full[start:stop]
        returns = (list_column("returns", spread_into(chunk.returns.astype(np.float32), lengths, kept), lengths,
                               TOKEN_FLOATS) if chunk.returns is not None
                   else pl.Series("returns", [None] * frame.height, dtype=TOKEN_FLOATS))
        advantage = (pl.Series("advantage", advantage_B[start:stop], dtype=pl.Float32) if advantage_B is not None
                     else pl.Series("advantage", [None] * frame.height, dtype=pl.Float32))
        yield frame.with_columns(
            advantage, list_column("token_advantages", spread_into(tokens, lengths, kept), lengths, TOKEN_FLOATS),
            returns,
        ).select("prompt_id", "sample_idx", "group_size", "group_reward_mean", "group_reward_std", "advantage",
                 "token_advantages", "returns", "filtered_reason")


def stream_advantages(rows: pl.DataFrame, cfg: AdvantageConfig, reward_weights: dict[str, float] | None,
                      sources: Sources, out: str, metadata: dict[str, Any], *, chunk_size: int = CHUNK_TOKENS
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`compute_advantages` + `write_artifact` for an iteration read a chunk at a time: writes ``out`` and
    returns (metrics, KL-controller record). ``rows``: one row per file row, the row-level columns only."""
    plan, stats = row_plan(rows, cfg, chunk_size)
    inside = rows if plan.kept.all() else rows.filter(pl.Series(plan.kept))
    groups = inside["prompt_id"].to_numpy()
    weights = list(reward_weights.values()) if reward_weights else None
    components = (np.stack([inside[c].cast(pl.Float64).fill_null(np.nan).to_numpy() for c in reward_weights], axis=1)
                  if cfg.uses_reward_components else None)
    options = estimator_options(cfg, weights)
    token_level = cfg.estimator in TOKEN_ESTIMATORS
    sequence_values, estimator_metrics = (None, {}) if token_level else sequence_values_of(
        cfg, plan, groups, components, options)
    sums = count_pass(plan, cfg, sources)
    whitened = cfg.estimator in WHITENED_SEQUENCE_ESTIMATORS
    if token_level or whitened:
        sums_pass(plan, cfg, sources, sums, sequence_values, whiten=whitened or cfg.estimator == "reinforce_plus_plus"
                  or cfg.whiten)
    seq_adv = sequence_values
    if whitened:  # A_i of a row = its first valid token's whitened value, 0 for a row without one
        seq_adv = sums.whitening.apply(seq_adv, sums.has_valid)
    advantage_B = None
    if seq_adv is not None:
        advantage_B = np.zeros(plan.kept.size, dtype=np.float32)
        advantage_B[plan.kept] = np.asarray(seq_adv).astype(np.float32)
    full = full_rows(rows, plan, stats, cfg)
    adv_sum = abs_sum = None
    if token_level:
        adv_sum, abs_sum = StreamedSum(sums.n_est), StreamedSum(sums.n_est)
    write_artifact_parts(output_frames(plan, cfg, sources, full, sums, sequence_values, advantage_B, adv_sum, abs_sum),
                         out, ADVANTAGES, metadata=metadata)
    metrics = outcome_metrics(cfg, full["filtered_reason"], seq_adv, estimator_metrics)
    if token_level:
        metrics["num_valid_tokens"] = sums.n_est
        if cfg.estimator == "gae":
            metrics.update(raw_advantage_mean=sums.raw_mean, return_mean=sums.return_mean)
        metrics["advantage_mean"] = mean_of(adv_sum, sums.n_est)
        metrics["advantage_abs_mean"] = mean_of(abs_sum, sums.n_est)
    kl_state = kl_controller_state(cfg, sums.kl_B if token_level else None)
    if token_level:
        metrics.update(kl_reward_metrics(kl_state, sums.token_reward_mean))
    if not plan.kept.all():
        metrics["unscorable"] = int((~plan.kept).sum()) - metrics["filtered"][FILTER_INFRA_ERROR]
    return metrics, kl_state

