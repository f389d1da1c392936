"""The child side of the code sandbox: isolate this process, run a program and its tests, report.

Started by `rlpipe.rewards.sandbox` as ``python -s -P sandbox_runner.py REPORT_FD`` with a JSON plan
on stdin. Standard library only, and it never imports rlpipe: it must start fast, and after the
isolation steps rlpipe's own files may be out of reach. Trusted code runs first (read the plan,
enter namespaces, build the file view, set limits, drop privileges); only then the untrusted
program. The format of the tests is documented in `rlpipe.rewards.sandbox`.

Report protocol: lines ``<token> <word> <json>`` on REPORT_FD, a pipe that stdout and stderr do not
share. ``child`` and ``exit``: the host pid and the exit code of the namespace's PID 1 (namespace
mode only);
``setup_error``: isolation could not be set up (the host is at fault, not the program);
``ready``: the untrusted program starts now; ``verdict``: how the tests went. The token is a
random string the parent sends on stdin, so a program that exits early or prints a fake verdict
does not pass. It is not secret from a program that searches this interpreter's memory for it;
docs/reliability.md says what that means.
"""
from __future__ import annotations

import ast
import builtins
import ctypes
import errno
import json
import os
import resource
import signal
import sys

# Flags from <sched.h> and <sys/mount.h>; Python 3.11 has no os.unshare or os.mount.
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

# Host paths the program may read (read-only) in the private file view: the system's libraries
# and the interpreter with its standard library and site-packages. Everything else (home
# directories, the repository, other users' /tmp) is absent.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "random", "urandom")

NETWORK_EVENTS = frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
})
SPAWN_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "subprocess.Popen",
})

# Bound now: the program may replace these module attributes, the runner must keep working.
_write, _exit, _getpid, _dumps = os.write, os._exit, os.getpid, json.dumps
_exec, _compile = builtins.exec, builtins.compile


class SandboxViolation(PermissionError):
    """Raised inside the program when it attempts an operation the sandbox forbids."""


# ---------------------------------------------------------------------------------------------
# Tests: which statements are tests
# ---------------------------------------------------------------------------------------------

def is_test(stmt: ast.stmt) -> bool:
    """A top-level ``assert`` is a test; so is a top-level ``def test_*()``, called after the others."""
    return isinstance(stmt, ast.Assert) or (isinstance(stmt, ast.FunctionDef) and stmt.name.startswith("test_"))


def count_tests(tests: str) -> int:
    """Number of tests in a tests string; raises SyntaxError if it does not parse.

    >>> count_tests("from math import isqrt\\nassert isqrt(9) == 3\\ndef test_big():\\n    assert isqrt(10**6) == 1000\\n")
    2
    """
    return sum(is_test(stmt) for stmt in ast.parse(tests, "<tests>").body)


# ---------------------------------------------------------------------------------------------
# Isolation (trusted; runs before the program)
# ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} on {target}")


def enter_namespaces(report) -> None:
    """New network, mount and PID namespaces; returns in the child that is PID 1 of the new one.

    The calling process stays outside as a supervisor: it reports PID 1's host pid (so the parent
    can wait for it), waits for it and reports its exit code (negative: killed by that signal).
    When PID 1 exits, the kernel kills every process left in the namespace, daemons included, and
    PID 1's exit completes only after they are gone. If the supervisor is killed, PID 1 gets SIGKILL
    (PDEATHSIG).
    """
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below may reach the host's namespace
    pid = os.fork()
    if pid == 0:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        return
    report("child", {"pid": pid})
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    report("exit", {"code": code})
    _exit(code if code >= 0 else 128 - code)


