"""Environments and tools for multi-turn rollouts: the model acts, an environment answers, the model goes on.

This subpackage owns everything between two model turns: the `Environment` contract (`base`: created
once per (prompt, sample) with the prompt's fields, it receives each model turn and returns an
observation, a done flag and optionally a reward), the tool-calling environment built on it
(`tools`: functions the user registers, called from the model's tool-call syntax) with its built-in
instances (`calculator` for the tiny task, `python_tool` running code in the code reward's sandbox),
the chat-template arithmetic that turns an observation into the exact token ids the template would
render (`template`), and the driver that runs a whole iteration's rollouts through any
`rlpipe.engines.base.GenerationEngine` (`driver`), token-exact and deterministic, with tools running
concurrently (`rlpipe.reports.turn_view` draws a rollout's turns for `rlpipe inspect`). It may import
`rlpipe.engines.base`, `rlpipe.config`, `rlpipe.data.io`, `rlpipe.data.schema` and `rlpipe.errors`; only the
python tool reaches into `rlpipe.rewards` (the sandbox), lazily. See docs/multi-turn.md.
"""
from rlpipe.environments.base import (
    ENVIRONMENTS,
    FINISH_REASONS,
    TOOL_STATUSES,
    Environment,
    InfrastructureError,
    Step,
    Task,
    ToolCall,
    Turn,
    resolve_environment,
)
from rlpipe.environments.tools import ToolEnvironment, parse_tool_calls

__all__ = [
    "ENVIRONMENTS",
    "FINISH_REASONS",
    "TOOL_STATUSES",
    "Environment",
    "InfrastructureError",
    "Step",
    "Task",
    "ToolCall",
    "ToolEnvironment",
    "Turn",
    "parse_tool_calls",
    "resolve_environment",
]
