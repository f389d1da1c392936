"""Assemble the trainer's inputs from the stage artifacts, joined and checked on their keys."""
from __future__ import annotations

import numpy as np
import polars as pl

from rlpipe.errors import ArtifactError
from rlpipe.io import Artifact, join_on_keys
from rlpipe.training.loop import TrainingData


def check_policy_version(rollouts: Artifact, *, expected: int, policy_dir: str, stored: int | None) -> None:
    """Refuse rollouts sampled by another policy than the one being trained (PPO needs pi_old == sampler)."""
    got = rollouts.metadata.get("policy_version")
    if got != expected:
        raise ArtifactError(f"{rollouts.path}: sampled by policy version {got}, but params iteration is {expected}; "
                            "re-run generate for this iteration")
    if stored is not None and stored != expected:
        raise ArtifactError(f"{policy_dir}: holds policy version {stored}, but the rollouts came from version "
                            f"{expected}")


def training_frame(rollouts: Artifact, advantages: Artifact, ref_logprobs: Artifact) -> pl.DataFrame:
    joined = join_on_keys(rollouts, advantages, columns=["token_advantages", "filtered_reason"])
    with_advantages = Artifact(frame=joined, metadata=rollouts.metadata, path=rollouts.path)
    return join_on_keys(with_advantages, ref_logprobs, columns=["ref_logprobs"])


def training_data(frame: pl.DataFrame) -> TrainingData:
    return TrainingData(
        prompt_token_ids=frame["prompt_token_ids"].to_list(),
        completion_token_ids=frame["completion_token_ids"].to_list(),
        token_advantages=[np.asarray(x, dtype=np.float32) for x in frame["token_advantages"].to_list()],
        ref_logprobs=[np.asarray(x, dtype=np.float32) for x in frame["ref_logprobs"].to_list()],
        trainable=(frame["filtered_reason"].is_null() & (frame["completion_length"] > 0)).to_numpy(),
    )
