"""Rewards: pure rule-based reward functions, the name -> function registry, and per-sample scoring.

`functions` holds the `Sample` a reward sees and the built-in rewards (`REWARD_FUNCTIONS`);
`registry` resolves params.yaml names (built-in or "package.module:function"), checks their options
up front, names their Parquet columns and scores one sample. No torch here: the score stage must start fast.
"""

from rlpipe.rewards.functions import (
    REWARD_FUNCTIONS,
    Sample,
    digit_match,
    exact_answer,
    format_regex,
    length_penalty,
)
from rlpipe.rewards.registry import (
    RewardSpec,
    check_reward_options,
    component_column,
    component_columns,
    prepare_rewards,
    resolve_reward,
    score_sample,
)

__all__ = [
    "REWARD_FUNCTIONS",
    "Sample",
    "digit_match",
    "exact_answer",
    "format_regex",
    "length_penalty",
    "RewardSpec",
    "check_reward_options",
    "component_column",
    "component_columns",
    "prepare_rewards",
    "resolve_reward",
    "score_sample",
]
