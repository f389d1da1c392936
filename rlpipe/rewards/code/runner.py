"""The sandbox side of one row: isolate, then run the program once per test case and forward its outputs.

Started by `rlpipe.rewards.code.process` as ``python -s -P runner.py REPORT_FD`` with a JSON plan
on stdin. Standard library only (plus `isolate` and `values`, imported by path): it must start
fast, and after the isolation steps rlpipe's own files may be out of reach.

Three roles, all trusted code:
  * the supervisor (namespace mode only): enters new namespaces, forks the driver (PID 1 of the new
    PID namespace), reports its host pid, waits for it;
  * the driver: builds the private file view, then for each test case forks a case process,
    watches it (wall clock, output cap), kills every other process of the sandbox when it ends,
    and reports what the case printed and returned;
  * the case process, until it starts the program: joins the row's cgroups, takes its stdin,
    stdout, stderr and result pipe, closes every other descriptor (the report pipe included),
    sets the limits, drops privileges and installs the syscall filter.
Only then does untrusted code run, in the case process alone, which can no longer write to the
report pipe. It never sees an expected output, and it decides nothing: the parent compares what
it printed or returned. So a program that tampers with everything it can reach in its process
can only change its own outputs.

Report protocol: lines ``<token> <word> <json>`` on REPORT_FD. ``child``: the driver's host pid;
``setup_error``: isolation failed (the host's fault); ``ready``: the cases start now; ``case``:
one case's outputs; ``done``: all cases ran; ``exit``: the driver's exit code (supervisor).
Case process -> driver, on fd 3: one JSON object, the status of the program (see `finish`).
"""
from __future__ import annotations

import base64
import builtins
import errno
import io
import json
import os
import select
import shutil
import signal
import sys
import threading
import time
import types

RUNNER_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, RUNNER_DIR)
import isolate  # noqa: E402
import values  # noqa: E402

del sys.path[0]
STATUS_FD, GATE_FD = 3, 4
ERR_TAIL = 4000  # bytes of stderr kept per case (diagnostics only)
NETWORK_EVENTS = frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
})
SPAWN_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "subprocess.Popen",
})

# Bound now: the program may replace these module attributes; its own status must still go out.
_write, _exit, _dumps, _type, _getpid = os.write, os._exit, json.dumps, type, os.getpid


class Reporter:
    def __init__(self, fd: int, token: str) -> None:
        self.fd, self.token = fd, token

    def send(self, word: str, payload: dict) -> None:
        data = memoryview(f"{self.token} {word} {json.dumps(payload, separators=(',', ':'))}\n".encode())
        while data:
            data = data[os.write(self.fd, data):]


# ---------------------------------------------------------------------------------------------
# The case process: trusted prologue, then the program
# ---------------------------------------------------------------------------------------------

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
        if plan["uid"] is not None:
            isolate.drop_privileges(plan["uid"], plan["gid"])
        isolate.new_session_keyring()
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


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

