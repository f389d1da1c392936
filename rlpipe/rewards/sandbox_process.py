"""The parent side of one sandboxed run: spawn `sandbox_runner.py`, watch it, kill it, classify its end.

`run_sandboxed` is all of it: a fresh temporary directory, the plan on stdin, stdout + stderr and
the report pipe read up to a byte cap, the wall clock, the process group killed at the end, and
the kind of outcome (`KINDS`) from the runner's verdict or from how the process died. Which
isolation to ask for is `rlpipe.rewards.sandbox.host_isolation`'s call; the reward lives there too.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.rewards.sandbox_runner import count_tests

__all__ = ["KINDS", "RUNNER", "SandboxUnavailable", "SandboxLimits", "SandboxResult", "Isolation", "run_sandboxed"]

RUNNER = str(Path(__file__).with_name("sandbox_runner.py"))
KINDS = ("pass", "wrong_answer", "runtime_error", "syntax_error", "timeout", "memory", "output_limit",
         "sandbox_refused", "crash")


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the program: a fault of the host or its configuration, not of the program."""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run; `rlpipe.rewards.sandbox` documents each (they are code_tests' options)."""

    timeout_s: float
    cpu_time_s: int
    memory_mb: int
    max_processes: int
    max_file_mb: int
    work_dir_mb: int
    max_output_bytes: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"code_tests: {name} must be a number > 0, got {value!r}")
            if name != "timeout_s" and not isinstance(value, int):
                raise ValueError(f"code_tests: {name} must be an integer, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    kind: str  # one of KINDS
    passed: int  # tests that passed (0 unless the program ran to its end)
    total: int  # tests in the tests string
    message: str  # the first failure, or how the process ended; "" on pass
    output_tail: str  # the last 2,000 bytes of stdout + stderr
    wall_s: float  # from spawn to the end of the call
    cpu_s: float  # CPU time of the sandbox's processes that were waited for


@dataclass(frozen=True)
class Isolation:
    """How this host runs programs: namespaces or not, as which user, and what that protects."""

    namespaces: bool
    uid: int | None  # None: the program runs as the scoring process's user
    gid: int | None
    active: tuple[str, ...]
    missing: dict[str, str] = field(default_factory=dict)  # protection -> why it is not active here


def _environment(tmpdir: str) -> dict[str, str]:
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8", "TMPDIR": tmpdir, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class _Watch:
    """Feed the plan to stdin, read stdout+stderr and the report pipe (bounded), notice exit and deadlines."""

    def __init__(self, proc: subprocess.Popen, report_fd: int, plan: bytes, limits: SandboxLimits, token: str):
        self.proc, self.limits, self.token = proc, limits, token
        self.received, self.tail, self.report = 0, bytearray(), bytearray()
        self.events: dict[str, dict] = {}
        self.status: int | None = None
        self.cpu_s = 0.0
        self.started = False  # the runner reported "ready": the program's wall clock runs from then
        self.exited = False  # the spawned process ended by itself
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
        self.sel.register(report_fd, selectors.EVENT_READ, "report")
        self.plan = memoryview(plan)
        self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
        for fd in (proc.stdout.fileno(), report_fd, proc.stdin.fileno()):
            os.set_blocking(fd, False)
        self.pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        if self.pidfd is not None:
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")

    def run(self) -> str:
        """'exit', 'timeout' or 'output_limit'. The wall clock restarts when the program starts."""
        deadline = time.monotonic() + self.limits.timeout_s
        while True:
            if "ready" in self.events and not self.started:
                self.started = True
                deadline = time.monotonic() + self.limits.timeout_s
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            wait = remaining if self.pidfd is not None else min(remaining, 0.01)
            for key, _ in self.sel.select(wait):
                if key.data == "exit":
                    self.exited = True
                elif key.data == "in":
                    self._feed(key.fd)
                else:
                    self._read(key.fd, key.data)
            if self.received > self.limits.max_output_bytes:
                return "output_limit"
            if self.exited or (self.pidfd is None and self._reap(os.WNOHANG)):
                self._drain()
                return "output_limit" if self.received > self.limits.max_output_bytes else "exit"

    def _feed(self, fd: int) -> None:
        try:
            self.plan = self.plan[os.write(fd, self.plan):]
        except BlockingIOError:
            return
        except BrokenPipeError:  # the runner died before reading its plan; classified later
            self.plan = self.plan[:0]
        if not self.plan:
            self.sel.unregister(fd)
            self.proc.stdin.close()

    def _read(self, fd: int, which: str) -> bool:
        try:  # never more than max_output_bytes + 1 in all: one byte past the cap is enough to know
            chunk = os.read(fd, max(1, min(65536, self.limits.max_output_bytes + 1 - self.received)))
        except BlockingIOError:
            return False
        if not chunk:
            self.sel.unregister(fd)
            return False
        self.received += len(chunk)
        if which == "out":
            self.tail = (self.tail + chunk)[-2000:]
        else:
            self.report += chunk
            self._parse_report()
        return True

    def _drain(self) -> None:
        """After the exit: what is left in the pipes (a surviving daemon may hold them open, so no EOF wait)."""
        for key in list(self.sel.get_map().values()):
            if key.data in ("out", "report"):
                while self.received <= self.limits.max_output_bytes and self._read(key.fd, key.data):
                    pass

    def _parse_report(self) -> None:
        *lines, self.report = self.report.split(b"\n")
        prefix = f"{self.token} ".encode()
        for line in lines:
            if line.startswith(prefix):  # anything else is the program writing to the pipe: ignored
                word, _, payload = line[len(prefix):].decode("utf-8", "replace").partition(" ")
                try:
                    self.events.setdefault(word, json.loads(payload))
                except json.JSONDecodeError:
                    pass

    def _reap(self, flags: int) -> bool:
        if self.status is None:
            pid, status, usage = os.wait4(self.proc.pid, flags)
            if pid == 0:
                return False
            self.status, self.cpu_s = status, usage.ru_utime + usage.ru_stime
            self.proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
        return True

    def finish(self, namespaces: bool) -> None:
        """Kill the process group and reap; return only when no process of the sandbox is left.

        Namespace mode: if the supervisor is being killed, wait for the namespace's PID 1 to exit,
        which the kernel completes only after every process in the namespace is gone. Plain mode:
        kill the group until it is empty (forks that are still in it).
        """
        pid1 = self._pid1_fd() if namespaces and not self.exited else None
        _kill_group(self.proc.pid)
        self._reap(0)
        if pid1 is not None:
            select.select([pid1], [], [], 10.0)  # readable once PID 1 has exited
            os.close(pid1)
        for _ in range(0 if namespaces else 100):
            if not _kill_group(self.proc.pid):
                break
            time.sleep(0.002)
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        for stream in (self.proc.stdin, self.proc.stdout):
            if not stream.closed:
                stream.close()

    def _pid1_fd(self) -> int | None:
        """A pidfd of the namespace's PID 1, announced by the supervisor; None without one.

        Called only while the supervisor has not been seen to exit. It exits only after reaping PID 1,
        so PID 1 is still alive or unreaped here, and its pid has not been given to another process."""
        pid = self.events.get("child", {}).get("pid")
        if not isinstance(pid, int) or not hasattr(os, "pidfd_open"):
            return None
        try:
            return os.pidfd_open(pid)
        except OSError:  # already gone
            return None


def _kill_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _program_exit_code(watch: _Watch) -> int:
    """The program's exit code, negative for a signal: in namespace mode as the supervisor reported it."""
    reported = watch.events.get("exit", {}).get("code")
    return reported if isinstance(reported, int) else watch.proc.returncode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # e.g. a real-time signal
        return f"signal {number}"


def _classify(watch: _Watch, stop: str, limits: SandboxLimits) -> tuple[str, int, str]:
    """(kind, passed, message) from how the run stopped and what the runner reported."""
    events, tail = watch.events, watch.tail.decode("utf-8", "replace")
    if "setup_error" in events:
        raise SandboxUnavailable(f"sandbox set-up failed: {events['setup_error'].get('message')}")
    if "ready" not in events:
        how = f"did not start within {limits.timeout_s} s" if stop == "timeout" else \
            f"exited with status {watch.proc.returncode} before starting the program"
        raise SandboxUnavailable(f"the sandbox {how}: {tail[-500:]!r}")
    if stop == "timeout":
        return "timeout", 0, f"wall clock: still running after {limits.timeout_s} s"
    if stop == "output_limit":
        return "output_limit", 0, f"more than {limits.max_output_bytes} bytes of output"
    if "verdict" in events:
        verdict = events["verdict"]
        kind = verdict.get("kind") if verdict.get("kind") in KINDS else "crash"
        return kind, int(verdict.get("passed", 0)) if kind != "crash" else 0, str(verdict.get("message", ""))
    code = _program_exit_code(watch)
    sig = -code if code < 0 else None
    if sig in (signal.SIGKILL, signal.SIGXCPU) and watch.cpu_s >= limits.cpu_time_s - 0.05:
        return "timeout", 0, f"CPU time limit of {limits.cpu_time_s} s"
    if "MemoryError" in tail:
        return "memory", 0, "MemoryError outside a test"
    how = f"killed by {_signal_name(sig)}" if sig else f"exit status {code}"
    return "crash", 0, f"ended without a verdict ({how})"


def run_sandboxed(code: str, tests: str, limits: SandboxLimits, isolation: Isolation) -> SandboxResult:
    """Run `code`, then `tests`, isolated as `isolation` says; never raises for the program's faults."""
    try:
        total = count_tests(tests)
    except SyntaxError as exc:
        raise ValueError(f"the tests do not parse: {exc}") from None
    if total == 0:
        raise ValueError("the tests hold no test (a top-level assert or a def test_*())")
    start, token = time.monotonic(), secrets.token_hex(16)
    work = tempfile.mkdtemp(prefix="rlpipe-sandbox-")  # the private root's mount point, or the working dir
    report_r, report_w = os.pipe()
    try:
        if isolation.uid is not None and not isolation.namespaces:
            os.chown(work, isolation.uid, isolation.gid)
        plan = {"token": token, "solution": code, "tests": tests, "namespaces": isolation.namespaces,
                "root": work, "uid": isolation.uid, "gid": isolation.gid,
                "limits": {"cpu_s": limits.cpu_time_s, "memory_bytes": limits.memory_mb << 20,
                           "processes": limits.max_processes, "file_bytes": limits.max_file_mb << 20,
                           "work_bytes": limits.work_dir_mb << 20}}
        proc = subprocess.Popen([sys.executable, "-s", "-P", RUNNER, str(report_w)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(report_w,), cwd=work,
                                env=_environment("/tmp" if isolation.namespaces else work), start_new_session=True)
        os.close(report_w)
        report_w = -1
        watch = _Watch(proc, report_r, json.dumps(plan).encode(), limits, token)
        try:
            stop = watch.run()
        finally:
            watch.finish(isolation.namespaces)
        kind, passed, message = _classify(watch, stop, limits)
        return SandboxResult(kind=kind, passed=passed, total=total, message=message,
                             output_tail=watch.tail.decode("utf-8", "replace"),
                             wall_s=time.monotonic() - start, cpu_s=watch.cpu_s)
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
