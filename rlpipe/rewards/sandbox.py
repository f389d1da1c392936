"""`code_tests`: reward a completion by running its Python against the task's unit tests, sandboxed.

Every call runs one program in a fresh process (`sandbox_runner.py`, watched by
`sandbox_process.py`) and waits for it; the score stage's thread pool (``score.workers``) runs
several calls at once. Nothing the program does can raise here: a failing program scores 0 and says why in `RewardResult.detail`. Only a sandbox that
cannot start (or lacks a protection named in ``required_protections``) raises `SandboxUnavailable`,
which the score stage records as that row's error, so a broken host fails the stage instead of
silently scoring every row 0.

The code is the last fenced block tagged ``python``/``py``/``python3`` in the completion (an
unclosed one runs to the end), else the whole completion.

The tests, ``sample.metadata[tests_key]``: a string of Python source, run after the solution in the
solution's namespace, as if appended to it:
  * each top-level ``assert`` statement is one test;
  * each top-level ``def test_*():`` (no arguments) is one test, called after the whole string ran;
  * any other top-level statement (imports, helpers, setup) is not a test; if it raises, the tests
    after it count as failed.
For example ``"assert add(2, 3) == 5\\ndef test_neg():\\n    assert add(-2, -3) == -5\\n"`` holds 2 tests.
The solution runs with ``__name__ == "solution"`` (its ``if __name__ == "__main__":`` block does not
run) and stdin at EOF. Tests that do not parse or hold no test are a data error (ValueError).

Reward: 1.0 if every test passed, else 0.0; with ``partial_credit: true`` the fraction of tests that
passed, provided the program ran to its end (a timeout, crash or output overflow scores 0). The
detail is one of `KINDS`: pass; wrong_answer (an assert failed); runtime_error (anything else raised,
including SystemExit); syntax_error; timeout (wall clock or CPU time); memory (MemoryError under
the address-space limit); output_limit; sandbox_refused (the program tried the network, or to
start processes beyond the limit); crash (the process ended with no verdict: a signal, os._exit).

Options, all required (write them in params.yaml; see docs/reliability.md for an example):
  tests_key          metadata key of the tests
  timeout_s          wall clock from the program's start (sandbox set-up, ~0.1 s, is not counted)
  cpu_time_s         CPU seconds of the program's process (RLIMIT_CPU; an integer)
  memory_mb          address space (RLIMIT_AS); MemoryError beyond it
  max_processes      RLIMIT_NPROC: processes and threads of the sandbox user, shared by the sandboxes
                     running at the same time (it counts per user, and all sandboxes run as one user)
  max_file_mb        largest file the program may write (RLIMIT_FSIZE)
  work_dir_mb        size of the writable /tmp in the private file system (plain mode: not enforced)
  max_output_bytes   stdout + stderr read before the process is killed (output_limit)
  partial_credit     see above
  required_protections  names from `PROTECTIONS` that must be active here, else every row raises

Which protections are active depends on the host (root or not, namespaces allowed or not):
`host_isolation()` probes once per process; ``python -m rlpipe.rewards.sandbox`` prints the result.
"""
from __future__ import annotations

import os
import pwd
import re
import threading

from rlpipe.rewards.functions import RewardResult, Sample
from rlpipe.rewards.sandbox_process import (
    KINDS,
    Isolation,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    run_sandboxed,
)

__all__ = ["KINDS", "PROTECTIONS", "SandboxUnavailable", "SandboxLimits", "SandboxResult", "Isolation",
           "extract_code", "host_isolation", "run_code_tests", "code_tests"]

