"""The case process of the sandbox: a trusted prologue, then the untrusted program, for one test case.

Standard library only (plus `isolate` and `values`, imported by path): `runner.py`'s driver forks
this process once per case and calls `case_process`. The prologue joins the row's cgroups, takes the
case's stdin, stdout, stderr and status pipes, closes every other descriptor (the report pipe
included), sets the limits, enters an IPC namespace of its own (namespace mode), drops to the row's
user, joins a fresh session keyring and installs the syscall filter; it then says so on the gate pipe
and closes it. Only then does the program run (`run_program`). Whatever the program does from here on
reaches the judge only as what it printed and the status line it wrote on fd 3
(``{"status": "ok" | "returned" | "unencodable" | "error", ...}``): its own claims about its own
outputs, which the judge reads as untrusted data.
"""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal
import sys
import threading
import types

import isolate
import values

RUNNER_DIR = os.path.dirname(os.path.abspath(__file__))
STATUS_FD, GATE_FD = 3, 4
NETWORK_EVENTS = frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
})
SPAWN_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "subprocess.Popen",
})

# Bound now: the program may replace these module attributes; its own status must still go out.
_write, _exit, _dumps, _type, _getpid = os.write, os._exit, json.dumps, type, os.getpid


class SandboxViolation(PermissionError):
    """Raised inside the program when it attempts an operation the sandbox forbids."""


class Guard:
    """Audit hook: refuse the network from Python (the namespace or the syscall filter stops ctypes)."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.spawned = False

    def audit(self, event: str, args: tuple) -> None:
        if event in NETWORK_EVENTS or (event == "socket.__new__" and args and args[1] != 1):  # 1: AF_UNIX
            self.refused.append(event)
            raise SandboxViolation(f"{event}: no network in the sandbox")
        if event in SPAWN_EVENTS:
            self.spawned = True


def failure_kind(exc: BaseException, guard: Guard) -> str:
    if isinstance(exc, SandboxViolation):
        return "sandbox_refused"
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN and guard.spawned:
        return "sandbox_refused"  # fork/spawn refused by the process limit
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, AssertionError):
        return "wrong_answer"
    return "runtime_error"


def describe(exc: BaseException) -> str:
    """``Type: message (<solution> line 3)``: the innermost line of the program it came from."""
    where, tb = "", exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in ("<solution>", "<tests>"):
            where = f" ({tb.tb_frame.f_code.co_filename} line {tb.tb_lineno})"
        tb = tb.tb_next
    try:
        return f"{_type(exc).__name__}: {str(exc)[:250]}{where}"
    except BaseException:  # noqa: BLE001 - str() of a hostile exception may raise anything
        return "exception" + where


_case_pid = [0]  # the case process's pid, set when its program starts


def finish(status: dict, code: int) -> None:
    """Flush the program's streams, write its status on fd 3, and leave (no atexit, no thread joins).
    A forked copy of the program (a child it made) leaves without a status: only the case process reports."""
    if _getpid() != _case_pid[0]:
        _exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program may have closed or replaced them
            pass
    try:
        data = _dumps(status, separators=(",", ":")).encode() + b"\n"
        while data:
            data = data[_write(STATUS_FD, data):]
    except BaseException:  # noqa: BLE001 - fd 3 closed by the program: no status, judged as such
        pass
    _exit(code)


def join_threads() -> None:
    """What interpreter shutdown does: wait for the non-daemon threads (a solve() run in a thread)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def find_function(namespace: dict, name: str):
    """A top-level function `name`, else the method `name` of a class ``Solution`` (LeetCode style)."""
    fn = namespace.get(name)
    if callable(fn):
        return fn
    cls = namespace.get("Solution")
    if isinstance(cls, type) and callable(getattr(cls, name, None)):
        return getattr(cls(), name)
    raise NameError(f"the program defines no function {name!r}")


