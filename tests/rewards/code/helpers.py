"""Shared helpers of the code_tests tests: limits, one-call runners, weaker sandbox variants, host checks."""
from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from rlpipe.rewards.code import host
from rlpipe.rewards.code.cases import parse_tests
from rlpipe.rewards.code.cgroups import PREFIX, CgroupHost
from rlpipe.rewards.code.host import host_isolation
from rlpipe.rewards.code.process import RUNNER, CaseRecord, SandboxLimits, run_cases
from rlpipe.rewards.code.protections import Isolation
from rlpipe.rewards.code.reward import RowVerdict, code_tests, run_code_tests
from rlpipe.rewards.functions import RewardResult, Sample

ISOLATION = host_isolation()
LIMITS = SandboxLimits(timeout_s=2.0, cpu_time_s=1, memory_mb=256, max_processes=32, max_open_files=64,
                       max_file_mb=1, work_dir_mb=8, max_output_bytes=64_000)
OPTIONS = {"tests_key": "tests", "timeout_s": 2.0, "cpu_time_s": 1, "memory_mb": 256, "max_processes": 32,
           "max_open_files": 64, "max_file_mb": 1, "work_dir_mb": 8, "max_output_bytes": 64_000,
           "partial_credit": False, "float_tolerance": 0.0, "allow_forgeable_tests": False, "required_protections": []}
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
ADD_IO = {"inputs": ["2 3\n", "-1 1\n"], "outputs": ["5\n", "0\n"]}


def limits(**over) -> SandboxLimits:
    return SandboxLimits(**{**vars(LIMITS), **over})


def verdict(code: str, tests=ADD_TESTS, *, isolation: Isolation | None = None, partial_credit: bool = False,
            tolerance: float = 0.0, allow_forgeable: bool = False, metadata: dict | None = None, **over) -> RowVerdict:
    parsed = parse_tests(tests, metadata=metadata or {}, allow_forgeable=allow_forgeable)
    return run_code_tests(code, parsed, limits(**over), partial_credit=partial_credit, float_tolerance=tolerance,
                          isolation=isolation)


def raw(code: str, stdin: str = "", *, isolation: Isolation | None = None, **over) -> CaseRecord:
    """One stdin/stdout case of `code`: what the sandbox returned, unjudged."""
    records = []
    run_cases({"solution": code}, [{"mode": "stdin", "stdin": stdin}], limits(**over), isolation or ISOLATION,
              lambda record: records.append(record) or True)
    return records[0]


def score(completion: str, tests=ADD_TESTS, metadata: dict | None = None, **options) -> RewardResult:
    sample = Sample("Write the function.", completion, None, {"tests": tests, **(metadata or {})}, 10, False)
    return code_tests(sample, **{**OPTIONS, **options})


def variant(base: Isolation = ISOLATION, **changes) -> Isolation:
    """A weaker sandbox than this host's (no namespaces, no cgroups, ...), with its protections recomputed,
    so that the fallbacks a CI host may end up with are exercised here too."""
    chosen = replace(base, **changes)
    nproc = chosen.users != "self" and "process_limit" in base.active
    active, _ = host._protections(chosen, nproc)
    return replace(chosen, active=active, missing={n: host._why_missing(n, chosen, {}) for n in host.PROTECTIONS
                                                   if n not in active})


