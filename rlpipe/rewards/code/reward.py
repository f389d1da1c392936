"""`code_tests`: reward a completion by running its Python on the task's tests in a sandbox, judged outside it.

The code is the last fenced block tagged ``python``/``py``/``python3`` in the completion (an
unclosed one runs to the end), else the whole completion. The tests come from the prompt's
``metadata[tests_key]`` (an extra column of the prompt file), or from its ``answer`` column when
``tests_key`` is null; `cases` documents the formats. Each test case runs in a fresh process of
the sandbox, which gets only the case's input; this process compares what it printed or returned
with the expected output (`judge`).

Reward: 1.0 if every test passed, else 0.0; with ``partial_credit: true`` the fraction of tests
that passed (all tests run then; without it, the row stops at its first failure). The detail
label is the kind (`KINDS`) of the first failing test, or ``pass``; ``pass_forgeable`` when some
passing test ran inside the program's process (``allow_forgeable_tests``). Failures of the
sandbox itself (it cannot start, a protection in ``required_protections`` is missing, the host
refused a resource) and unusable tests raise: the row's error, never a score the policy learns from.

Options, all required (params.yaml; docs/reliability.md has an example):
  tests_key              metadata key of the tests; null: the prompt's answer column
  timeout_s              wall clock per test case, from the case process's start
  cpu_time_s             CPU seconds per process (RLIMIT_CPU; an integer)
  memory_mb              memory of the row's processes together (cgroup) and of each one (RLIMIT_AS)
  max_processes          processes + threads of the row together (cgroup, or RLIMIT_NPROC of its own user)
  max_open_files         open files per process (RLIMIT_NOFILE; at least 16)
  max_file_mb            largest file the program may write (RLIMIT_FSIZE)
  work_dir_mb            size of the writable /tmp (and /dev/shm) in the private file system
  max_output_bytes       stdout + stderr + return value read per test case before it is killed
  partial_credit         see above
  float_tolerance        a float expected value is met within this relative or absolute distance (an int
                         answer: absolute only); an integer expected value only exactly (0: all exactly)
  allow_forgeable_tests  true: tests that cannot be judged outside run inside the program (forgeable!)
  required_protections   names from `PROTECTIONS` that must be active here, else every row raises
"""
from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlpipe.rewards.base import RewardResult, Sample
from rlpipe.rewards.code import cases as case_formats
from rlpipe.rewards.code.host import host_isolation, isolation_info
from rlpipe.rewards.code.judge import KINDS, judge_case
from rlpipe.rewards.code.process import CaseRecord, SandboxLimits, run_cases
from rlpipe.rewards.code.protections import PROTECTIONS, Isolation, SandboxUnavailable