def run_program(program: dict, case: dict, guard: Guard) -> None:
    """Run the untrusted program for one case; never returns."""
    mode = case["mode"]
    module = types.ModuleType("__main__" if mode == "stdin" else "solution")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module  # the runner's own module is out of reach by that name
    args = kwargs = None
    if mode == "call":
        args, kwargs = values.decode(case["args"]), values.decode(case["kwargs"])
    try:
        code = compile(program["solution"], "<solution>", "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        finish({"status": "error", "kind": "syntax_error", "message": describe(exc)}, 1)
    except (MemoryError, RecursionError) as exc:  # a pathologically nested program
        finish({"status": "error", "kind": failure_kind(exc, guard), "message": describe(exc)}, 1)
    try:
        exec(code, module.__dict__)
        if mode == "call":
            value = find_function(module.__dict__, case["fn"])(*args, **kwargs)
        elif mode == "python":
            exec(compile(case["python"], "<tests>", "exec"), module.__dict__)
            for name in case["test_functions"]:
                module.__dict__[name]()
            if case["check"] is not None:
                module.__dict__["check"](find_function(module.__dict__, case["check"]))
        join_threads()
    except SystemExit as exc:
        if mode == "stdin" and exc.code in (None, 0):
            join_threads()
            finish({"status": "ok"}, 0)
        code = exc.code if _type(exc.code) is int else 1
        finish({"status": "error", "kind": "runtime_error", "message": f"SystemExit({str(exc.code)[:100]})"},
               code if mode == "stdin" and 0 < code < 256 else 1)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and the rest are the program's failures
        kind = "sandbox_refused" if guard.refused else failure_kind(exc, guard)
        finish({"status": "error", "kind": kind, "message": describe(exc)}, 1)
    if guard.refused:  # it tried the network, and caught the refusal
        finish({"status": "error", "kind": "sandbox_refused", "message": f"{guard.refused[0]}: refused"}, 1)
    if mode != "call":
        finish({"status": "ok"}, 0)
    try:
        encoded = values.encode(value)
    except (values.Unsupported, RecursionError) as exc:
        finish({"status": "unencodable", "message": str(exc)[:300]}, 0)
    finish({"status": "returned", "value": encoded}, 0)


def case_process(plan: dict, case: dict, fds: dict) -> None:
    """The trusted prologue of a case process, then the program. Never returns.

    The prologue ends by writing ``K`` on the gate pipe (fd 4) and closing it; a failure writes
    ``E`` and the reason instead. The program never holds the gate, so only this code can tell the
    driver that the sandbox failed to start (an error of the row, not a score)."""
    gate = fds["gate"]
    try:
        for fd in fds["cgroups"]:
            os.write(fd, b"0")  # this process, and every process it starts, counts against the row's budget
        for target, name in ((0, "stdin"), (1, "out"), (2, "err"), (STATUS_FD, "status"), (GATE_FD, "gate")):
            os.dup2(fds[name], target)
        gate = GATE_FD
        os.closerange(GATE_FD + 1, 1 << 20)  # the report pipe, cgroup files, other pipes
        limits = plan["limits"]
        isolate.set_limits(limits, processes=limits["processes"] if plan["nproc"] else None)
        os.chdir(plan["work_dir"])
        os.umask(0o077)
        if plan["namespaces"]:
            isolate.unshare_ipc()  # IPC objects of this case die with it: the next case starts without them
        if plan["uid"] is not None:
            isolate.drop_privileges(plan["uid"], plan["gid"])
        # a fresh uid per row has no keyring to clear unless a program without the filter made one
        isolate.fresh_keyrings(clear_user_keyring=plan["uid"] is not None
                               and not (plan["per_row_uid"] and plan["seccomp"]))
        if plan["seccomp"]:
            isolate.install_seccomp(host_ipc=not plan["namespaces"])
        else:
            isolate.prctl(isolate.PR_SET_NO_NEW_PRIVS, 1, "prctl(NO_NEW_PRIVS)")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                     encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                       encoding="utf-8")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                       encoding="utf-8", errors="backslashreplace",
                                                       line_buffering=True)
        sys.argv = ["solution.py"]
        sys.path[:] = [p for p in sys.path if p and not p.startswith(RUNNER_DIR)]
        guard = Guard()
        sys.addaudithook(guard.audit)
    except BaseException as exc:  # noqa: BLE001 - the host's fault: say so on the gate
        try:
            os.write(gate, b"E" + f"{type(exc).__name__}: {exc}"[:400].encode())
        finally:
            _exit(70)
    _case_pid[0] = os.getpid()
    os.write(GATE_FD, b"K")
    os.close(GATE_FD)
    run_program(plan["program"], case, guard)
