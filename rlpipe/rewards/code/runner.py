"""The sandbox side of one row: isolate, then run the program once per test case and forward its outputs.

Started by `rlpipe.rewards.code.process` as ``python -s -P runner.py REPORT_FD`` with a JSON plan
on stdin. Standard library only (plus `isolate`, `program` and `values`, imported by path): it must
start fast, and after the isolation steps rlpipe's own files may be out of reach.

Three roles, all trusted code:
  * the supervisor (namespace mode only): enters new namespaces, forks the driver (PID 1 of the new
    PID namespace), reports its host pid, waits for it;
  * the driver: builds the private file view, then for each test case gives it fresh scratch space
    (`reset_scratch`), forks a case process, watches it (wall clock, output cap), kills every other
    process of the sandbox when it ends, and reports what the case printed and returned;
  * the case process (`program.py`), until it starts the program: joins the row's cgroups, takes
    its stdin, stdout, stderr and status pipes, closes every other descriptor (the report pipe
    included), sets the limits, enters an IPC namespace of its own, drops privileges and installs the
    syscall filter.
Only then does untrusted code run, in the case process alone, which can no longer write to the
report pipe. It never sees an expected output, and it decides nothing: the parent compares what
it printed or returned. So a program that tampers with everything it can reach in its process
can only change its own outputs.

Report protocol: lines ``<token> <word> <json>`` on REPORT_FD. ``child``: the driver's host pid;
``setup_error``: isolation failed (the host's fault); ``ready``: the cases start now; ``case``:
one case's outputs; ``done``: all cases ran; ``exit``: the driver's exit code (supervisor).
Case process -> driver: its outputs, the status line on fd 3, and the gate (fd 4): ``K`` once the
prologue is done, or ``E`` and the reason it failed (see `program`).
"""
from __future__ import annotations

import base64
import json
import os
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import isolate  # noqa: E402
import scratch  # noqa: E402
from program import case_process  # noqa: E402

del sys.path[0]
ERR_TAIL = 4000  # bytes of stderr kept per case (diagnostics only)
_exit = os._exit


class Reporter:
    def __init__(self, fd: int, token: str) -> None:
        self.fd, self.token = fd, token

    def send(self, word: str, payload: dict) -> None:
        data = memoryview(f"{self.token} {word} {json.dumps(payload, separators=(',', ':'))}\n".encode())
        while data:
            data = data[os.write(self.fd, data):]


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
        self.held: list[tuple[str, str]] = []  # interpreter dirs bound inside a scratch dir (`isolate.private_root`)
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

    def reset_scratch(self) -> None:
        """Fresh writable dirs for the next case. With namespaces: a new tmpfs replaces each one, so nothing
        walks the tree the previous case built. Without: the work dir is emptied by `scratch.empty_dir`
        (no recursion, links never followed)."""
        owner = (self.plan["uid"] if self.plan["uid"] is not None else os.getuid(),
                 self.plan["gid"] if self.plan["gid"] is not None else os.getgid())
        for directory in self.plan["scratch_dirs"]:
            if self.plan["namespaces"]:
                isolate.replace_scratch(directory, work_bytes=self.limits["work_bytes"], uid=owner[0], gid=owner[1],
                                        held=self.held)
            else:
                scratch.empty_dir(directory)

    def not_reset(self, index: int, exc: BaseException) -> dict:
        """The record of a case that did not run because its scratch space could not be made fresh: that
        case fails (the judge says so); the driver and the row go on."""
        message = f"the scratch space could not be reset before this case: {type(exc).__name__}: {str(exc)[:300]}"
        return {"index": index, "stop": "scratch_not_reset", "exit": 0, "wall_s": 0.0, "cpu_s": 0.0, "oom_kills": 0,
                "out": "", "status": "", "err": base64.b64encode(message.encode()).decode()}

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
        if index > 0:  # the first case gets the scratch space the set-up made
            try:
                self.reset_scratch()
            except Exception as exc:  # noqa: BLE001 - whatever the previous case left, only this case fails
                return self.not_reset(index, exc)
        fds = {"stdin": self.stdin_fd(case), "cgroups": self.cgroup_fds}
        readers = {}
        for name in ("out", "err", "status", "gate"):
            readers[name], fds[name] = os.pipe2(os.O_CLOEXEC)
        oom_before = self.oom_kills()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            case_process(self.plan, case, fds)
            _exit(70)  # not reached: the case process leaves through its own exit
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
            driver.held = isolate.private_root(plan["root"], work_bytes=plan["limits"]["work_bytes"],
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