def read_only_dirs() -> list[str]:
    """Directories to show read-only: system dirs and the interpreter's prefixes, nested ones dropped."""
    wanted = set()
    for path in (*SYSTEM_DIRS, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        if os.path.isdir(path) and os.path.realpath(path) != "/":
            wanted.update({os.path.abspath(path), os.path.realpath(path)})  # /bin -> usr/bin shows at both
    kept: list[str] = []
    for path in sorted(wanted, key=len):
        if not any(path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def private_root(root: str, *, work_bytes: int, uid: int, gid: int) -> None:
    """chroot into a fresh tmpfs holding read-only binds of `read_only_dirs`, a few devices, a
    /proc of the new PID namespace, and /tmp: the only writable place, a tmpfs of `work_bytes`
    owned by the sandbox user (its working directory; it vanishes with the namespace)."""
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    os.mkdir(f"{root}/tmp")
    inodes = max(work_bytes // 4096, 64)  # one inode per 4 KiB: many tiny files cannot exhaust memory either
    _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={work_bytes},nr_inodes={inodes},mode=0700,uid={uid},gid={gid}")
    for path in read_only_dirs():
        target = root + path
        os.makedirs(target, exist_ok=True)
        _mount(os.path.realpath(path), target, None, MS_BIND | MS_REC)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.mkdir(f"{root}/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.mkdir(f"{root}/proc")
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chroot(root)
    os.chdir("/tmp")


def set_limits(limits: dict) -> None:
    """Soft = hard, so the program cannot raise them. CPU: at the hard limit the kernel sends SIGKILL."""
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # from root: clears every capability, so no chroot escape and RLIMIT_NPROC applies


# ---------------------------------------------------------------------------------------------
# The program (untrusted from here on)
# ---------------------------------------------------------------------------------------------

class Guard:
    """Audit hook and fork hook: no network, note process creation, keep the report pipe in this process."""

    def __init__(self, report_fd: int) -> None:
        self.report_fd, self.main_pid = report_fd, _getpid()
        self.refused: list[str] = []
        self.spawned = False

    def audit(self, event: str, args: tuple) -> None:
        if event in NETWORK_EVENTS:
            self.refused.append(event)
            raise SandboxViolation(f"{event}: no network in the sandbox")
        if event in SPAWN_EVENTS:
            self.spawned = True

    def after_fork_in_child(self) -> None:
        try:  # a forked copy of the program must not be able to report
            os.close(self.report_fd)
        except OSError:
            pass

    def install(self) -> None:
        sys.addaudithook(self.audit)
        os.register_at_fork(after_in_child=self.after_fork_in_child)


def failure_kind(exc: BaseException, guard: Guard, in_test: bool) -> str:
    if isinstance(exc, SandboxViolation):
        return "sandbox_refused"
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN and guard.spawned:
        return "sandbox_refused"  # fork/spawn refused by the process limit
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, AssertionError) and in_test:
        return "wrong_answer"
    return "runtime_error"


def describe(exc: BaseException) -> str:
    """``Type: message (<tests> line 3)``: the innermost line of the solution or the tests it came from."""
    where, tb = "", exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in ("<tests>", "<solution>"):
            where = f" ({tb.tb_frame.f_code.co_filename} line {tb.tb_lineno})"
        tb = tb.tb_next
    try:
        return f"{type(exc).__name__}: {str(exc)[:250]}{where}"
    except BaseException:  # noqa: BLE001 - str() of a hostile exception may raise anything
        return type(exc).__name__ + where


def attempt(fn, guard: Guard, in_test: bool) -> tuple[str, str] | None:
    """Run fn; None if it returned, else (failure kind, message). A forked copy exits here."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        if _getpid() != guard.main_pid:
            _exit(1)
        return failure_kind(exc, guard, in_test), describe(exc)
    if _getpid() != guard.main_pid:
        _exit(0)
    return None


def run_program(solution: str, tests: str, guard: Guard) -> dict:
    """Run the solution, then the tests in its namespace; returns the verdict.

    The tests are compiled before the solution runs, so a solution cannot change how they compile.
    """
    units = [(stmt, _compile(ast.Module(body=[stmt], type_ignores=[]), "<tests>", "exec"))
             for stmt in ast.parse(tests, "<tests>").body]
    total = sum(is_test(stmt) for stmt, _ in units)
    try:
        code = _compile(solution, "<solution>", "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        return {"kind": "syntax_error", "passed": 0, "total": total, "message": describe(exc)}
    except (MemoryError, RecursionError) as exc:  # a pathologically nested program
        return {"kind": failure_kind(exc, guard, False), "passed": 0, "total": total, "message": describe(exc)}
    namespace = {"__name__": "solution", "__builtins__": builtins}  # `if __name__ == "__main__":` does not run
    failures: list[tuple[str, str]] = []
    passed = 0
    setup_failed = attempt(lambda: _exec(code, namespace), guard, in_test=False)
    test_functions: list[str] = []
    for stmt, unit in units if setup_failed is None else ():
        result = attempt(lambda: _exec(unit, namespace), guard, in_test=isinstance(stmt, ast.Assert))
        if isinstance(stmt, ast.Assert):
            passed += result is None
            failures += [result] if result else []
        elif result is not None:  # a setup statement of the tests failed: no further test can run
            setup_failed = result
            break
        elif is_test(stmt):
            test_functions.append(stmt.name)
    for name in test_functions if setup_failed is None else ():
        result = attempt(lambda: namespace[name](), guard, in_test=True)
        passed += result is None
        failures += [result] if result else []
    if setup_failed is not None:
        failures.append(setup_failed)
    if not failures and passed == total:
        return {"kind": "pass", "passed": passed, "total": total, "message": ""}
    kinds = {kind for kind, _ in failures}
    if guard.refused:  # the program tried the network, even if it caught the refusal
        kinds.add("sandbox_refused")
    kind = next(k for k in ("sandbox_refused", "memory", "runtime_error", "wrong_answer") if k in kinds)
    messages = [msg for k, msg in failures if k == kind] or [f"{guard.refused[0]}: refused (the program caught it)"]
    return {"kind": kind, "passed": passed, "total": total, "message": messages[0]}


def main() -> None:
    report_fd = int(sys.argv[1])
    os.set_inheritable(report_fd, False)  # a program's exec'd subprocesses do not get it

    def report(word: str, payload: dict) -> None:
        _write(report_fd, f"{token} {word} {_dumps(payload)}\n".encode())

    plan = json.loads(sys.stdin.buffer.read())
    token = plan["token"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the program reads EOF from stdin
    os.close(null)
    try:
        if plan["namespaces"]:
            enter_namespaces(report)
            private_root(plan["root"], work_bytes=plan["limits"]["work_bytes"], uid=plan["uid"], gid=plan["gid"])
        set_limits(plan["limits"])
        if plan["uid"] is not None:
            drop_privileges(plan["uid"], plan["gid"])
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        guard = Guard(report_fd)
        guard.install()
    except Exception as exc:  # noqa: BLE001 - any setup failure is the host's, reported as such
        report("setup_error", {"message": describe(exc)})
        _exit(3)
    report("ready", {})
    verdict = run_program(plan["solution"], plan["tests"], guard)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program may have closed or replaced them
            pass
    report("verdict", verdict)
    _exit(0)  # skip the program's atexit handlers and threads


if __name__ == "__main__":
    main()
