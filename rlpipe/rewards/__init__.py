"""Rewards: pure rule-based reward functions, the name -> function registry, and per-sample scoring.

`functions` holds the `Sample` a reward sees and the built-in rewards (`REWARD_FUNCTIONS`);
`trl_style` runs TRL-style functions (``fn(prompts, completions, **columns)``) as batch rewards;
`columns` imports a user's ``module:function`` and checks the prompt-file columns a TRL-style one needs;
`registry` resolves params.yaml names (built-in or "package.module:function"), checks their options
up front, names their Parquet columns and scores one sample; `code` runs model-written code for
the `code_tests` reward; `model_reward` scores with a trained reward model in batches (`reward_model`).
No torch at import: the score stage must start fast (`reward_model` imports it when called).
"""

from rlpipe.rewards.code import code_tests
from rlpipe.rewards.functions import (
    REWARD_FUNCTIONS,
    RewardResult,
    Sample,
    batch_reward,
    digit_match,
    environment_reward,
    exact_answer,
    format_regex,
    length_penalty,
)
from rlpipe.rewards.model_reward import reward_model
from rlpipe.rewards.registry import (
    RewardSpec,
    batch_values,
    check_reward_options,
    component_column,
    component_columns,
    is_batch_reward,
    prepare_rewards,
    resolve_reward,
    score_sample,
    score_sample_details,
)

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardResult",
    "Sample",
    "batch_reward",
    "digit_match",
    "environment_reward",
    "exact_answer",
    "format_regex",
    "length_penalty",
    "RewardSpec",
    "batch_values",
    "check_reward_options",
    "component_column",
    "component_columns",
    "is_batch_reward",
    "prepare_rewards",
    "resolve_reward",
    "score_sample",
    "score_sample_details",
    "code_tests",
    "reward_model",
]
