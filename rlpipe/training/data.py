"""Assemble the trainer's inputs from the stage artifacts, joined and checked on their keys."""
from __future__ import annotations

import numpy as np
import polars as pl

from rlpipe.data.io import Artifact, join_on_keys, require_critic_values
from rlpipe.data.lists import row_arrays
from rlpipe.errors import ArtifactError
from rlpipe.training.objective import TrainingData


# what train reads of the tables: the texts, turns and tool calls of the rollouts stay on disk
TRAINED_ROLLOUT_COLUMNS = ["prompt_token_ids", "completion_token_ids", "completion_length", "sampler_logprobs",
                           "policy_mask"]
TRAINED_ADVANTAGE_COLUMNS = ["advantage", "token_advantages", "returns", "filtered_reason"]


def check_policy_version(rollouts: Artifact, *, sampler_version: int, iteration: int, max_staleness: int,
                         policy_dir: str, stored: int | None) -> int:
    """Refuse rollouts from another sampler than params.yaml names, or staler than ``max_staleness``; return
    the staleness (iteration - sampler version: 0 when synchronous).

    ``policy_dir`` (train's start, policy.latest_path) must hold version ``iteration``: the weights this
    iteration trains are always the newest, whatever policy sampled the rollouts.
    """
    got = rollouts.metadata.get("policy_version")
    if got != sampler_version:
        raise ArtifactError(f"{rollouts.path}: sampled by policy version {got}, but params policy.version is "
                            f"{sampler_version} (iteration {iteration}); re-run generate for this iteration")
    staleness = iteration - got
    if not 0 <= staleness <= max_staleness:
        raise ArtifactError(f"{rollouts.path}: sampled by policy version {got}, {staleness} versions behind iteration "
                            f"{iteration}; policy.max_staleness allows {max_staleness}")
    if stored is not None and stored != iteration:
        raise ArtifactError(f"{policy_dir}: holds policy version {stored}, but train starts iteration {iteration} "
                            f"from version {iteration} (policy.latest_path)")
    return staleness


def training_frame(rollouts: Artifact, advantages: Artifact, ref_logprobs: Artifact,
                   values: Artifact | None = None) -> pl.DataFrame:
    """Rollouts joined with advantages and reference log-probs (and, for gae, the critic's values)."""
    def extend(frame: pl.DataFrame, right: Artifact, columns: list[str]) -> pl.DataFrame:
        return join_on_keys(rollouts.with_frame(frame), right, columns=columns)

    frame = extend(rollouts.frame, advantages, TRAINED_ADVANTAGE_COLUMNS)
    frame = extend(frame, ref_logprobs, ["ref_logprobs"])
    if values is not None:
        frame = extend(frame, require_critic_values(values), ["values"])
        missing = frame.filter(pl.col("returns").is_null())
        if missing.height:
            raise ArtifactError(f"{advantages.path}: column 'returns' is null for {missing.height} row(s); "
                                "the critic needs returns (advantage.estimator: gae)")
    return frame


def _policy_masks(frame: pl.DataFrame) -> list[np.ndarray] | None:
    """Per row, which completion tokens the policy sampled; None when every token is (single-turn)."""
    if frame["policy_mask"].list.all().fill_null(True).all():
        return None
    return row_arrays(frame["policy_mask"], bool)


def training_data(frame: pl.DataFrame) -> TrainingData:
    token_adv = row_arrays(frame["token_advantages"], np.float32)
    # off-policy masking needs the sign of A_i; token-level estimators have none, so their mean stands in
    seq_adv = np.array([a if a is not None else (float(t.mean()) if t.size else 0.0)
                        for a, t in zip(frame["advantage"].to_list(), token_adv)], dtype=np.float32)
    with_critic = "values" in frame.columns
    return TrainingData(
        prompt_token_ids=row_arrays(frame["prompt_token_ids"], np.int64),
        completion_token_ids=row_arrays(frame["completion_token_ids"], np.int64),
        token_advantages=token_adv,
        ref_logprobs=row_arrays(frame["ref_logprobs"], np.float32),
        sampler_logprobs=row_arrays(frame["sampler_logprobs"], np.float32),
        sequence_advantages=seq_adv,
        trainable=(frame["filtered_reason"].is_null()
                   & (frame["policy_mask"].list.sum().fill_null(0) > 0)).to_numpy(),
        policy_mask=_policy_masks(frame),
        old_values=row_arrays(frame["values"], np.float32) if with_critic else None,
        returns=row_arrays(frame["returns"], np.float32) if with_critic else None,
    )
