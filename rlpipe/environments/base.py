"""The environment contract: what an environment is created with, what it receives, what it returns.

One environment instance lives for one trajectory, a (prompt, sample) pair: the driver creates it with
the prompt's fields (`Task`), hands it every model turn that ended with EOS (`Turn`), and reads back a
`Step`: the observation to append (chat messages, rendered by the tokenizer's chat template), whether
the episode is over, an optional reward for the turn, the tool calls it made and, when a tool failure
must end the episode, an error. Why an instance per trajectory rather than per prompt: samples of one
prompt are independent trajectories, and a stateful environment (a file system, a game) must not
leak one sample's actions into another's.

Who is at fault decides the finish reason (``FINISH_REASONS``): a tool the model called wrongly is
the model's doing (an observation it can read, or ``tool_error`` once the environment gives up), while
an environment that raises, hangs past ``generate.environment.step_timeout_s`` or raises
`InfrastructureError` is not: the row becomes ``infra_error``, which the score stage turns into a row
error instead of a reward, so the policy never learns from it.

Environments are named in params like rewards: a built-in name (`ENVIRONMENTS`) or
``"package.module:Class"``; ``generate.environment.options`` are the constructor's keyword arguments,
checked against its signature before any sample is drawn.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from rlpipe.errors import ConfigError, InfrastructureError

# `InfrastructureError` (rlpipe.errors): raise it from a tool or an environment when a failure is not the
# model's (a sandbox that cannot start, a service that is down); any other exception escaping
# `Environment.step` counts the same way.
__all__ = ["ENVIRONMENTS", "FINISH_REASONS", "TOOL_STATUSES", "Environment", "InfrastructureError", "Step", "Task",
           "ToolCall", "Turn", "resolve_environment"]

# How a multi-turn rollout ended (single-turn rows keep the engines' "stop" / "length").
FINISH_REASONS = ("done", "max_turns", "max_tokens", "tool_error", "infra_error")
# What became of one tool call; anything but "ok" is shown to the model as an error message.
TOOL_STATUSES = ("ok", "parse_error", "unknown_tool", "bad_arguments", "error", "timeout")

ENVIRONMENTS = {
    "calculator": "rlpipe.environments.calculator:CalculatorEnvironment",
    "tools": "rlpipe.environments.tools:ToolEnvironment",
    "python": "rlpipe.environments.python_tool:PythonEnvironment",
}


@dataclass(frozen=True)
class Task:
    """What an environment is created with: one trajectory of one prompt."""

    prompt_id: int
    sample_idx: int
    prompt: str  # the prompt text after the chat template (what prepare tokenized)
    answer: str | None  # the prompt table's ground truth (None when the task has none)
    metadata: dict  # the prompt table's per-prompt fields (parsed JSON)
    seed: int  # for the environment's own randomness: derived from the sample seed, so reruns repeat it
    tool_timeout_s: float  # generate.environment.tool_timeout_s: the wall clock one tool call may take


@dataclass(frozen=True)
class Turn:
    """One model turn, exactly as sampled."""

    index: int  # 0 for the first turn
    text: str  # decoded with special tokens kept (tool-call markers may be special), the final EOS removed
    token_ids: tuple[int, ...]  # the sampled ids, EOS included


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the rollout table records it (column ``tool_calls``)."""

    name: str | None  # the tool the model named; None when the call did not parse that far
    arguments: str | None  # the arguments as JSON when they parsed, else the raw text; None when absent
    status: str  # one of TOOL_STATUSES
    result: str  # what the model is shown: the tool's output, or the error message

    def __post_init__(self) -> None:
        if self.status not in TOOL_STATUSES:
            raise ValueError(f"ToolCall.status must be one of {TOOL_STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class Step:
    """What an environment returns for one model turn.

    observation: chat messages (``{"role": ..., "content": ...}``) the template renders after the
        model's turn, followed by the next generation prompt; ignored when the episode ends.
    done: the episode is over (the model answered); the rollout's finish reason is ``done``.
    reward: this turn's reward, stored per turn (``turn_rewards``); None when the environment gives none.
    tool_calls: the calls made in this turn, recorded in the rollout table.
    error: set when a tool failure ends the episode: finish reason ``tool_error`` with this message.
    """

    observation: tuple[dict, ...] = ()
    done: bool = False
    reward: float | None = None
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)
    error: str | None = None

    def __post_init__(self) -> None:
        for message in self.observation:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise TypeError(f"an observation is a sequence of chat messages {{'role': str, 'content': str}}, "
                                f"got {message!r}")
        if not self.done and self.error is None and not self.observation:
            raise ValueError("a Step that does not end the episode needs an observation for the model's next turn")


class Environment:
    """Base class of environments: override `step` (and `close` if you hold resources).

    Subclasses take the `Task` as the first argument and their options as keyword arguments:
    ``def __init__(self, task, *, my_option): super().__init__(task); ...``. `step` runs in a worker
    thread (several trajectories' steps run at once), so an environment must not share mutable state
    with other instances without a lock. A trajectory's result must depend only on its own turns
    (and `Task.seed`), never on timing, or reruns stop being byte-identical.
    """

    def __init__(self, task: Task) -> None:
        self.task = task

    def step(self, turn: Turn) -> Step:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds; called once the trajectory is over."""


def _import_attribute(name: str) -> Any:
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"generate.environment.name: {name!r} is neither a built-in ({', '.join(ENVIRONMENTS)}) "
                          "nor of the form 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"generate.environment.name: {name!r}: cannot import module {module_name!r}: {e}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"generate.environment.name: {name!r}: module {module_name!r} has no attribute "
                              f"{attribute!r}")
        obj = getattr(obj, part)
    return obj


def resolve_environment(name: str, options: dict) -> type:
    """The environment class ``name`` stands for, with ``options`` checked against its constructor.

    Raises ConfigError naming the key at fault, before any sample is drawn.
    """
    cls = _import_attribute(ENVIRONMENTS.get(name, name))
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"generate.environment.name: {name!r} is not a subclass of "
                          "rlpipe.environments.Environment")
    if not isinstance(options, dict):
        raise ConfigError(f"generate.environment.options: expected a mapping, got {type(options).__name__}")
    try:
        inspect.signature(cls).bind(None, **options)
    except TypeError as e:
        raise ConfigError(f"generate.environment.options: {name}: {e}") from None
    return cls
