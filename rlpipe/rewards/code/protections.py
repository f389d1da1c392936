"""The protections a sandbox can have, the set a host runs with (`Isolation`), and the row's own user.

Why apart from `host` (which probes what this host allows) and `process` (which runs a row): both need
these names, and `host` probes by running a program through `process`; with them here, neither of
the two imports the other's importer. docs/reliability.md says what each protection stops.
"""
from __future__ import annotations

import grp
import pwd
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from rlpipe.rewards.code.cgroups import CgroupHost

__all__ = ["PROTECTIONS", "SandboxUnavailable", "Isolation", "UID_RANGE", "row_uid"]


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the program: a fault of the host or its configuration, not of the program."""


PROTECTIONS = {
    "network_namespace": "a network namespace with no interfaces: no connection to anything, localhost included",
    "pid_namespace": "a PID namespace: the host's processes are invisible, and killing its PID 1 kills every "
                     "process of the row",
    "ipc_namespace": "an IPC namespace per test case: System V shared memory, semaphores, message queues and "
                     "POSIX message queues are the case's own and vanish with it",
    "private_filesystem": "chroot into a tmpfs with read-only system and Python dirs; the only writable places are "
                          "a private /tmp and /dev/shm (work_dir_mb each), fresh tmpfs mounts for each test case",
    "separate_uid": "the program runs as another user than the scoring process: it cannot write, delete or signal "
                    "the host's files and processes, nor the sandbox's own driver",
    "per_row_uid": "each row runs as a user of its own (a random uid in [2^30, 2^31)): per-user kernel state "
                   "(process counts, keyrings) is not shared between rows, leftovers are found by uid, and no keyring "
                   "of the uid stays in the kernel after the row",
    "process_limit": "RLIMIT_NPROC: processes and threads of the sandbox user (root is exempt)",
    "row_process_limit": "one process budget (max_processes) for all of a row's processes: a pids cgroup, or "
                         "RLIMIT_NPROC under a user of the row's own",
    "row_memory_limit": "one memory budget (memory_mb) for all of a row's processes: a memory cgroup, swap off",
    "syscall_filter": "seccomp: keyrings, ptrace, new namespaces, mounts, io_uring, bpf and sockets other than "
                      "AF_UNIX are refused (and System V IPC and POSIX message queues where there is no IPC "
                      "namespace)",
    "kill_all": "every process of the row is killed and reaped before its result is returned (the namespace's "
                "PID 1 killed by pidfd; else the driver, a child subreaper out of the program's reach, kills its "
                "whole tree); cgroup.kill where available",
    "socket_hook": "an audit hook refuses connect/bind/sendto/DNS and non-AF_UNIX sockets from Python",
    "resource_limits": "per process: RLIMIT_CPU (cpu_time_s), RLIMIT_AS (memory_mb), RLIMIT_FSIZE (max_file_mb), "
                       "RLIMIT_NOFILE (max_open_files); no core dumps",
    "scrubbed_environment": "a fixed environment: no variable of the scoring process, no HOME",
    "output_cap": "stdout + stderr + the return value are read up to max_output_bytes per test case, then the "
                  "case is killed",
}
UID_RANGE = (1 << 30, (1 << 31) - 2)


@dataclass(frozen=True)
class Isolation:
    """How this host runs programs: namespaces or not, as which user, and what that protects."""

    namespaces: bool
    users: str  # "per_row" (a fresh uid per row), "shared" (uid/gid below, e.g. nobody), "self" (the scoring user)
    uid: int | None  # the shared uid; None for "per_row" and "self"
    gid: int | None
    seccomp: bool = False
    cgroups: CgroupHost = field(default_factory=CgroupHost)
    active: tuple[str, ...] = ()
    missing: dict[str, str] = field(default_factory=dict)  # protection -> why it is not active here

    def mode(self) -> str:
        return "namespaces" if self.namespaces else "plain process"


def _is_a_user(uid: int) -> bool:
    """Whether `uid` (or the same gid) belongs to someone: directory services may map users this high."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


@contextmanager
def row_uid(isolation: Isolation) -> Iterator[tuple[int | None, int | None]]:
    """(uid, gid) the row's program runs as, held for the row: never two live rows of this process on one uid."""
    if isolation.users != "per_row":
        yield isolation.uid, isolation.gid
        return
    with _uid_lock:
        while True:
            uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
            if uid not in _uids_in_use and not _is_a_user(uid):
                break
        _uids_in_use.add(uid)
    try:
        yield uid, uid
    finally:
        with _uid_lock:
            _uids_in_use.discard(uid)