__all__ = ["KINDS", "RowVerdict", "extract_code", "run_code_tests", "code_tests", "redact"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_RENAMED = {"process_group_kill": "kill_all", "temp_work_dir": "private_filesystem"}


def extract_code(completion: str) -> str:
    """The program in a completion: the last ```python block, else the whole text.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("def f(): return 2")
    'def f(): return 2'
    """
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _host_paths() -> list[tuple[str, str]]:
    """Host paths that must not appear in what the sandbox returns, longest first, with their stand-ins."""
    package = Path(__file__).resolve().parent
    pairs = {str(package): "<sandbox>", str(package.parents[2]): "<rlpipe>", os.path.expanduser("~"): "<home>",
             os.getcwd(): "<cwd>"}
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        pairs[prefix] = pairs[os.path.realpath(prefix)] = "<python>"
    return sorted(((p, s) for p, s in pairs.items() if len(p) > 1), key=lambda ps: -len(ps[0]))


_HOST_PATHS = _host_paths()
_WORK_DIR = re.compile(re.escape(tempfile.gettempdir()) + r"/rlpipe-sandbox-[A-Za-z0-9_]+")  # plain mode's work dir


def redact(text: str) -> str:
    """`text` with this host's paths (interpreter, repository, work dir, home, cwd) replaced by stand-ins.

    >>> redact(f"File {sys.prefix}/lib/x.py") == "File <python>/lib/x.py"
    True
    """
    text = _WORK_DIR.sub("<work>", text)
    for path, stand_in in _HOST_PATHS:
        text = text.replace(path, stand_in)
    return text


@dataclass(frozen=True)
class RowVerdict:
    kind: str  # one of KINDS: the first failing test's, or pass / pass_forgeable
    passed: int  # tests that passed
    total: int  # tests in the task
    message: str  # the first failure (host paths redacted); "" on a pass
    output_tail: str  # the last 2,000 characters of the first failing case's stdout + stderr (redacted)
    cases: tuple[tuple[str, str], ...]  # (kind, message) of every case that ran, in order
    wall_s: float
    peak_memory_bytes: int | None  # of the row's memory cgroup; None without one


def run_code_tests(code: str, tests: list[case_formats.TaskTest], limits: SandboxLimits, *, partial_credit: bool,
                   float_tolerance: float = 0.0, isolation: Isolation | None = None) -> RowVerdict:
    """Run `code` on each case of `tests` in the sandbox and judge it here.

    Without partial credit the run stops at the first failing test (the reward is 0 either way);
    a syntax error stops it always (every case would fail alike). Raises SandboxUnavailable."""
    flat = [(t, case) for t, test in enumerate(tests) for case in test.cases]
    verdicts: list[tuple[str, str]] = []
    tails: list[str] = []

    def on_case(record: CaseRecord) -> bool:
        kind, message = judge_case(record, flat[record.index][1].check, cpu_time_s=limits.cpu_time_s,
                                   tolerance=float_tolerance)
        verdicts.append((kind, redact(message)))
        tails.append(redact((record.out[-1000:] + record.err[-1000:]).decode("utf-8", "replace")))
        return kind != "syntax_error" and (partial_credit or kind in ("pass", "pass_forgeable"))

    run = run_cases({"solution": code}, [case.sandbox for _, case in flat], limits, isolation or host_isolation(),
                    on_case)
    passing = ("pass", "pass_forgeable")
    ran_ok = [i < len(verdicts) and verdicts[i][0] in passing for i in range(len(flat))]
    passed = sum(all(ran_ok[i] for i, (t, _) in enumerate(flat) if t == test) for test in range(len(tests)))
    failures = [(t, *verdicts[i], tails[i]) for i, (t, _) in enumerate(flat[:len(verdicts)])
                if verdicts[i][0] not in passing]
    if not failures:
        forgeable = any(kind == "pass_forgeable" for kind, _ in verdicts)
        kind, message, tail = ("pass_forgeable" if forgeable else "pass"), "", ""
    else:
        first, kind, message, tail = failures[0]
        message = f"{tests[first].name}: {message}"
    return RowVerdict(kind=kind, passed=passed, total=len(tests), message=message[:500], output_tail=tail[-2000:],
                      cases=tuple(verdicts), wall_s=run.wall_s, peak_memory_bytes=run.peak_memory_bytes)


def _check_options(tests_key, partial_credit, float_tolerance, allow_forgeable_tests, required_protections) -> None:
    if tests_key is not None and not isinstance(tests_key, str):
        raise ValueError(f"code_tests: tests_key must be a metadata key or null (the answer column), got {tests_key!r}")
    for name, value in (("partial_credit", partial_credit), ("allow_forgeable_tests", allow_forgeable_tests)):
        if not isinstance(value, bool):
            raise ValueError(f"code_tests: {name} must be true or false, got {value!r}")
    if (isinstance(float_tolerance, bool) or not isinstance(float_tolerance, (int, float))
            or not math.isfinite(float_tolerance) or float_tolerance < 0):
        raise ValueError(f"code_tests: float_tolerance must be a number >= 0, got {float_tolerance!r}")
    if not isinstance(required_protections, list) or not all(isinstance(n, str) for n in required_protections):
        raise ValueError(f"code_tests: required_protections must be a list of names, got {required_protections!r}")
    unknown = [name for name in required_protections if name not in PROTECTIONS]
    if unknown:
        hints = [f"{n} is now {_RENAMED[n]}" for n in unknown if n in _RENAMED]
        renamed = f" ({'; '.join(hints)})" if hints else ""
        raise ValueError(f"code_tests: unknown protection(s) {unknown}{renamed}; valid: {', '.join(PROTECTIONS)}")


def code_tests(sample: Sample, *, tests_key: str | None, timeout_s: float, cpu_time_s: int, memory_mb: int,
               max_processes: int, max_open_files: int, max_file_mb: int, work_dir_mb: int, max_output_bytes: int,
               partial_credit: bool, float_tolerance: float, allow_forgeable_tests: bool,
               required_protections: list[str]) -> RewardResult:
    """1.0 if the completion's code passes the sample's tests (the pass fraction with partial_credit); detail = kind.

    See the module docstring for the options and `rlpipe.rewards.code.cases` for the test formats.
    """
    _check_options(tests_key, partial_credit, float_tolerance, allow_forgeable_tests, required_protections)
    limits = SandboxLimits(timeout_s=timeout_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb,
                           max_processes=max_processes, max_open_files=max_open_files, max_file_mb=max_file_mb,
                           work_dir_mb=work_dir_mb, max_output_bytes=max_output_bytes)
    raw = sample.answer if tests_key is None else sample.metadata.get(tests_key)
    if raw is None:
        where = "the answer column" if tests_key is None else f"metadata[{tests_key!r}]"
        raise case_formats.BadTests(f"code_tests: no tests in {where} (metadata keys: {sorted(sample.metadata)})")
    try:
        tests = case_formats.parse_tests(raw, metadata=sample.metadata, allow_forgeable=allow_forgeable_tests)
    except case_formats.BadTests as exc:
        where = "the answer column" if tests_key is None else f"metadata[{tests_key!r}]"
        raise case_formats.BadTests(f"code_tests: {where}: {exc}") from None
    isolation = host_isolation()
    lacking = [name for name in required_protections if name not in isolation.active]
    if lacking:
        raise SandboxUnavailable("code_tests: required protection(s) not active on this host: "
                                 + "; ".join(f"{n} ({isolation.missing.get(n, '')})" for n in lacking))
    try:
        verdict = run_code_tests(extract_code(sample.completion), tests, limits, partial_credit=partial_credit,
                                 float_tolerance=float_tolerance, isolation=isolation)
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(redact(str(exc))) from None
    if verdict.kind in ("pass", "pass_forgeable"):
        return RewardResult(1.0, verdict.kind)
    return RewardResult(verdict.passed / verdict.total if partial_credit else 0.0, verdict.kind)


def _run_info(**options) -> dict:
    """What the score stage's metrics record about this reward: the sandbox this host gave it."""
    return {"sandbox": isolation_info(host_isolation())}


code_tests.run_info = _run_info
