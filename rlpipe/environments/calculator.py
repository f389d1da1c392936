"""The calculator environment of the tiny multi-turn task: one tool, ``add``, called as ``<call>add(a,b)</call>``.

The tiny model cannot add two five-digit numbers itself, but it can copy: ask the tool, read its
result, write it as the answer. The syntax is the python one with the tiny tokenizer's special
tokens ``<call>`` / ``</call>`` as markers (rlpipe/tiny/tool_task.py builds that tokenizer).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from rlpipe.environments.base import Task, ToolCall
from rlpipe.environments.tools import ToolEnvironment


def add(a: int, b: int) -> int:
    """The calculator's one tool.

    >>> add(31415, 92653)
    124068
    """
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int):
        raise TypeError(f"add takes two integers, got {a!r} and {b!r}")
    return a + b


class CalculatorEnvironment(ToolEnvironment):
    """`ToolEnvironment` with the ``add`` tool, python syntax and the tiny template's markers.

    A failed call shows an empty result (``<tool><ai>``): the tiny vocabulary cannot spell an error
    message, and every character of one would be an ``<unk>`` token; the status is still recorded.

    max_tool_errors: failed calls allowed per episode before it ends as tool_error (-1: never).
    """

    def __init__(self, task: Task, *, max_tool_errors: int = -1) -> None:
        super().__init__(task, tools={"add": add}, syntax="python", call_start="<call>", call_end="</call>",
                         max_calls_per_turn=1, max_result_chars=32, max_tool_errors=max_tool_errors)

    def _one(self, kind: str, payload: Any) -> ToolCall:
        call = super()._one(kind, payload)
        return call if call.status == "ok" else replace(call, result="")
