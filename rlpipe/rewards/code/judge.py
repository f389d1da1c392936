"""The verdict of one test case, computed in the scoring process from what the sandbox returned.

Pure functions of a `CaseRecord` (what the case printed, returned and how its process ended, as
the sandbox's driver observed it) and a `Check` (what the task expects, which the sandbox never
saw). Everything the program wrote is untrusted data: stdout is compared as text, a return value
is rebuilt by `values.loads` as plain built-in data (anything else is a wrong answer), and the
program's own status line can only describe its own failure, never make it pass.
"""
from __future__ import annotations

import json
import math
import signal

from rlpipe.rewards.code import values
from rlpipe.rewards.code.cases import Check
from rlpipe.rewards.code.process import CaseRecord

__all__ = ["KINDS", "PROGRAM_KINDS", "judge_case"]

KINDS = ("pass", "pass_forgeable", "wrong_answer", "runtime_error", "syntax_error", "timeout", "memory",
         "output_limit", "sandbox_refused", "crash")
PROGRAM_KINDS = ("wrong_answer", "runtime_error", "syntax_error", "memory", "sandbox_refused")  # a status may say these


def _status(record: CaseRecord) -> dict | None:
    """The program's status line (its own claim about itself), if it is one JSON object."""
    try:
        status = json.loads(record.status.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return status if isinstance(status, dict) else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _transform(value, transforms: tuple):
    for step in transforms:
        if isinstance(step, tuple):
            name, arg = step
            value = round(value, arg) if name == "round" else value[arg]
        else:
            value = {"sorted": sorted, "set": values.checked_set,
                     "frozenset": lambda items: values.checked_set(items, frozen=True), "list": list, "tuple": tuple, "len": len,
                     "abs": abs, "round": round, "bool": bool, "str": str, "int": int, "float": float, "sum": sum,
                     "min": min, "max": max}[step](value)
    return value


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "tuple": tuple, "dict": dict,
          "set": set, "frozenset": frozenset, "bytes": bytes, "NoneType": type(None)}


def _holds(actual, check: Check, tolerance: float) -> bool:
    """Whether plain data `actual` satisfies `check` (Python's rules; TypeError and the like: it does not)."""
    eq = lambda a, e: values.values_equal(a, e, tolerance=tolerance, lists_for_tuples=check.json_values)  # noqa: E731
    op, expected = check.op, check.expected
    if op in ("eq", "ne"):
        equal = eq(actual, expected) or (check.json_values and isinstance(expected, list) and len(expected) == 1
                                         and eq(actual, expected[0]))
        return equal if op == "eq" else not equal
    if op in ("in", "not_in"):
        if isinstance(expected, (list, tuple)):
            found = any(eq(actual, item) for item in expected)
        else:
            found = actual in expected
        return found if op == "in" else not found
    if op in ("contains", "not_contains"):
        return (expected in actual) == (op == "contains")
    if op in ("is", "is_not"):
        return (actual is expected) == (op == "is")
    if op in ("lt", "le", "gt", "ge"):
        return {"lt": actual < expected, "le": actual <= expected, "gt": actual > expected,
                "ge": actual >= expected}[op]
    if op in ("truthy", "falsy"):
        return bool(actual) == (op == "truthy")
    if op == "isclose":
        rel_tol, abs_tol = check.params
        return type(actual) in (int, float) and math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    if op == "abs_diff":
        comparison, limit = check.params
        diff = abs(actual - expected)
        return diff < limit if comparison == "lt" else diff <= limit
    if op == "type_is":
        return type(actual) is _TYPES[check.params[0]]
    if op == "isinstance":
        return isinstance(actual, tuple(_TYPES[name] for name in check.params))
    raise ValueError(f"unknown check {op!r}")


# The kernel enforces RLIMIT_CPU on tick-sampled CPU time; wait4 reports the precise time, which on a loaded
# machine was 0.86-0.96 s when a 1 s limit struck (issue 32's soak). A SIGKILL after three quarters of the limit is
# the limit's: the label only (a timeout and a crash both earn nothing).
CPU_LIMIT_SHARE = 0.75


def judge_case(record: CaseRecord, check: Check, *, cpu_time_s: int, tolerance: float) -> tuple[str, str]:
    """(kind, message) of one case: a kind of `KINDS`; message "" on a pass."""
    if record.stop == "timeout":
        return "timeout", f"wall clock: still running after {record.wall_s:.1f} s"
    if record.stop == "output_limit":
        return "output_limit", "more output than max_output_bytes"
    if record.stop == "scratch_not_reset":  # the case never ran: failed, so no stale file can make it pass
        return "runtime_error", record.err.decode("utf-8", "replace")[:300]
    if record.oom_kills > 0:
        return "memory", "the row's memory budget ran out (the kernel killed a process of it)"
    status = _status(record)
    if record.exit < 0:
        sig = -record.exit
        if sig in (signal.SIGKILL, signal.SIGXCPU) and record.cpu_s >= CPU_LIMIT_SHARE * cpu_time_s:
            return "timeout", f"CPU time limit of {cpu_time_s} s"
        return "crash", f"killed by {_signal_name(sig)}"
    if record.exit != 0:
        if status and status.get("status") == "error" and status.get("kind") in PROGRAM_KINDS:
            return status["kind"], str(status.get("message", ""))[:300]
        return "runtime_error", f"exit status {record.exit}"
    if check.kind == "stdout":
        got = record.out.decode("utf-8", "replace")
        if values.stdout_equal(got, check.expected, tolerance=tolerance):
            return "pass", ""
        return "wrong_answer", f"printed {got[:120]!r}"
    if check.kind == "ran":
        return ("pass_forgeable", "") if status == {"status": "ok"} else ("crash", "the tests did not run to the end")
    if status is None or status.get("status") not in ("returned", "unencodable"):
        return "crash", "ended without returning a value (exit status 0)"
    if status["status"] == "unencodable":
        return "wrong_answer", f"returned {str(status.get('message', ''))[:200]}"
    try:
        actual = values.decode(status.get("value"))
    except values.Unsupported as exc:
        return "wrong_answer", f"returned something that is not plain data: {exc}"
    try:
        actual = _transform(actual, check.transforms)
        held = _holds(actual, check, tolerance)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError, MemoryError):
        held = False
    return ("pass", "") if held else ("wrong_answer", f"returned {values.preview(actual)}")
