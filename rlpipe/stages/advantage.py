"""The advantage stage's logic: group statistics, advantages per sample and per token, DAPO filters,
and for the token-reward estimators (reinforce_plus_plus, gae) the KL-in-reward with its adaptive
controller.

numpy/polars only (no torch, no model), so this stage starts and finishes in about a second and a
reward change re-runs it cheaply.

The KL penalty in the reward uses the *sampler's* log-probs as log pi_old: the trainer recomputes
pi_old only inside train, after this stage. With the HF engine the two agree to ~1e-7 on CPU; with
vLLM the gap is reported every iteration (train metrics ``sampler_mismatch_*``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from rlpipe.algorithms import ragged
from rlpipe.algorithms.advantages import adaptive_kl_beta
from rlpipe.algorithms.estimators import get_advantage_estimator
from rlpipe.algorithms.ragged import Layout
from rlpipe.config import AdvantageConfig, Params
from rlpipe.data.io import Artifact, join_on_keys, read_artifact, require_critic_values
from rlpipe.data.lists import flat_values, list_column
from rlpipe.data.schema import REF_LOGPROBS, ROLLOUTS, SCORES, TOKEN_FLOATS, VALUES, component_column
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
    infra = (rows["finish_reason"] == FILTER_INFRA_ERROR).to_numpy() if "finish_reason" in rows.columns else None
    infra = np.zeros(rows.height, dtype=bool) if infra is None else infra
    unscorable = (rows["reward"].is_nan().fill_null(True).to_numpy() if cfg.nan_rewards == "zero_advantage"
                  else np.zeros(rows.height, dtype=bool))
    left = infra | unscorable
    if not left.any():
        return _compute_advantages(rows, cfg, reward_weights)
    frame, metrics, kl_state = _compute_advantages(rows.filter(~pl.Series(left)), cfg, reward_weights)
    left_out = rows.filter(pl.Series(left))
    reasons = [FILTER_INFRA_ERROR if bad else None for bad in infra[left]]
    groups = frame.group_by("prompt_id").agg(pl.col("group_size", "group_reward_mean", "group_reward_std").first())
    lengths = left_out["completion_length"].to_numpy()
    zeros = list_column("token_advantages", np.zeros(int(lengths.sum()), dtype=np.float32), lengths, TOKEN_FLOATS)
    extra = left_out.select("prompt_id", "sample_idx").join(groups, on="prompt_id", how="left").with_columns(
        pl.col("group_size").fill_null(0), pl.col("group_reward_mean", "group_reward_std").fill_null(0.0),
        pl.lit(None if cfg.uses_token_rewards else 0.0, dtype=pl.Float32).alias("advantage"),
        zeros,
        zeros.alias("returns") if cfg.needs_critic else pl.Series("returns", [None] * left_out.height,
                                                                   dtype=TOKEN_FLOATS),
        pl.Series("filtered_reason", reasons, dtype=pl.String),
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
        old = flat_values(rows["sampler_logprobs"], np.float64)
        ref = flat_values(rows["ref_logprobs"], np.float64)
        k = cfg.kl_in_reward
        kl = ragged.token_kl(old, ref, mask, estimator=k.estimator)
        del old, ref
        kl_B = ragged.row_sums(kl, layout)
        token_rewards = ragged.penalized_rewards(rewards, kl, mask, layout, beta=k.beta)  # in place: kl is gone
    if cfg.needs_critic:
        values = flat_values(rows["values"], np.float64)
    ddof = 1 if cfg.std_mode == "sample" else 0
    stats = rows.select(
        "prompt_id", "sample_idx", "truncated",
        pl.len().over("prompt_id").cast(pl.Int32).alias("group_size"),
        pl.col("reward").mean().over("prompt_id").alias("group_reward_mean"),
        pl.col("reward").std(ddof=ddof).over("prompt_id").fill_null(0.0).fill_nan(0.0).alias("group_reward_std"),
    )
    zero_var = stats["group_reward_std"].to_numpy() == 0.0
    reason = np.full(rows.height, None, dtype=object)
    if cfg.drop_truncated:
        reason[stats["truncated"].to_numpy()] = FILTER_TRUNCATED
    if cfg.drop_zero_variance_groups:
        reason[zero_var] = FILTER_ZERO_VARIANCE
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
    frame = stats.drop("truncated").with_columns(
        pl.Series("advantage", [None] * rows.height if seq_adv is None else seq_adv.astype(np.float32),
                  dtype=pl.Float32),
        list_column("token_advantages", result.token_advantages_as(np.float32), lengths, TOKEN_FLOATS),
        returns,
        pl.Series("filtered_reason", reason.tolist(), dtype=pl.String),
    )
    kept = frame["filtered_reason"].is_null()
    metrics = {
        "estimator": cfg.estimator,
        "num_samples": frame.height,
        "num_trained": int(kept.sum()),
        "filtered": {k: int((frame["filtered_reason"] == k).sum()) for k in (FILTER_ZERO_VARIANCE, FILTER_TRUNCATED,
                                                                                FILTER_INFRA_ERROR)},
        "advantage_mean": float(np.mean(seq_adv)) if seq_adv is not None else None,
        "advantage_abs_mean": float(np.mean(np.abs(seq_adv))) if seq_adv is not None else None,
        **{k: v for k, v in result.metrics.items()},
    }
    kl_state = kl_controller_state(cfg, kl_B)
    if kl_B is not None:
        metrics.update({"kl_reward_beta": kl_state["beta"], "kl_reward_observed": kl_state["observed_kl"],
                        "kl_reward_next_beta": kl_state["next_beta"],
                        "token_reward_mean": float(token_rewards[mask].mean()) if mask.any() else 0.0})
    if seq_adv is None:  # token-level estimators: report the token advantages' spread instead
        flat = result.tokens_N[estimator_mask]
        metrics["advantage_mean"] = float(flat.mean()) if flat.size else 0.0
        metrics["advantage_abs_mean"] = float(np.abs(flat).mean()) if flat.size else 0.0
    return frame, metrics, kl_state


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
