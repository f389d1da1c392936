"""The parent side of one sandboxed row: spawn `runner.py`, feed it the plan, collect each case's
outputs, and return only once every process of the row is dead and reaped.

`run_cases` is all of it. The runner's report pipe is written by trusted code only (the case
processes close it before the program starts), and the parent still accepts each message only in
its phase: ``setup_error`` before ``ready``, cases after. Infrastructure failures (the runner or
a case process could not start, the driver stopped answering, the host refused a cgroup) raise
`SandboxUnavailable`: an error of the row, never a score. Judging is not done here: see `judge`.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlpipe.rewards.code import isolate, scratch
from rlpipe.rewards.code.cgroups import RowCgroups
from rlpipe.rewards.code.protections import Isolation, SandboxUnavailable, row_uid

__all__ = ["RUNNER", "SandboxLimits", "CaseRecord", "RowRun", "run_cases"]

RUNNER = str(Path(__file__).with_name("runner.py"))
SETUP_TIMEOUT_S = 60.0  # the runner's start and isolation: far above the ~0.05 s it takes
CASE_GRACE_S = 10.0  # past a case's own timeout, how long the driver may take to report it
KILL_TIMEOUT_S = 10.0
RUNNER_OUTPUT_CAP = 65536  # the runner's own stdout/stderr (trusted; diagnostics of a failed set-up)


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one row; `rlpipe.rewards.code.reward` documents each (they are code_tests' options)."""

    timeout_s: float
    cpu_time_s: int
    memory_mb: int
    max_processes: int
    max_open_files: int
    max_file_mb: int
    work_dir_mb: int
    max_output_bytes: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"code_tests: {name} must be a number > 0, got {value!r}")
            if name != "timeout_s" and not isinstance(value, int):
                raise ValueError(f"code_tests: {name} must be an integer, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError(f"code_tests: max_open_files must be at least 16 (the interpreter needs a few), "
                             f"got {self.max_open_files}")


@dataclass(frozen=True)
class CaseRecord:
    """What one test case did, as the driver observed it (outputs are the program's, untrusted)."""

    index: int
    stop: str  # "exit", "timeout" (wall clock), "output_limit" or "scratch_not_reset" (the case did not run)
    exit: int  # exit code of the case process; negative: killed by that signal
    wall_s: float
    cpu_s: float
    oom_kills: int  # processes the row's memory cgroup killed during the case
    out: bytes  # stdout
    err: bytes  # the tail of stderr
    status: bytes  # what the case process wrote on its status pipe


@dataclass(frozen=True)
class RowRun:
    """How the whole row went, beyond its cases."""

    wall_s: float
    peak_memory_bytes: int | None  # of the row's memory cgroup; None without one


def _environment(tmpdir: str) -> dict[str, str]:
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8", "TMPDIR": tmpdir, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class _Watch:
    """Feed the plan, read the report pipe and the runner's own output, notice its exit; bounded."""

    def __init__(self, proc: subprocess.Popen, report_fd: int, plan: bytes, token: str):
        self.proc, self.token = proc, token
        self.report, self.runner_output = bytearray(), bytearray()
        self.lines: list[tuple[str, dict]] = []
        self.exited = False
        self.driver_pidfd: int | None = None  # the namespace's PID 1, once the supervisor has named it
        self.sel = selectors.DefaultSelector()
        self.plan = memoryview(plan)
        for fd, data, events in ((proc.stdout.fileno(), "out", selectors.EVENT_READ),
                                 (report_fd, "report", selectors.EVENT_READ),
                                 (proc.stdin.fileno(), "in", selectors.EVENT_WRITE)):
            os.set_blocking(fd, False)
            self.sel.register(fd, events, data)
        self.pidfd = os.pidfd_open(proc.pid)
        self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")

    def poll(self, timeout: float) -> None:
        for key, _ in self.sel.select(max(timeout, 0.0)):
            if key.data == "exit":
                self.exited = True
                self.sel.unregister(self.pidfd)
            elif key.data == "in":
                self._feed(key.fd)
            else:
                self._read(key.fd, key.data)

    def _feed(self, fd: int) -> None:
        try:
            self.plan = self.plan[os.write(fd, self.plan):]
        except BlockingIOError:
            return
        except BrokenPipeError:  # the runner died before reading its plan; reported by its exit
            self.plan = self.plan[:0]
        if not self.plan:
            self.sel.unregister(fd)
            self.proc.stdin.close()

    def _read(self, fd: int, which: str) -> None:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(fd)
            return
        if which == "out":
            self.runner_output = (self.runner_output + chunk)[-RUNNER_OUTPUT_CAP:]
            return
        self.report += chunk
        *complete, rest = self.report.split(b"\n")
        self.report = bytearray(rest)
        prefix = f"{self.token} ".encode()
        for line in complete:  # written by trusted code only; a line that does not parse is a bug, skipped
            if line.startswith(prefix):
                word, _, payload = line[len(prefix):].decode("utf-8", "replace").partition(" ")
                try:
                    self.lines.append((word, json.loads(payload)))
                except ValueError:
                    continue

    def drain(self) -> None:
        """What the runner wrote before it exited (no EOF wait: a dead runner has closed its ends)."""
        for key in list(self.sel.get_map().values()):
            if key.data in ("out", "report"):
                self._read(key.fd, key.data)

    def close(self) -> None:
        self.sel.close()
        os.close(self.pidfd)
        for stream in (self.proc.stdin, self.proc.stdout):
            if not stream.closed:
                stream.close()