def weaker_variants() -> dict[str, Isolation]:
    """Named variants this host can run, each weaker than or equal to the host's own; a variant the host
    cannot run (its probe program fails, e.g. an interpreter under /root that no other user may read)
    falls back to running as the scoring user, as `host_isolation` would."""
    no_cgroups = CgroupHost(missing={"memory": "test variant", "pids": "test variant", "kill": "test variant"})
    wanted = {"host": {}}
    if ISOLATION.namespaces:
        wanted["plain"] = {"namespaces": False}
    if ISOLATION.cgroups.parents():
        wanted["no_cgroups"] = {"cgroups": no_cgroups}
    if ISOLATION.seccomp:
        wanted["no_seccomp"] = {"seccomp": False}
    if ISOLATION.users == "per_row":  # one user for every row (a container that maps few uids), no filter
        uid, gid = host._sandbox_user()
        wanted["shared_uid_no_seccomp"] = {"users": "shared", "uid": uid, "gid": gid, "seccomp": False}
    if ISOLATION.namespaces and ISOLATION.cgroups.parents():
        wanted["plain_no_cgroups"] = {"namespaces": False, "cgroups": no_cgroups}
    out = {}
    for name, changes in wanted.items():
        candidate = variant(**changes)
        if name != "host" and host._works(candidate) is not None:
            candidate = variant(**changes, users="self", uid=None, gid=None)
            name += "_as_scoring_user"
        out[name] = candidate
    return out


# ---------------------------------------------------------------------------------------------
# What the host looks like (for the autouse check that nothing of a row outlives it)
# ---------------------------------------------------------------------------------------------

def _status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


USED_UIDS: set[int] = set()  # every per-row uid this test process handed out (conftest records them)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def _descends_from_us(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        pid = _parent(pid)
        if pid == me:
            return True
    return False


def sandbox_processes() -> list[int]:
    """Live processes of this test process's sandboxes: its runners, and anything of a uid it handed to a row.
    (Not every runner on the host: another test run or a benchmark may be using the sandbox meanwhile.)"""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = _status(entry.name)
            if status.get("State", "").startswith("Z"):
                continue
            uid = int(status["Uid"].split()[0])
            ours = RUNNER.encode() in (entry / "cmdline").read_bytes() and _descends_from_us(int(entry.name))
            if ours or uid in USED_UIDS:
                found.append(int(entry.name))
        except (OSError, KeyError, ValueError):
            continue
    return found


def processes_named(comm: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def row_cgroups() -> list[str]:
    """Row cgroups this test process created and left behind."""
    left = []
    for parent in ISOLATION.cgroups.parents():
        left += [n for n in os.listdir(parent) if n.startswith(f"{PREFIX}{os.getpid()}-")]
    return left


def sysv_ipc() -> str:
    out = []
    for name in ("shm", "msg", "sem"):
        try:
            out.append(Path(f"/proc/sysvipc/{name}").read_text())
        except OSError:
            pass
    return "".join(out)


def key_user_lines(uids: set[int]) -> dict[int, str]:
    """The /proc/key-users lines of `uids`: a uid has one while the kernel holds a key (or keyring) it owns."""
    found = {}
    for line in Path("/proc/key-users").read_text().splitlines():
        uid = int(line.split(":", 1)[0])
        if uid in uids:
            found[uid] = line.strip()
    return found


def host_kernel_objects() -> dict[str, int]:
    """Counts of the host's kernel objects a sandboxed row could leave behind. Global counts (key-users lines,
    System V IPC) include other processes of the host; the checks that must not move are this process's own
    (mounts, row cgroups, fds, threads) and the IPC tables."""
    return {"key_users": len(Path("/proc/key-users").read_text().splitlines()),
            "mounts": len(Path("/proc/self/mountinfo").read_text().splitlines()),
            "sysvipc": len(sysv_ipc().splitlines()),
            "mqueues": host_mqueues(),
            "row_cgroups": len(row_cgroups()),
            "our_fds": len(os.listdir("/proc/self/fd")),
            "our_threads": len(os.listdir("/proc/self/task"))}


def host_mqueues() -> int | None:
    """POSIX message queues of the host's IPC namespace, counted on an mqueue mount made in a mount namespace
    of its own (the host's /dev/mqueue may not be mounted); None where that cannot be done here."""
    with tempfile.TemporaryDirectory() as point:
        done = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t mqueue none {point} && ls -A {point}"],
                              capture_output=True, text=True)
    return len(done.stdout.split()) if done.returncode == 0 else None