PROTECTIONS = {
    "network_namespace": "a network namespace with no interfaces: no connection to anything, localhost included",
    "pid_namespace": "a PID namespace: the host's processes are invisible, and every process of the program "
                     "(daemons included) dies with it",
    "private_filesystem": "chroot into a tmpfs with read-only system and Python dirs; the only writable place is "
                          "a private /tmp of work_dir_mb that vanishes with the program",
    "separate_uid": "runs as the unprivileged user `nobody`: cannot write, delete or signal the host's files and "
                    "processes",
    "process_limit": "RLIMIT_NPROC is enforced (not for root: the kernel exempts uid 0)",
    "socket_hook": "an audit hook refuses connect/bind/sendto/DNS from Python (ctypes can bypass it)",
    "resource_limits": "RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE; no core dumps",
    "scrubbed_environment": "a fixed environment: no variable of the scoring process, no HOME",
    "output_cap": "stdout + stderr are read up to max_output_bytes, then the process is killed",
    "process_group_kill": "the process group is killed when the call ends",
    "temp_work_dir": "a fresh temporary working directory, removed when the call ends",
}
_ALWAYS = ("socket_hook", "resource_limits", "scrubbed_environment", "output_cap", "process_group_kill",
           "temp_work_dir")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(completion: str) -> str:
    """The program in a completion: the last ```python block, else the whole text.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("def f(): return 2")
    'def f(): return 2'
    """
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def run_code_tests(code: str, tests: str, limits: SandboxLimits, isolation: Isolation | None = None) -> SandboxResult:
    """Run `code`, then `tests` (format: module docstring), sandboxed as this host allows unless told.

    Never raises for the program's faults; raises SandboxUnavailable if the sandbox cannot run it and
    ValueError if the tests do not parse or hold no test.
    """
    return run_sandboxed(code, tests, limits, isolation or host_isolation())


# ---------------------------------------------------------------------------------------------
# What this host allows
# ---------------------------------------------------------------------------------------------

_PROBE_LIMITS = SandboxLimits(timeout_s=20.0, cpu_time_s=20, memory_mb=2048, max_processes=256, max_file_mb=1,
                              work_dir_mb=4, max_output_bytes=65536)
# Passes only if the sandbox user can list every import directory of the interpreter that exists
# (PermissionError fails it; os.path.isdir would answer False for an unreadable directory).
_PROBE = ("import os, sys\nfor p in sys.path:\n    try:\n        os.listdir(p)\n"
          "    except (FileNotFoundError, NotADirectoryError):\n        pass\n")
# Passes only if RLIMIT_NPROC stops a fork (run with max_processes=1): whether it applies depends on the user.
_NPROC_PROBE = ("import os\ntry:\n    pid = os.fork()\nexcept BlockingIOError:\n    enforced = True\nelse:\n"
                "    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    enforced = False\n")
_probe_lock = threading.Lock()
_isolation: Isolation | None = None


def _sandbox_user() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _candidates() -> list[Isolation]:
    """The strongest set first; `host_isolation` keeps the first that runs a probe program."""
    if os.geteuid() != 0:
        return [Isolation(False, None, None, _ALWAYS + ("process_limit",))]
    uid, gid = _sandbox_user()
    return [Isolation(True, uid, gid, _ALWAYS + ("network_namespace", "pid_namespace", "private_filesystem",
                                                 "separate_uid", "process_limit")),
            Isolation(False, uid, gid, _ALWAYS + ("separate_uid", "process_limit")),
            Isolation(False, None, None, _ALWAYS)]


def host_isolation() -> Isolation:
    """The strongest isolation that works here, probed once per process (about 0.1 s)."""
    global _isolation
    with _probe_lock:
        if _isolation is not None:
            return _isolation
        reasons: dict[str, str] = {}  # protection -> why the first candidate offering it failed
        for candidate in _candidates():
            try:
                result = run_code_tests(_PROBE, "assert True", _PROBE_LIMITS, candidate)
                ok, why = result.kind == "pass", f"probe program: {result.kind}: {result.message}"
            except (SandboxUnavailable, OSError) as exc:
                ok, why = False, str(exc)
            if ok:
                active = candidate.active
                if "process_limit" in active and not _nproc_enforced(candidate):
                    active = tuple(name for name in active if name != "process_limit")
                    reasons["process_limit"] = "a probe forked past RLIMIT_NPROC=1: the kernel does not apply it here"
                missing = {name: _why_missing(name, reasons, candidate) for name in PROTECTIONS if name not in active}
                _isolation = Isolation(candidate.namespaces, candidate.uid, candidate.gid, active, missing)
                return _isolation
            for name in candidate.active:
                reasons.setdefault(name, why)
        raise SandboxUnavailable(f"no sandbox works on this host: {reasons}")


