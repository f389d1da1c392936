"""A test environment that needs no tool syntax from the model: any model (a random one too) goes multi-turn.

Importable as ``tests.environments.echo:Echo`` (generate.environment.name) from a stage run in the repo.
"""
from __future__ import annotations

from rlpipe.environments import Environment, Step, Task, Turn


class Echo(Environment):
    """Answers each turn with a tool message of digits (the turn's index and token count); done after
    ``turns`` turns, rewarding 0.5 per answered turn and 1.0 at the end."""

    def __init__(self, task: Task, *, turns: int = 3) -> None:
        super().__init__(task)
        self.turns = turns

    def step(self, turn: Turn) -> Step:
        if turn.index + 1 >= self.turns:
            return Step(done=True, reward=1.0)
        return Step(observation=({"role": "tool", "content": f"{turn.index}{len(turn.token_ids)}"},), reward=0.5)
