"""What a reward function sees and returns: the `Sample`, a `RewardResult` with its label, and the
`batch_reward` mark for rewards that take every row at once.

Why a module of its own: the built-in rewards (`functions`), the reward model's (`model_reward`) and the
code judge's (`code`) all build on these, and `functions` lists the other two in `REWARD_FUNCTIONS`;
with the contract here, every arrow points one way. Users import these names from `rlpipe.rewards`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Sample", "RewardResult", "batch_reward"]


@dataclass(frozen=True)
class Sample:
    """What one reward call sees: one decoded completion and its prompt's fields."""

    prompt: str  # decoded prompt text
    completion: str  # decoded completion text, EOS and special tokens stripped; multi-turn: the final model turn
    answer: str | None  # ground truth from the prompt file; None when the file has none
    metadata: dict  # extra per-prompt fields (parsed JSON); {} when there are none
    completion_tokens: int  # number of generated tokens
    truncated: bool  # hit max_new_tokens without emitting EOS
    # token ids: read-only sequences of ints (the score stage hands views of the table's columns: `list(ids)`
    # makes a list); None where not known, or where no configured reward can read them (built-ins only)
    prompt_token_ids: Sequence[int] | None = None  # tokens the sampler conditioned on
    completion_token_ids: Sequence[int] | None = None  # generated tokens, EOS included
    # Multi-turn rollouts (docs/multi-turn.md); None for single-turn ones.
    turns: Sequence[str] | None = None  # every model turn's text, the last being `completion`
    tool_calls: Sequence[dict] | None = None  # {turn, name, arguments, status, result} per tool call
    turn_rewards: Sequence[float | None] | None = None  # the environment's reward after each turn (None: none given)
    # A conversational prompt file's (TRL's format): this prompt's {role, content} messages, as the file gave
    # them (`prompt` is their rendering by the chat template); None for a file of prompt strings.
    prompt_messages: Sequence[dict] | None = None


@dataclass(frozen=True)
class RewardResult:
    """A reward value with a label of how it came about, e.g. ``RewardResult(0.0, "timeout")``.

    The score stage stores the value like a plain float and counts the labels per reward in its
    metrics (``details``), so the label must come from a small fixed set: it is a metric key.
    """

    value: float
    detail: str  # a short label from a fixed set (<= 64 characters)

    def __post_init__(self) -> None:
        if not isinstance(self.detail, str) or not 0 < len(self.detail) <= 64:
            raise ValueError(f"RewardResult.detail must be a label of 1 to 64 characters, got {self.detail!r}")


def batch_reward(fn: Callable) -> Callable:
    """Mark ``fn`` as a batch reward: ``fn(samples, **options) -> sequence of floats``, one per sample.

    Why a second kind: a reward that runs a model (`reward_model`) must see many rows at once to
    batch them, and must load its model once per stage, not once per row. The score stage calls
    a batch reward once with every row, on its main thread, before the per-row rewards; its
    values are then combined with theirs row by row. ``score.row_timeout_s`` does not bound it.
    Usable on a user's ``"package.module:function"`` too.
    """
    fn.batch_reward = True
    return fn
