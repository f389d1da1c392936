"""Rewards: pure rule-based reward functions, the name -> function registry, and per-sample scoring.

`functions` holds the `Sample` a reward sees and the built-in rewards (`REWARD_FUNCTIONS`);
`registry` resolves params.yaml names (built-in or "package.module:function"), checks their options
up front, names their Parquet columns and scores one sample; `sandbox` runs model-written code for
the `code_tests` reward. No torch here: the score stage must start fast.
"""

from rlpipe.rewards.functions import (
    REWARD_FUNCTIONS,
    RewardResult,
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
    score_sample_details,
)
from rlpipe.rewards.sandbox import code_tests

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardResult",
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
    "score_sample_details",
    "code_tests",
]
