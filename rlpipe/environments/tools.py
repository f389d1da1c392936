"""The tool-calling environment: functions the user registers, called from the model's tool-call syntax.

Each model turn is searched for calls between ``call_start`` and ``call_end``. A turn without a call
is the model's answer: the episode is done. Otherwise every call runs (at most
``max_calls_per_turn``) and its result becomes one observation message, ``{"role": observation_role,
"name": tool, "content": result}``, which the chat template renders after the turn.

Syntaxes of the text between the markers (``syntax``):
  json    ``{"name": "add", "arguments": {"a": 1, "b": 2}}``, the Hermes format of Qwen2.5 and most
          open chat models (markers ``<tool_call>`` / ``</tool_call>``);
  python  ``add(1, 2)`` or ``add(a=1, b=2)``: a call of a plain name with literal arguments
          (numbers, strings, lists, dicts), parsed with `ast`, never evaluated.

Nothing the model writes can crash the environment: a call that does not parse, names an unknown
tool or passes arguments the function does not take becomes an error message the model reads
(``TOOL_STATUSES``). So does a tool that raises or runs past ``Task.tool_timeout_s`` (the call runs
in a daemon thread that is abandoned: Python cannot kill a thread, so a truly hung pure-Python tool
keeps its thread until the stage exits; tools that run untrusted code bound themselves in a process,
as the python tool does). A result longer than ``max_result_chars`` is cut, saying how much was cut.
After more than ``max_tool_errors`` failed calls in one episode the episode ends (finish reason
``tool_error``). A tool raising `InfrastructureError` ends the rollout as ``infra_error``.

Tools are registered as ``tools: {name: "package.module:function"}`` in
``generate.environment.options``, or as callables when a subclass passes them to ``__init__``.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from rlpipe.environments.base import Environment, InfrastructureError, Step, Task, ToolCall, Turn

SYNTAXES = ("json", "python")
_LITERAL_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.UnaryOp)


def load_tool(spec: str | Callable) -> Callable:
    """A tool function from a callable or a ``"package.module:function"`` name."""
    if callable(spec):
        return spec
    module_name, _, attribute = str(spec).partition(":")
    if not module_name or not attribute:
        raise ValueError(f"tool {spec!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"tool {spec!r}: cannot import module {module_name!r}: {e}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"tool {spec!r}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"tool {spec!r} is not callable")
    return obj


# ---------------------------------------------------------------------------------------------
# Parsing: text -> (name, args, kwargs) or an error message


def _literal(node: ast.AST) -> Any:
    if not isinstance(node, _LITERAL_NODES):
        raise ValueError(f"argument {ast.unparse(node)!r} is not a literal")
    return ast.literal_eval(node)


def _parse_python(body: str) -> tuple[str, list, dict]:
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a Python call: {e.msg}") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError("expected a call of a tool by name, like add(1, 2)")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise ValueError("*args and **kwargs are not allowed in a tool call")
    return call.func.id, [_literal(a) for a in call.args], {k.arg: _literal(k.value) for k in call.keywords}


def _parse_json(body: str) -> tuple[str, list, dict]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('expected {"name": "<tool>", "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        raise TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return obj["name"], [], arguments


def parse_tool_calls(text: str, *, syntax: str, call_start: str, call_end: str) -> list[tuple[str, Any]]:
    """Every call in ``text``, in order: ("call", (name, args, kwargs)) or ("parse_error", (raw, message)).

    A ``call_start`` without a ``call_end`` after it is a parse error (the model stopped mid-call).

    >>> parse_tool_calls("<call>add(1, b=2)</call>", syntax="python", call_start="<call>", call_end="</call>")
    [('call', ('add', [1], {'b': 2}))]
    >>> parse_tool_calls("the sum is 3", syntax="python", call_start="<call>", call_end="</call>")
    []
    """
    if syntax not in SYNTAXES:
        raise ValueError(f"syntax must be one of {SYNTAXES}, got {syntax!r}")
    parse = _parse_python if syntax == "python" else _parse_json
    out: list[tuple[str, Any]] = []
    for match in re.finditer(re.escape(call_start) + r"(.*?)(?:" + re.escape(call_end) + r"|\Z)", text, re.S):
        body = match.group(1)
        if not match.group(0).endswith(call_end):
            out.append(("parse_error", (body, f"no {call_end} after {call_start}")))
            continue
        try:
            out.append(("call", parse(body)))
        except (ValueError, TypeError) as e:
            out.append(("parse_error", (body, str(e))))
    return out


# ---------------------------------------------------------------------------------------------
# Running one call


def _run_with_timeout(fn: Callable, args: list, kwargs: dict, timeout_s: float) -> tuple[str, Any]:
    """("ok", value) | ("raised", exception) | ("timeout", None); the call runs in a daemon thread."""
    box: list[tuple[str, Any]] = []

    def target() -> None:
        try:
            box.append(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - anything a tool raises is reported, never re-raised here
            box.append(("raised", e))

    worker = threading.Thread(target=target, name="rlpipe-tool", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive() or not box:
        return "timeout", None
    return box[0]


def _json_or_raw(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were dropped.

    >>> cut("abcdefghij", 4)
    'abcd...[6 more characters]'
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"


class ToolEnvironment(Environment):
    """Calls registered tools from the model's turns; see the module docstring.

    tools: {name: "package.module:function" or a callable}.
    syntax: "json" or "python"; call_start / call_end: the markers around one call.
    max_calls_per_turn: calls beyond it in one turn are answered with an error message, not run.
    max_result_chars: a tool's result (or error) is cut to this many characters.
    max_tool_errors: failed calls allowed per episode; one more ends it as tool_error (-1: never).
    observation_role: the chat role of a tool result message ("tool" for most templates).
    """

    def __init__(self, task: Task, *, tools: Mapping[str, str | Callable], syntax: str = "json",
                 call_start: str = "<tool_call>", call_end: str = "</tool_call>", max_calls_per_turn: int = 4,
                 max_result_chars: int = 2000, max_tool_errors: int = -1, observation_role: str = "tool") -> None:
        super().__init__(task)
        if syntax not in SYNTAXES:
            raise ValueError(f"syntax must be one of {SYNTAXES}, got {syntax!r}")
        if not tools:
            raise ValueError("a ToolEnvironment needs at least one tool")
        if not call_start or not call_end:
            raise ValueError("call_start and call_end must be non-empty markers")
        if max_calls_per_turn < 1 or max_result_chars < 1:
            raise ValueError("max_calls_per_turn and max_result_chars must be >= 1")
        self.tools = {name: load_tool(spec) for name, spec in tools.items()}
        self.syntax, self.call_start, self.call_end = syntax, call_start, call_end
        self.max_calls_per_turn, self.max_result_chars = max_calls_per_turn, max_result_chars
        self.max_tool_errors, self.observation_role = max_tool_errors, observation_role
        self.errors = 0

    def step(self, turn: Turn) -> Step:
        found = parse_tool_calls(turn.text, syntax=self.syntax, call_start=self.call_start, call_end=self.call_end)
        if not found:
            return Step(done=True)
        calls = [self._one(kind, payload) if i < self.max_calls_per_turn else
                 ToolCall(None, None, "error", f"error: more than {self.max_calls_per_turn} tool calls in one turn")
                 for i, (kind, payload) in enumerate(found)]
        self.errors += sum(c.status != "ok" for c in calls)
        if 0 <= self.max_tool_errors < self.errors:
            return Step(done=True, tool_calls=tuple(calls),
                        error=f"{self.errors} failed tool calls, more than max_tool_errors={self.max_tool_errors}; "
                              f"last: {next(c.result for c in reversed(calls) if c.status != 'ok')}")
        observation = tuple({"role": self.observation_role, "name": c.name or "", "content": c.result} for c in calls)
        return Step(observation=observation, tool_calls=tuple(calls))

    def _one(self, kind: str, payload: Any) -> ToolCall:
        if kind == "parse_error":
            raw, message = payload
            return ToolCall(None, raw, "parse_error", cut(f"error: could not parse the tool call: {message}",
                                                          self.max_result_chars))
        name, args, kwargs = payload
        fn = self.tools.get(name)
        if fn is None:
            return ToolCall(name, _json_or_raw({"args": args, "kwargs": kwargs} if args else kwargs), "unknown_tool",
                            f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.tools))}")
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
            arguments = _json_or_raw(dict(bound.arguments))
        except TypeError as e:
            return ToolCall(name, _json_or_raw({"args": args, "kwargs": kwargs}), "bad_arguments",
                            cut(f"error: {name}: {e}", self.max_result_chars))
        status, value = _run_with_timeout(fn, args, kwargs, self.task.tool_timeout_s)
        if status == "timeout":
            return ToolCall(name, arguments, "timeout", f"error: {name} ran past {self.task.tool_timeout_s} s")
        if status == "raised":
            if isinstance(value, InfrastructureError):
                raise value
            return ToolCall(name, arguments, "error", cut(f"error: {type(value).__name__}: {value}",
                                                          self.max_result_chars))
        return ToolCall(name, arguments, "ok", cut(value if isinstance(value, str) else _json_or_raw(value),
                                                   self.max_result_chars))
