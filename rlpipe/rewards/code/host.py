"""What this host lets the sandbox do: the strongest set of protections that works here, probed once per process.

`host_isolation()` tries the strongest set first and keeps the first that runs a probe program;
``python -m rlpipe.rewards.code`` prints the result, and the score stage's metrics carry it
(``reward_info.code_tests.sandbox``). docs/reliability.md says what each protection stops.
"""
from __future__ import annotations

import os
import pwd
import threading
from dataclasses import replace

from rlpipe.rewards.code import cgroups as cgroup_probe
from rlpipe.rewards.code.cgroups import CgroupHost
from rlpipe.rewards.code.process import SandboxLimits, run_cases
from rlpipe.rewards.code.protections import PROTECTIONS, UID_RANGE, Isolation, SandboxUnavailable

__all__ = ["host_isolation", "describe_host", "isolation_info"]


_ALWAYS = ("socket_hook", "resource_limits", "scrubbed_environment", "output_cap")


def _sandbox_user() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _uid_range_mapped() -> bool:
    """Whether UID_RANGE is usable here (a container's user namespace may map only a few uids)."""
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _, count = (int(x) for x in line.split())
                if inside <= UID_RANGE[0] and UID_RANGE[1] < inside + count:
                    return True
    except (OSError, ValueError):
        pass
    return False


# ---------------------------------------------------------------------------------------------
# Probing
# ---------------------------------------------------------------------------------------------

_PROBE = ("import os, sys\nfor p in sys.path:\n    try:\n        os.listdir(p)\n"
          "    except (FileNotFoundError, NotADirectoryError):\n        pass\nprint(input()[::-1])\n")
_NPROC_PROBE = ("import os\ntry:\n    pid = os.fork()\nexcept BlockingIOError:\n    print('refused')\nelse:\n"
                "    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    print('forked')\n")
_probe_lock = threading.Lock()
_isolation: Isolation | None = None


def _run_probe(isolation: Isolation, code: str, stdin: str, *, max_processes: int = 64) -> str:
    """The probe program's stdout; raises SandboxUnavailable (or OSError) if the sandbox cannot run it."""
    limits = SandboxLimits(timeout_s=20.0, cpu_time_s=20, memory_mb=1024, max_processes=max_processes,
                           max_open_files=64, max_file_mb=1, work_dir_mb=4, max_output_bytes=65536)
    records = []
    run_cases({"solution": code}, [{"mode": "stdin", "stdin": stdin}], limits, isolation,
              lambda record: records.append(record) or True)
    record = records[0]
    if record.stop != "exit" or record.exit != 0:
        raise SandboxUnavailable(f"probe program: {record.stop}, exit {record.exit}: "
                                 f"{record.err.decode('utf-8', 'replace')[-300:]}")
    return record.out.decode()


def _works(isolation: Isolation) -> str | None:
    """None if the probe program runs as it should under `isolation`, else why not."""
    try:
        out = _run_probe(isolation, _PROBE, "olleh")
    except (SandboxUnavailable, OSError) as exc:
        return str(exc)
    return None if out == "hello\n" else f"probe program printed {out[:100]!r}"


def _candidates() -> list[Isolation]:
    """The strongest first; `host_isolation` keeps the first that runs a probe program."""
    if os.geteuid() != 0:
        return [Isolation(False, "self", None, None)]
    uid, gid = _sandbox_user()
    per_row = [] if not _uid_range_mapped() else [Isolation(True, "per_row", None, None)]
    shared = [Isolation(True, "shared", uid, gid)]
    plain = [replace(c, namespaces=False) for c in per_row + shared]
    return per_row + shared + plain + [Isolation(False, "self", None, None)]


