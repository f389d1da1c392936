"""Pure RL math: advantages and their registry (numpy), KL estimators, policy/value losses and loss aggregation (torch).

The names below are re-exported lazily (PEP 562 `__getattr__`): `import rlpipe.algorithms.advantages`
must not import torch, because the advantage stage is numpy-only and should start fast. Accessing a
torch name here (e.g. `rlpipe.algorithms.ppo_clip_loss`) imports its module on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS: dict[str, tuple[str, ...]] = {
    "estimators": (
        "ADVANTAGE_ESTIMATORS",
        "ADVANTAGE_ESTIMATOR_OPTIONS",
        "AdvantageResult",
        "get_advantage_estimator",
    ),
    "advantages": (
        "GRPO_STD_MODES",
        "SINGLETON_GROUPS",
        "WHITEN_FORMS",
        "adaptive_kl_beta",
        "as_bool_mask",
        "dr_grpo_advantages",
        "gae_advantages",
        "grpo_advantages",
        "kl_penalized_token_rewards",
        "reinforce_plus_plus_advantages",
        "reward_to_go",
        "rloo_advantages",
        "token_kl",
        "whiten",
    ),
    "kl": (
        "KL_CLAMP_SCOPES",
        "KL_ESTIMATORS",
        "KL_VALUE_CLAMP",
        "LOG_RATIO_CLAMP",
        "get_kl_estimator",
        "importance_weighted_kl",
        "kl_clamps",
        "kl_k1",
        "kl_k2",
        "kl_k3",
    ),
    "losses": (
        "POLICY_LOSS_OPTIONS",
        "POLICY_LOSSES",
        "cispo_loss",
        "gmpo_loss",
        "sapo_loss",
        "bradley_terry_loss",
        "entropy_from_logits",
        "ENTROPY_MASK_FORMS",
        "entropy_bonus_terms",
        "get_policy_loss",
        "gspo_loss",
        "gspo_token_loss",
        "health_to_host",
        "masked_mean",
        "off_policy_sequence_mask",
        "policy_health_metrics",
        "policy_health_tensors",
        "ppo_clip_loss",
        "truncated_importance_weights",
        "value_loss",
    ),
    "aggregation": (
        "LOSS_AGGREGATIONS",
        "SEQUENCE_COUNTS",
        "TOKEN_MEAN_SCOPES",
        "aggregate_loss",
        "count_valid",
        "loss_normalisers",
        "step_sequence_count",
    ),
}

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


if TYPE_CHECKING:  # let type checkers and IDEs see the lazy names
    from rlpipe.algorithms.advantages import *  # noqa: F401,F403
    from rlpipe.algorithms.aggregation import *  # noqa: F401,F403
    from rlpipe.algorithms.estimators import *  # noqa: F401,F403
    from rlpipe.algorithms.kl import *  # noqa: F401,F403
    from rlpipe.algorithms.losses import *  # noqa: F401,F403


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