class Outputs:
    """What a case wrote on stdout, stderr and its status pipe: at most `cap` + 1 bytes read in all
    (one past the cap is enough to know), stderr kept as its tail only (it is not judged)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.total = cap, 0
        self.data = {"out": bytearray(), "err": bytearray(), "status": bytearray()}

    def full(self) -> bool:
        return self.total > self.cap

    def read(self, fd: int, name: str) -> bool:
        """Read once; False at EOF."""
        try:
            chunk = os.read(fd, max(1, min(65536, self.cap + 1 - self.total)))
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.total += len(chunk)
        self.data[name] += chunk
        if name == "err" and len(self.data["err"]) > 2 * ERR_TAIL:
            del self.data["err"][:-ERR_TAIL]
        return True


class Driver:
    def __init__(self, plan: dict, reporter: Reporter) -> None:
        self.plan, self.reporter = plan, reporter
        self.limits = plan["limits"]
        self.in_pid_namespace = plan["namespaces"]
        self.cgroup_fds: list[int] = []
        self.kill_fd: int | None = None
        self.oom_fd: int | None = None

    def open_cgroups(self) -> None:
        """Before the chroot hides /sys/fs/cgroup: the files a case process joins, kills and reads."""
        self.cgroup_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in self.plan["cgroup_procs"]]
        if self.plan["cgroup_kill"]:
            self.kill_fd = os.open(self.plan["cgroup_kill"], os.O_WRONLY | os.O_CLOEXEC)
        if self.plan["oom_events"]:
            self.oom_fd = os.open(self.plan["oom_events"], os.O_RDONLY | os.O_CLOEXEC)

    def oom_kills(self) -> int:
        if self.oom_fd is None:
            return 0
        for line in os.pread(self.oom_fd, 65536, 0).decode().splitlines():
            key, _, count = line.partition(" ")
            if key == "oom_kill":
                return int(count)
        return 0

    def clear_work_dirs(self) -> None:
        """Each case starts with empty writable dirs: nothing a previous case wrote is left."""
        for directory in self.plan["scratch_dirs"]:
            for entry in os.listdir(directory):
                path = os.path.join(directory, entry)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def stdin_fd(self, case: dict) -> int:
        """A read-only descriptor of the case's input: a memfd, so no pipe can fill up."""
        data = case.get("stdin", "").encode()
        memfd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(memfd, view):]
            return os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(memfd)

    def run_case(self, index: int, case: dict) -> dict:
        self.clear_work_dirs()
        fds = {"stdin": self.stdin_fd(case), "cgroups": self.cgroup_fds}
        readers = {}
        for name in ("out", "err", "status", "gate"):
            readers[name], fds[name] = os.pipe2(os.O_CLOEXEC)
        oom_before = self.oom_kills()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            case_process(self.plan, case, fds)
        for name in ("stdin", "out", "err", "status", "gate"):
            os.close(fds[name])
        gate = readers.pop("gate")
        outputs = Outputs(self.limits["output_bytes"])
        stop, status, cpu = self.watch(pid, readers, outputs, start)
        wall = time.monotonic() - start
        isolate.kill_and_reap_all(in_pid_namespace=self.in_pid_namespace, cgroup_kill_fd=self.kill_fd)
        if stop == "exit":  # every writer is gone now: what is left in the pipes, up to the cap
            for name, fd in readers.items():
                while not outputs.full() and outputs.read(fd, name):
                    pass
            if outputs.full():
                stop = "output_limit"
        started = os.read(gate, 512)
        for fd in (gate, *readers.values()):
            os.close(fd)
        record = {"index": index, "stop": stop, "exit": os.waitstatus_to_exitcode(status), "wall_s": wall,
                  "cpu_s": cpu, "oom_kills": self.oom_kills() - oom_before}
        if started[:1] != b"K":  # the prologue failed, or was cut short: the program never ran
            return {**record, "setup_error": started[1:].decode("utf-8", "replace") or f"case process {stop} "
                    f"before the program started (exit {record['exit']})"}
        return {**record, **{name: base64.b64encode(bytes(data)).decode() for name, data in outputs.data.items()}}

    def watch(self, pid: int, readers: dict, outputs: "Outputs", start: float) -> tuple[str, int, float]:
        """Until the case process exits, overruns its wall clock or its output cap: (stop, status, cpu)."""
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        names = {fd: name for name, fd in readers.items()}
        for fd in names:
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        stop = None
        try:
            while stop is None:
                remaining = start + self.limits["timeout_s"] - time.monotonic()
                if remaining <= 0:
                    stop = "timeout"
                    break
                for fd, _ in poller.poll(remaining * 1000):
                    if fd == pidfd:
                        stop = "exit"
                    elif not outputs.read(fd, names[fd]):
                        poller.unregister(fd)
                if outputs.full():
                    stop = "output_limit"
        finally:
            os.close(pidfd)
        if stop != "exit":
            os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        return stop, status, usage.ru_utime + usage.ru_stime

    def run(self) -> None:
        for index, case in enumerate(self.plan["cases"]):
            self.reporter.send("case", self.run_case(index, case))


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------

def enter_namespaces(reporter: Reporter) -> None:
    """Unshare, fork the driver (PID 1 of the new PID namespace) and return in it; the calling
    process stays outside as the supervisor, which reports the driver's host pid before the driver
    goes on, then waits for it and reports its exit code. If the supervisor dies, the driver gets
    SIGKILL (PDEATHSIG), and with it every process in the namespace."""
    isolate.unshare_namespaces()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        isolate.prctl(isolate.PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")
        if os.read(go_r, 1) != b"g":  # the supervisor died before our PDEATHSIG was set
            _exit(1)
        os.close(go_r)
        return
    os.close(go_r)
    reporter.send("child", {"pid": pid})
    os.write(go_w, b"g")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    reporter.send("exit", {"code": os.waitstatus_to_exitcode(status)})
    _exit(0)


def main() -> None:
    report_fd = int(sys.argv[1])
    os.set_inheritable(report_fd, False)
    plan = json.loads(sys.stdin.buffer.read())
    reporter = Reporter(report_fd, plan["token"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        if plan["namespaces"]:
            enter_namespaces(reporter)
        driver = Driver(plan, reporter)
        driver.open_cgroups()
        if plan["namespaces"]:
            isolate.private_root(plan["root"], work_bytes=plan["limits"]["work_bytes"],
                                 uid=plan["uid"] if plan["uid"] is not None else os.getuid(),
                                 gid=plan["gid"] if plan["gid"] is not None else os.getgid())
        else:
            isolate.prctl(isolate.PR_SET_CHILD_SUBREAPER, 1, "prctl(CHILD_SUBREAPER)")
            signal.signal(signal.SIGTERM, lambda *_: (isolate.kill_and_reap_all(
                in_pid_namespace=False, cgroup_kill_fd=driver.kill_fd), _exit(0)))  # the parent stops the row
        isolate.prctl(isolate.PR_SET_DUMPABLE, 0, "prctl(DUMPABLE)")  # no /proc/<pid>/mem or ptrace of the driver
    except Exception as exc:  # noqa: BLE001 - any set-up failure is the host's, reported as such
        reporter.send("setup_error", {"message": f"{type(exc).__name__}: {str(exc)[:400]}"})
        _exit(3)
    reporter.send("ready", {})
    driver.run()
    reporter.send("done", {})
    _exit(0)


if __name__ == "__main__":
    main()
