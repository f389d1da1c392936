"""Isolation steps the sandbox's trusted code takes before any untrusted code runs.

Standard library only (ctypes for the syscalls Python lacks): the runner imports this file by path.
Each function is one step; `runner.py` says in which order and in which process they run:
namespaces and the private root in the driver, limits, privileges and the syscall filter in each
test case's process just before the program starts.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import struct
import sys

# <sched.h>, <sys/mount.h>, <linux/prctl.h>, <linux/seccomp.h>, <linux/filter.h>, <linux/audit.h>
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
CLONE_NEWUSER, CLONE_NEWCGROUP, CLONE_NEWTIME = 0x10000000, 0x02000000, 0x00000080
NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWUSER
                   | CLONE_NEWCGROUP | CLONE_NEWTIME)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 36, 38
SECCOMP_MODE_FILTER = 2
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
LD_ABS_W, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
AF_UNIX = 1
EPERM, ENOSYS = 1, 38

# Host paths the program may read (read-only) in the private file view: the system's libraries
# and the interpreter with its standard library and site-packages. Everything else (home
# directories, the repository, the prompt files with the expected outputs) is absent.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "random", "urandom")
SCRATCH_DIRS = ("/tmp", "/dev/shm")  # the only writable places of the private file view
HELD = "/.rlpipe-held"  # read-only binds of interpreter dirs that live under a scratch dir (a venv in /tmp)

# Syscall numbers per architecture (x86_64: asm/unistd_64.h; aarch64: asm-generic/unistd.h).
ARCHES = {
    "x86_64": {"audit": 0xC000003E, "x32_bit": 0x40000000, "nr": {
        "add_key": 248, "request_key": 249, "keyctl": 250, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
        "chroot": 161, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "kcmp": 312, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "pidfd_getfd": 438, "init_module": 175,
        "finit_module": 313, "kexec_load": 246, "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103,
        "acct": 163, "quotactl": 179, "clone3": 435, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "clone": 56, "socket": 41, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
        "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
        "msgctl": 71, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
        "mq_notify": 244, "mq_getsetattr": 245}},
    "aarch64": {"audit": 0xC00000B7, "x32_bit": None, "nr": {
        "add_key": 217, "request_key": 218, "keyctl": 219, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "kcmp": 272, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "pidfd_getfd": 438, "init_module": 105,
        "finit_module": 273, "kexec_load": 104, "swapon": 224, "swapoff": 225, "reboot": 142, "syslog": 116,
        "acct": 89, "quotactl": 60, "clone3": 435, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "clone": 220, "socket": 198, "shmget": 194, "shmat": 196, "shmctl": 195,
        "shmdt": 197, "semget": 190, "semop": 193, "semctl": 191, "semtimedop": 192, "msgget": 186, "msgsnd": 189,
        "msgrcv": 188, "msgctl": 187, "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182,
        "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185}},
}
# Refused with EPERM: kernel state shared across rows (keyrings), looking into or steering other
# processes, new namespaces (a way back to privileges), mounts, and kernel interfaces a program never needs.
DENIED = ("add_key", "request_key", "keyctl", "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns",
          "mount", "umount2", "pivot_root", "chroot", "bpf", "perf_event_open", "userfaultfd", "kcmp", "open_tree",
          "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at",
          "open_by_handle_at", "pidfd_getfd", "init_module", "finit_module", "kexec_load", "swapon", "swapoff",
          "reboot", "syslog", "acct", "quotactl")
# ENOSYS: glibc falls back to clone(), whose flags the filter can read; io_uring runs I/O the filter cannot see.
NOT_IMPLEMENTED = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
# Without an IPC namespace, System V IPC and POSIX message queues are the host's: refused too.
HOST_IPC = ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
            "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
            "mq_getsetattr")

_libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int, what: str) -> None:
    zero = ctypes.c_ulong(0)
    check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), zero, zero, zero), what)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source} on {target}")


def unshare_ipc() -> None:
    """A System V IPC and POSIX message queue namespace of this test case alone: what the program makes there
    vanishes when the case's last process dies, so the next case of the row starts without it."""
    check(_libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")


def mount_scratch(path: str, *, work_bytes: int, uid: int, gid: int) -> None:
    """A fresh, empty tmpfs owned by the sandbox user, bounded in bytes and in inodes (one per 4 KiB, so
    that many tiny files cannot exhaust memory either)."""
    inodes = max(work_bytes // 4096, 64)
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={work_bytes},nr_inodes={inodes},mode=0700,uid={uid},gid={gid}")


def replace_scratch(path: str, *, work_bytes: int, uid: int, gid: int, held: list[tuple[str, str]] = ()) -> None:
    """Detach the tmpfs at `path` and mount a fresh one. Nothing walks what the previous case built: the
    kernel frees the old tmpfs whole once no process holds it (every process of the case is reaped by now).
    ``held``: (held copy, place) of the read-only dirs inside `path` (`private_root`), bound there again."""
    check(_libc.umount2(path.encode(), ctypes.c_int(MNT_DETACH)), f"umount {path}")
    mount_scratch(path, work_bytes=work_bytes, uid=uid, gid=gid)
    for source, target in held:
        if target.startswith(path + "/"):
            bind_read_only(source, target)


def bind_read_only(source: str, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def unshare_namespaces() -> None:
    """New mount, network, PID, IPC and UTS namespaces; the next fork is PID 1 of the new PID namespace."""
    check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below may reach the host's namespace


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


def private_root(root: str, *, work_bytes: int, uid: int, gid: int) -> list[tuple[str, str]]:
    """chroot into a fresh tmpfs holding read-only binds of `read_only_dirs`, a few devices, a /proc of
    the new PID namespace, and two writable tmpfs owned by the sandbox user: /tmp (the working
    directory, `work_bytes`) and /dev/shm (POSIX shared memory and semaphores), each replaced by a fresh
    one before every later test case (`replace_scratch`). All vanish with the namespace. The driver's own
    working directory is /, so it never holds a scratch tmpfs that has been replaced.

    An interpreter dir inside a scratch dir (a virtualenv under /tmp) is also bound at `HELD`, outside
    every scratch dir, and returned as (held copy, place): `replace_scratch` binds it again after a fresh
    tmpfs covered it, so later test cases keep their interpreter's packages."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in SCRATCH_DIRS:
        os.makedirs(root + path)
        mount_scratch(root + path, work_bytes=work_bytes, uid=uid, gid=gid)
    held = []
    for path in read_only_dirs():
        source = os.path.realpath(path)
        if any(path.startswith(d + "/") for d in SCRATCH_DIRS):
            hold = f"{HELD}/{len(held)}"
            bind_read_only(source, root + hold)
            held.append((hold, path))
        bind_read_only(source, root + path)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.mkdir(f"{root}/proc")
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chroot(root)
    os.chdir("/")
    return held


def set_limits(limits: dict, *, processes: int | None) -> None:
    """Soft = hard, so the program cannot raise them. CPU: at the limit the kernel sends SIGKILL.

    ``processes`` None: no RLIMIT_NPROC (it counts per user, so it only bounds a row when the row
    has a user of its own; root is exempt anyway)."""
    pairs = [("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
             ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["open_files"]), ("RLIMIT_CORE", 0)]
    if processes is not None:
        pairs.append(("RLIMIT_NPROC", processes))
    for name, value in pairs:
        resource.setrlimit(getattr(resource, name), (value, value))


def fresh_keyrings(*, clear_user_keyring: bool) -> None:
    """Join a fresh, empty session keyring: the one inherited from the scoring process would be shared
    by every row (keys are kernel state, outside every namespace). With ``clear_user_keyring`` (a sandbox
    user shared by every row, never the scoring user), also empty that user's keyring, which outlives its
    processes and would carry keys to the next row (or the next case, for a uid per row without the
    filter: the parent then has the kernel drop the keyring after the row, `forget_user_keyrings`). Not for
    a uid per row with the filter: it has no keyring, and clearing one makes the kernel create it, to stay
    registered after the row (issue 32). Best effort: a
    kernel without keyrings has nothing to share. The syscall filter then refuses every keyring call."""
    table = ARCHES.get(seccomp_arch() or "")
    if table is None:
        return
    keyctl = ctypes.c_long(table["nr"]["keyctl"])
    _libc.syscall(keyctl, ctypes.c_long(1), ctypes.c_void_p(None))  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    if clear_user_keyring:
        _libc.syscall(keyctl, ctypes.c_long(7), ctypes.c_long(-4))  # KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING


def forget_user_keyrings(uid: int, gid: int) -> None:
    """Have the kernel drop `uid`'s user and user-session keyrings. Why: once made (by a keyring call of a
    program that no syscall filter stops), they stay registered for the life of the user namespace, a
    /proc/key-users entry and keys of the machine's quota per row that ran as a fresh uid. Invalidated, they
    are freed by the kernel's key collector. A child does it as `uid` (only the owner may), then exits.
    Call it once no process of `uid` is left (the parent does, after the row): a keyring invalidated while
    the row runs would still be found, dead, by its next test case until the collector has run."""
    table = ARCHES.get(seccomp_arch() or "")
    if table is None:
        return
    keyctl = ctypes.c_long(table["nr"]["keyctl"])
    pid = os.fork()
    if pid == 0:
        try:
            drop_privileges(uid, gid)
            # Both serials first (KEYCTL_GET_KEYRING_ID): looking one up by its special id once the other
            # is invalidated would make the kernel create that one afresh.
            serials = [_libc.syscall(keyctl, ctypes.c_long(0), ctypes.c_long(ring), ctypes.c_long(0))
                       for ring in (-4, -5)]  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
            for serial in serials:
                if serial > 0:
                    _libc.syscall(keyctl, ctypes.c_long(21), ctypes.c_long(serial))  # KEYCTL_INVALIDATE
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # from root: clears every capability, so no chroot escape and RLIMIT_NPROC applies


# ---------------------------------------------------------------------------------------------
# Syscall filter (seccomp)
# ---------------------------------------------------------------------------------------------

def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program(arch: str, *, host_ipc: bool) -> bytes:
    """A classic-BPF seccomp filter: see DENIED, NOT_IMPLEMENTED, HOST_IPC (when ``host_ipc``),
    clone() with a namespace flag and socket() of any family but AF_UNIX refused; the rest allowed.
    A syscall of another ABI (32-bit, x32) kills the process: the numbers above would not apply."""
    table = ARCHES[arch]
    nr = table["nr"]
    prog = [_insn(LD_ABS_W, 4), _insn(JEQ_K, table["audit"], 1, 0), _insn(RET_K, RET_KILL_PROCESS),
            _insn(LD_ABS_W, 0)]
    if table["x32_bit"] is not None:
        prog += [_insn(JGE_K, table["x32_bit"], 0, 1), _insn(RET_K, RET_KILL_PROCESS)]
    rules = [(name, RET_ERRNO | EPERM) for name in DENIED + (HOST_IPC if host_ipc else ())]
    rules += [(name, RET_ERRNO | ENOSYS) for name in NOT_IMPLEMENTED]
    for name, action in rules:
        prog += [_insn(JEQ_K, nr[name], 0, 1), _insn(RET_K, action)]
    # socket(family, ...): AF_UNIX only (args[0], low 32 bits, at offset 16)
    prog += [_insn(JEQ_K, nr["socket"], 0, 4), _insn(LD_ABS_W, 16), _insn(JEQ_K, AF_UNIX, 0, 1),
             _insn(RET_K, RET_ALLOW), _insn(RET_K, RET_ERRNO | EPERM)]
    # clone(flags, ...): no namespace flag
    prog += [_insn(JEQ_K, nr["clone"], 0, 4), _insn(LD_ABS_W, 16), _insn(JSET_K, NAMESPACE_FLAGS, 0, 1),
             _insn(RET_K, RET_ERRNO | EPERM), _insn(RET_K, RET_ALLOW)]
    prog.append(_insn(RET_K, RET_ALLOW))
    return b"".join(prog)


def seccomp_arch() -> str | None:
    """The key of ARCHES for this interpreter, or None where the filter is not available."""
    machine = os.uname().machine
    if sys.maxsize <= 2**32:  # a 32-bit interpreter on a 64-bit kernel: other numbers
        return None
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(machine.lower())


def install_seccomp(*, host_ipc: bool) -> None:
    """Install the filter on this process and its future children (needs NO_NEW_PRIVS, set here)."""
    arch = seccomp_arch()
    if arch is None:
        raise OSError(ENOSYS, f"no syscall table for {os.uname().machine}")
    program = seccomp_program(arch, host_ipc=host_ipc)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(NO_NEW_PRIVS)")
    zero = ctypes.c_ulong(0)
    check(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                      ctypes.c_void_p(ctypes.addressof(fprog_buffer)), zero, zero), "prctl(SECCOMP)")


# ---------------------------------------------------------------------------------------------
# Killing a whole row
# ---------------------------------------------------------------------------------------------

def descendants(root_pid: int) -> list[int]:
    """Every live descendant of `root_pid`, from /proc (a snapshot: call again until empty)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) "; comm may hold spaces and parens
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], [root_pid]
    while queue:
        for child in children.get(queue.pop(), ()):
            found.append(child)
            queue.append(child)
    return found


def kill_and_reap_all(*, in_pid_namespace: bool, cgroup_kill_fd: int | None = None) -> None:
    """SIGKILL every other process of the sandbox and reap it; returns when none is left.

    As PID 1 of the namespace, kill(-1) reaches every other process in it and every orphan is our
    child. Outside one, we are a child subreaper, so every descendant (a ``setsid`` daemon
    included) stays in our tree: kill the tree from /proc, reap, repeat. A cgroup.kill file, where
    there is one, kills the cgroup's processes in one write as well."""
    me = os.getpid()
    while True:
        if cgroup_kill_fd is not None:
            try:
                os.pwrite(cgroup_kill_fd, b"1", 0)
            except OSError:
                pass
        if in_pid_namespace:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            for pid in descendants(me):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            pid, _ = os.waitpid(-1, 0)  # a child killed above, or a zombie left behind
        except ChildProcessError:
            return