def _protections(base: Isolation, nproc: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    active = list(_ALWAYS)
    if base.namespaces:
        active += ["network_namespace", "pid_namespace", "ipc_namespace", "private_filesystem"]
    if base.users != "self":
        active.append("separate_uid")
    if base.users == "per_row":
        active.append("per_row_uid")
    if nproc:
        active.append("process_limit")
    if base.cgroups.pids is not None or (base.users == "per_row" and nproc):
        active.append("row_process_limit")
    if base.cgroups.memory is not None:
        active.append("row_memory_limit")
    if base.seccomp:
        active.append("syscall_filter")
    if base.namespaces or base.users != "self" or base.cgroups.kill is not None:
        active.append("kill_all")
    return tuple(name for name in PROTECTIONS if name in active), {}


def _why_missing(name: str, chosen: Isolation, reasons: dict[str, str]) -> str:
    if name in reasons:
        return reasons[name]
    if os.geteuid() != 0:
        return f"needs root: the scoring process runs as uid {os.geteuid()} (user namespaces are not used)"
    cg = chosen.cgroups.missing
    return {
        "row_memory_limit": f"no memory cgroup: {cg.get('memory', '?')}; memory is bounded per process only "
                            "(RLIMIT_AS), so a row may hold max_processes x memory_mb",
        "row_process_limit": f"no pids cgroup ({cg.get('pids', '?')}) and no user of the row's own",
        "kill_all": "the program runs as the scoring user, so it can kill the sandbox's driver, and without a "
                    f"PID namespace or cgroup.kill ({cg.get('kill', '?')}) its orphans can outlive the row",
        "per_row_uid": "the uids [2^30, 2^31) are not mapped in this user namespace (/proc/self/uid_map); all "
                       "rows run as one user",
        "process_limit": "the program runs as the scoring user (uid 0 is exempt from RLIMIT_NPROC, and another "
                         "user's count would include its other processes)",
    }.get(name, "not available with the sandbox chosen for this host (see the reasons of the stronger ones)")


def host_isolation() -> Isolation:
    """The strongest isolation that works here, probed once per process (a fraction of a second)."""
    global _isolation
    with _probe_lock:
        if _isolation is not None:
            return _isolation
        reasons: dict[str, str] = {}
        for candidate in _candidates():
            why = _works(candidate)
            if why is not None:
                for name in _protections(candidate, False)[0]:
                    reasons.setdefault(name, why)
                reasons.setdefault("separate_uid" if candidate.users != "self" else "kill_all", why)
                continue
            chosen = _strengthen(candidate, reasons)
            nproc = chosen.users != "self" and _nproc_enforced(chosen)
            if chosen.users != "self" and not nproc:
                reasons["process_limit"] = "a probe forked past RLIMIT_NPROC=1: the kernel does not apply it here"
            active, _ = _protections(chosen, nproc)
            missing = {name: _why_missing(name, chosen, reasons) for name in PROTECTIONS if name not in active}
            _isolation = replace(chosen, active=active, missing=missing)
            return _isolation
        raise SandboxUnavailable(f"no sandbox works on this host: {reasons}")


def _strengthen(candidate: Isolation, reasons: dict[str, str]) -> Isolation:
    """Add the syscall filter and the row cgroups, each kept only if the probe still runs with it."""
    from rlpipe.rewards.code import isolate

    if isolate.seccomp_arch() is None:
        reasons["syscall_filter"] = f"no syscall table for this machine ({os.uname().machine})"
    else:
        trial = replace(candidate, seccomp=True)
        why = _works(trial)
        if why is None:
            candidate = trial
        else:
            reasons["syscall_filter"] = why
    host = cgroup_probe.probe()
    if host.parents():
        trial = replace(candidate, cgroups=host)
        why = _works(trial)
        if why is None:
            candidate = trial
        else:
            reasons["row_memory_limit"] = reasons["row_process_limit"] = why
    else:
        candidate = replace(candidate, cgroups=host)
    return candidate


def _nproc_enforced(candidate: Isolation) -> bool:
    """Whether RLIMIT_NPROC stops a fork here (probed without cgroups, which would stop it anyway)."""
    trial = replace(candidate, cgroups=CgroupHost(), active=("process_limit",))
    try:
        return _run_probe(trial, _NPROC_PROBE, "", max_processes=1).strip() == "refused"
    except (SandboxUnavailable, OSError):
        return False


def describe_host() -> str:
    isolation = host_isolation()
    user = {"per_row": "a uid of its own per row", "shared": f"uid {isolation.uid}",
            "self": f"the scoring user (uid {os.geteuid()})"}[isolation.users]
    lines = [f"sandbox on this host: {isolation.mode()}, programs run as {user}", "active:"]
    lines += [f"  {name}: {PROTECTIONS[name]}" for name in isolation.active]
    lines += ["not active:"] + ([f"  {name}: {why}" for name, why in isolation.missing.items()] or ["  (none)"])
    return "\n".join(lines)


def isolation_info(isolation: Isolation) -> dict:
    """The JSON the score stage's metrics carry: which protections are active here, and why others are not."""
    return {"mode": isolation.mode(), "users": isolation.users, "active": list(isolation.active),
            "missing": dict(isolation.missing)}
