"""A Python code-execution tool, run in the code reward's sandbox, and the environment that offers it.

The model calls ``python`` with a program (``{"name": "python", "arguments": {"code": "print(2**10)"}}``
in the json syntax); the program runs in a fresh sandboxed process with the code reward's
protections and limits, and the model reads back what it printed (stdout and stderr, the last
2,000 bytes), or how it ended (``timeout``, ``memory``, ...). The program is untrusted: everything
about containment is the sandbox's, not this module's.

The dependency on the sandbox (`rlpipe.rewards.code`: its limits, its host isolation, `run_cases` and
the verdict of one case) is one function, `run_untrusted`, so that a change of the sandbox touches
nothing else here. A sandbox that cannot start raises
`InfrastructureError`: the rollout is ``infra_error``, never the model's fault.
"""
from __future__ import annotations

from functools import partial

from rlpipe.environments.base import InfrastructureError, Task
from rlpipe.environments.tools import ToolEnvironment


def run_untrusted(code: str, *, timeout_s: float, memory_mb: int, max_output_bytes: int) -> tuple[str, str]:
    """Run ``code`` in the code reward's sandbox; return (kind, output): how it ended and what it printed.

    kind is "ok" when the program exited normally, else the sandbox's kind (runtime_error, timeout,
    memory, output_limit, crash, ...). The output is stdout then the tail of stderr, host paths redacted.
    """
    from rlpipe.rewards.code import SandboxLimits, SandboxUnavailable, host_isolation, redact
    from rlpipe.rewards.code.cases import Check
    from rlpipe.rewards.code.judge import judge_case
    from rlpipe.rewards.code.process import run_cases

    limits = SandboxLimits(timeout_s=timeout_s, cpu_time_s=max(1, int(timeout_s) + 1), memory_mb=memory_mb,
                           max_processes=16, max_open_files=64, max_file_mb=1, work_dir_mb=16,
                           max_output_bytes=max_output_bytes)
    records = []
    try:  # one case: the program as a script with an empty stdin
        run_cases({"solution": code}, [{"mode": "stdin", "stdin": ""}], limits, host_isolation(),
                  lambda record: records.append(record) or False)
    except SandboxUnavailable as e:
        raise InfrastructureError(f"the python sandbox is unavailable: {e}") from e
    if not records:
        raise InfrastructureError("the python sandbox returned no result for the program")
    record = records[0]
    # judged against an empty expected stdout only to learn how it ended: "wrong_answer" = it printed something
    kind, message = judge_case(record, Check("stdout", expected=""), cpu_time_s=limits.cpu_time_s, tolerance=0.0)
    output = redact((record.out + record.err[-2000:]).decode("utf-8", "replace"))
    if kind in ("pass", "wrong_answer"):
        return "ok", output
    return kind, f"{output}{redact(message)}"


def python(code: str, *, timeout_s: float, memory_mb: int, max_output_bytes: int) -> str:
    """The tool: run ``code``, return its output (or how it failed)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    kind, output = run_untrusted(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    return output if kind == "ok" else f"[{kind}] {output}"


class PythonEnvironment(ToolEnvironment):
    """`ToolEnvironment` offering the sandboxed ``python`` tool (and any others given in ``tools``).

    timeout_s, memory_mb, max_output_bytes: the sandbox's limits for one program (wall clock, address
    space, bytes of output read); ``Task.tool_timeout_s`` still bounds the whole call.
    The other keyword arguments are `ToolEnvironment`'s.
    """

    def __init__(self, task: Task, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 65536,
                 tools: dict | None = None, syntax: str = "json", call_start: str = "<tool_call>",
                 call_end: str = "</tool_call>", max_calls_per_turn: int = 2, max_result_chars: int = 2000,
                 max_tool_errors: int = -1, observation_role: str = "tool") -> None:
        run = partial(python, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
        super().__init__(task, tools={"python": run, **(tools or {})}, syntax=syntax, call_start=call_start,
                         call_end=call_end, max_calls_per_turn=max_calls_per_turn, max_result_chars=max_result_chars,
                         max_tool_errors=max_tool_errors, observation_role=observation_role)