def _driver_pidfd(pid: object, runner_pid: int) -> int | None:
    """A pidfd of the namespace's PID 1, checked to be the runner's child (so a recycled pid is never killed)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == runner_pid:
            return pidfd
    except (OSError, ValueError, IndexError):
        pass
    os.close(pidfd)
    return None


def _record(payload: dict) -> CaseRecord:
    return CaseRecord(index=payload["index"], stop=payload["stop"], exit=payload["exit"], wall_s=payload["wall_s"],
                      cpu_s=payload["cpu_s"], oom_kills=payload["oom_kills"],
                      **{name: base64.b64decode(payload[name]) for name in ("out", "err", "status")})


def _uid_processes(uid: int) -> list[int]:
    """Live processes (not zombies) whose real uid is `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(entry))
    return found


def run_cases(program: dict, cases: list[dict], limits: SandboxLimits, isolation: Isolation,
              on_case: Callable[[CaseRecord], bool]) -> RowRun:
    """Run `program` once per case, sandboxed as `isolation` says; ``on_case`` gets each case as it
    ends and returns False to stop early. Returns when every process of the row is gone; raises
    SandboxUnavailable for a failure of the sandbox (never for one of the program)."""
    with row_uid(isolation) as (uid, gid):
        return _run(program, cases, limits, isolation, on_case, uid, gid)


def _run(program: dict, cases: list[dict], limits: SandboxLimits, isolation: Isolation,
         on_case: Callable[[CaseRecord], bool], uid: int | None, gid: int | None) -> RowRun:
    start, token = time.monotonic(), secrets.token_hex(16)
    work = tempfile.mkdtemp(prefix="rlpipe-sandbox-")  # the private root's mount point, or the working dir
    report_r, report_w = os.pipe()
    cgroups = None
    try:
        if isolation.cgroups.parents():
            try:
                cgroups = RowCgroups(isolation.cgroups, memory_bytes=limits.memory_mb << 20,
                                     pids=limits.max_processes)
            except OSError as exc:
                raise SandboxUnavailable(f"cannot create the row's cgroups: {exc}") from None
        if uid is not None and not isolation.namespaces:
            try:
                os.chown(work, uid, gid)
                os.chmod(work, 0o700)
            except (OSError, OverflowError) as exc:
                raise SandboxUnavailable(f"cannot prepare the work dir for uid {uid}: {exc}") from None
        plan = {"token": token, "namespaces": isolation.namespaces, "root": work, "uid": uid, "gid": gid,
                "per_row_uid": isolation.users == "per_row",
                "nproc": "process_limit" in isolation.active, "seccomp": isolation.seccomp,
                "work_dir": "/tmp" if isolation.namespaces else work,
                "scratch_dirs": ["/tmp", "/dev/shm"] if isolation.namespaces else [work],
                "cgroup_procs": cgroups.procs if cgroups else [], "cgroup_kill": cgroups.kill_file if cgroups else None,
                "oom_events": cgroups.oom_events if cgroups else None,
                "limits": {"cpu_s": limits.cpu_time_s, "memory_bytes": limits.memory_mb << 20,
                           "processes": limits.max_processes, "file_bytes": limits.max_file_mb << 20,
                           "open_files": limits.max_open_files, "work_bytes": limits.work_dir_mb << 20,
                           "timeout_s": limits.timeout_s, "output_bytes": limits.max_output_bytes},
                "program": program, "cases": cases}
        try:
            proc = subprocess.Popen([sys.executable, "-s", "-P", RUNNER, str(report_w)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(report_w,), cwd=work,
                                    env=_environment("/tmp" if isolation.namespaces else work), start_new_session=True)
        except OSError as exc:  # e.g. EAGAIN: the host is out of processes
            raise SandboxUnavailable(f"cannot start the sandbox: {exc}") from None
        os.close(report_w)
        report_w = -1
        watch = _Watch(proc, report_r, json.dumps(plan).encode(), token)
        try:
            _follow(watch, proc, isolation, limits, len(cases), on_case)
        finally:
            _end(watch, proc, isolation, cgroups, uid, gid)
        return RowRun(wall_s=time.monotonic() - start,
                      peak_memory_bytes=cgroups.peak_memory_bytes() if cgroups else None)
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        if cgroups is not None and not cgroups.remove():
            raise SandboxUnavailable(f"the row's cgroups still hold processes after {KILL_TIMEOUT_S} s: "
                                     f"{cgroups.pids_in_use()}")
        _remove_quietly(work)


def _follow(watch: _Watch, proc: subprocess.Popen, isolation: Isolation, limits: SandboxLimits, total: int,
            on_case: Callable[[CaseRecord], bool]) -> None:
    """Read the runner's messages phase by phase until the last case (or on_case says stop).
    The driver's pidfd goes on `watch` as soon as it is known, so that `_end` has it whatever happens."""
    ready, seen = False, 0
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while True:
        for word, payload in watch.lines:
            if word == "child" and watch.driver_pidfd is None and isolation.namespaces and not ready:
                watch.driver_pidfd = _driver_pidfd(payload.get("pid"), proc.pid)
            elif word == "setup_error" and not ready:
                raise SandboxUnavailable(f"sandbox set-up failed: {payload.get('message')}")
            elif word == "ready" and not ready:
                ready, deadline = True, time.monotonic() + limits.timeout_s + CASE_GRACE_S
            elif word == "case" and ready:
                if "setup_error" in payload:
                    raise SandboxUnavailable(f"a test case's process could not start: {payload['setup_error']}")
                seen += 1
                if not on_case(_record(payload)) or seen == total:
                    return
                # after judging: the judge's own time (the host's, on a busy box) is not the next case's
                deadline = time.monotonic() + limits.timeout_s + CASE_GRACE_S
            elif word == "done" and ready:
                return
        watch.lines.clear()
        if watch.exited:
            watch.drain()
            if watch.lines:
                continue
            proc.wait()
            phase = "before starting the program" if not ready else f"after {seen} of {total} test cases"
            raise SandboxUnavailable(f"the sandbox exited with status {proc.returncode} {phase}: "
                                     f"{watch.runner_output.decode('utf-8', 'replace')[-500:]!r}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            what = "did not start" if not ready else "stopped reporting test cases"
            raise SandboxUnavailable(f"the sandbox {what} within its deadline "
                                     f"({SETUP_TIMEOUT_S if not ready else limits.timeout_s + CASE_GRACE_S:.0f} s)")
        watch.poll(remaining)


def _end(watch: _Watch, proc: subprocess.Popen, isolation: Isolation, cgroups: RowCgroups | None,
         uid: int | None, gid: int | None) -> None:
    """Kill the row and wait for every one of its processes (see the module docstring)."""
    driver_pidfd = watch.driver_pidfd
    try:
        if driver_pidfd is not None:  # PID 1 of the namespace: the kernel kills all of it, then lets it exit
            try:
                signal.pidfd_send_signal(driver_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif not isolation.namespaces and not watch.exited:
            try:  # the driver kills and reaps its case's processes, then exits (its SIGTERM handler)
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(KILL_TIMEOUT_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if cgroups is not None:
            cgroups.kill()
        proc.wait()
        if driver_pidfd is not None:
            if not select.select([driver_pidfd], [], [], KILL_TIMEOUT_S)[0]:
                raise SandboxUnavailable(f"the sandbox's PID 1 did not exit within {KILL_TIMEOUT_S} s of SIGKILL")
        if isolation.users == "per_row" and not isolation.namespaces:
            deadline = time.monotonic() + KILL_TIMEOUT_S
            while leftovers := _uid_processes(uid):  # orphans of a killed driver, if any
                if time.monotonic() > deadline:
                    raise SandboxUnavailable(f"processes of the row's user {uid} survived: {leftovers}")
                for pid in leftovers:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.002)
        if isolation.users == "per_row" and not isolation.namespaces:
            _remove_files_of(uid)
        if isolation.users == "per_row" and not isolation.seccomp:  # keyrings the program could make
            isolate.forget_user_keyrings(uid, gid)
    finally:
        if driver_pidfd is not None:
            os.close(driver_pidfd)
        watch.close()


SHARED_DIRS = ("/dev/shm", "/tmp", "/var/tmp")


def _remove_files_of(uid: int) -> None:
    """Without a private file system, what a row's user left in the host's world-writable dirs
    (POSIX semaphores and shared memory in /dev/shm, files in /tmp) goes with the row, so no
    later row can read it. Rows running at the same time can still meet there: docs/reliability.md."""
    for directory in {*SHARED_DIRS, tempfile.gettempdir()}:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
            except OSError:
                continue
            _remove_quietly(entry.path)


def _remove_quietly(path: str) -> None:
    """Remove a tree a program may have built (any depth: `scratch.remove_tree` does not recurse). A failure
    leaves it on disk; it never fails the row, whose result is already decided."""
    try:
        scratch.remove_tree(path)
    except OSError:
        pass