def _nproc_enforced(candidate: Isolation) -> bool:
    limits = SandboxLimits(**{**vars(_PROBE_LIMITS), "max_processes": 1})
    try:
        return run_code_tests(_NPROC_PROBE, "assert enforced", limits, candidate).kind == "pass"
    except (SandboxUnavailable, OSError):
        return False


def _why_missing(name: str, reasons: dict[str, str], chosen: Isolation) -> str:
    if name == "process_limit" and chosen.uid is None and os.geteuid() == 0:
        return ("the program runs as root, and the kernel exempts root from RLIMIT_NPROC; running it as nobody "
                f"failed: {reasons.get('separate_uid', '?')}")
    if name in reasons:
        return reasons[name]
    return f"needs root: the scoring process runs as uid {os.geteuid()} (user namespaces are not used)"


# ---------------------------------------------------------------------------------------------
# The reward
# ---------------------------------------------------------------------------------------------

def code_tests(sample: Sample, *, tests_key: str, timeout_s: float, cpu_time_s: int, memory_mb: int,
               max_processes: int, max_file_mb: int, work_dir_mb: int, max_output_bytes: int,
               partial_credit: bool, required_protections: list[str]) -> RewardResult:
    """1.0 if the completion's code passes the sample's tests in the sandbox, else 0.0; detail = the kind.

    See the module docstring for the tests format, the kinds and the options.
    """
    if not isinstance(required_protections, list) or not all(isinstance(n, str) for n in required_protections):
        raise ValueError(f"code_tests: required_protections must be a list of names, got {required_protections!r}")
    if not isinstance(partial_credit, bool):
        raise ValueError(f"code_tests: partial_credit must be true or false, got {partial_credit!r}")
    unknown = [name for name in required_protections if name not in PROTECTIONS]
    if unknown:
        raise ValueError(f"code_tests: unknown protection(s) {unknown}; valid: {', '.join(PROTECTIONS)}")
    tests = sample.metadata.get(tests_key)
    if not isinstance(tests, str):
        raise ValueError(f"code_tests: metadata[{tests_key!r}] must be a string of Python tests, "
                         f"got {type(tests).__name__} (metadata keys: {sorted(sample.metadata)})")
    limits = SandboxLimits(timeout_s=timeout_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb,
                           max_processes=max_processes, max_file_mb=max_file_mb, work_dir_mb=work_dir_mb,
                           max_output_bytes=max_output_bytes)
    isolation = host_isolation()
    lacking = [name for name in required_protections if name not in isolation.active]
    if lacking:
        raise SandboxUnavailable("code_tests: required protection(s) not active on this host: "
                                 + "; ".join(f"{n} ({isolation.missing.get(n, '')})" for n in lacking))
    result = run_code_tests(extract_code(sample.completion), tests, limits, isolation)
    if result.kind == "pass":
        return RewardResult(1.0, "pass")
    return RewardResult(result.passed / result.total if partial_credit else 0.0, result.kind)


def describe_host() -> str:
    isolation = host_isolation()
    lines = [f"sandbox on this host: {'namespaces' if isolation.namespaces else 'plain process'}, "
             f"running as uid {isolation.uid if isolation.uid is not None else os.geteuid()}", "active:"]
    lines += [f"  {name}: {PROTECTIONS[name]}" for name in isolation.active]
    lines += ["not active:"] + ([f"  {name}: {why}" for name, why in isolation.missing.items()] or ["  (none)"])
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe_host())
