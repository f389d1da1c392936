"""Per-row cgroups: one memory and process budget for all of a row's processes, and a kill switch.

Why: RLIMIT_AS and RLIMIT_NPROC are per process and per user, so seven processes of one row could
hold 7 x memory_mb, and one row's processes count against every other row's limit. A cgroup
counts every process a row starts, whatever it does (a ``setsid`` daemon included).

What is used, probed once per process (`probe`), each part independently:
  * memory (``memory.max``, swap off) and pids (``pids.max``) from cgroup v2 where our cgroup, or
    its parent, delegates those controllers; else from the cgroup v1 ``memory`` / ``pids``
    hierarchies (hybrid hosts, such as this project's machine);
  * ``cgroup.kill`` (cgroup v2, Linux 5.14+): every process of the cgroup killed in one write,
    even where no controller is delegated.
Each row gets a fresh cgroup in each hierarchy (``rlpipe-sandbox-<pid>-<random>``); only the
test-case processes join it (the sandbox's own driver stays outside, so the program cannot starve
it). It is removed once empty; ones left by a killed scoring process are removed by the next probe.
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

__all__ = ["CgroupHost", "RowCgroups", "probe"]

PREFIX = "rlpipe-sandbox-"


@dataclass(frozen=True)
class CgroupHost:
    """Where this host lets us create row cgroups; None for a part that is not available."""

    memory: tuple[str, str] | None = None  # (parent dir, "v1" | "v2")
    pids: tuple[str, str] | None = None
    kill: str | None = None  # a v2 parent dir whose children have cgroup.kill
    missing: dict[str, str] = field(default_factory=dict)  # "memory" / "pids" / "kill" -> why not

    def parents(self) -> set[str]:
        return {p for p in (self.memory and self.memory[0], self.pids and self.pids[0], self.kill) if p}


def _mounts() -> tuple[str | None, dict[str, str]]:
    """(cgroup2 mount point, {v1 controller: its mount point}) from /proc/self/mountinfo."""
    v2, v1 = None, {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = (right.split() + ["", "", ""])[:3]
            point = left.split()[4]
            if fstype == "cgroup2" and v2 is None:
                v2 = point
            elif fstype == "cgroup":
                for option in options.split(","):
                    v1.setdefault(option, point)
    return v2, v1


def _own_paths() -> dict[str, str]:
    """{"v2": path, <v1 controller>: path} of this process, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
            if hierarchy == "0" and not controllers:
                paths["v2"] = path
            for controller in controllers.split(","):
                if controller:
                    paths[controller] = path
    return paths


def _try_child(parent: str, wanted: tuple[str, ...]) -> str | None:
    """None if a child cgroup of `parent` can be made and offers the files `wanted`, else why not."""
    probe_dir = os.path.join(parent, f"{PREFIX}{os.getpid()}-probe-{secrets.token_hex(3)}")
    try:
        os.mkdir(probe_dir)
    except OSError as exc:
        return f"cannot create a cgroup in {parent}: {exc.strerror}"
    try:
        absent = [name for name in wanted if not os.path.exists(os.path.join(probe_dir, name))]
        return f"{parent}: no {', '.join(absent)} in its child cgroups (controller not delegated)" if absent else None
    finally:
        os.rmdir(probe_dir)


def _remove_stale(parent: str) -> None:
    """Remove empty row cgroups whose scoring process is gone (killed before it could remove them)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass
        except (ValueError, PermissionError):
            continue


def probe() -> CgroupHost:
    """What this host offers (root only: creating cgroups needs it in practice)."""
    if os.geteuid() != 0:
        why = f"the scoring process runs as uid {os.geteuid()}; creating cgroups needs root (or a delegated subtree)"
        return CgroupHost(missing={"memory": why, "pids": why, "kill": why})
    try:
        v2_mount, v1_mounts = _mounts()
        own = _own_paths()
    except OSError as exc:
        why = f"cannot read /proc/self/mountinfo or /proc/self/cgroup: {exc}"
        return CgroupHost(missing={"memory": why, "pids": why, "kill": why})
    found: dict[str, object] = {}
    missing: dict[str, str] = {}
    v2_candidates = []
    if v2_mount is not None and "v2" in own:
        v2_own = os.path.join(v2_mount, own["v2"].lstrip("/"))
        v2_candidates = [v2_own] + ([os.path.dirname(v2_own)] if own["v2"] not in ("", "/") else [])
    for part, files in (("memory", ("memory.max",)), ("pids", ("pids.max",))):
        reasons = []
        for parent in v2_candidates:
            why = _try_child(parent, files)
            if why is None:
                found[part] = (parent, "v2")
                break
            reasons.append(why)
        if part not in found and part in v1_mounts and part in own:
            parent = os.path.join(v1_mounts[part], own[part].lstrip("/"))
            why = _try_child(parent, ("memory.limit_in_bytes",) if part == "memory" else ("pids.max",))
            if why is None:
                found[part] = (parent, "v1")
            else:
                reasons.append(why)
        if part not in found:
            missing[part] = "; ".join(reasons) or f"no cgroup v2 or v1 hierarchy with the {part} controller"
    for parent in v2_candidates:
        why = _try_child(parent, ("cgroup.kill",))
        if why is None:
            found["kill"] = parent
            break
        missing["kill"] = why
    else:
        if not v2_candidates:
            missing["kill"] = "no cgroup v2 hierarchy mounted"
    if "kill" in found:
        missing.pop("kill", None)
    host = CgroupHost(memory=found.get("memory"), pids=found.get("pids"), kill=found.get("kill"), missing=missing)
    for parent in host.parents():
        _remove_stale(parent)
    return host


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class RowCgroups:
    """The cgroups of one row, created with its limits; `remove` once every process is gone."""

    def __init__(self, host: CgroupHost, *, memory_bytes: int, pids: int) -> None:
        self.host = host
        self.dirs: dict[str, str] = {}  # parent dir -> the row's dir in it
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        try:
            for parent in sorted(host.parents()):
                path = os.path.join(parent, name)
                os.mkdir(path)
                self.dirs[parent] = path
            if host.memory is not None:
                path = self.dirs[host.memory[0]]
                if host.memory[1] == "v2":
                    _write(f"{path}/memory.max", str(memory_bytes))
                    for optional, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                        if os.path.exists(f"{path}/{optional}"):
                            _write(f"{path}/{optional}", value)
                else:
                    _write(f"{path}/memory.limit_in_bytes", str(memory_bytes))
                    if os.path.exists(f"{path}/memory.memsw.limit_in_bytes"):
                        _write(f"{path}/memory.memsw.limit_in_bytes", str(memory_bytes))
            if host.pids is not None:
                _write(f"{self.dirs[host.pids[0]]}/pids.max", str(pids))
        except OSError:
            self.remove(timeout_s=1.0)
            raise

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files a case process writes itself into."""
        return [f"{path}/cgroup.procs" for path in self.dirs.values()]

    @property
    def kill_file(self) -> str | None:
        return f"{self.dirs[self.host.kill]}/cgroup.kill" if self.host.kill in self.dirs else None

    @property
    def oom_events(self) -> str | None:
        """A file with an ``oom_kill <count>`` line (v2 memory.events, v1 memory.oom_control)."""
        if self.host.memory is None or self.host.memory[0] not in self.dirs:
            return None
        path = self.dirs[self.host.memory[0]]
        return f"{path}/memory.events" if self.host.memory[1] == "v2" else f"{path}/memory.oom_control"

    def peak_memory_bytes(self) -> int | None:
        if self.host.memory is None or self.host.memory[0] not in self.dirs:
            return None
        path = self.dirs[self.host.memory[0]]
        name = "memory.peak" if self.host.memory[1] == "v2" else "memory.max_usage_in_bytes"
        try:
            with open(f"{path}/{name}") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def pids_in_use(self) -> list[int]:
        found = set()
        for path in self.dirs.values():
            try:
                with open(f"{path}/cgroup.procs") as f:
                    found.update(int(line) for line in f if line.strip())
            except OSError:
                continue
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the row's cgroups (cgroup.kill where there is one, else each pid listed)."""
        if self.kill_file is not None:
            try:
                _write(self.kill_file, "1")
            except OSError:
                pass
        for pid in self.pids_in_use():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def remove(self, *, timeout_s: float = 10.0) -> bool:
        """Kill what is left, wait until every cgroup is empty and remove it; False if one could not be."""
        deadline = time.monotonic() + timeout_s
        for path in list(self.dirs.values()):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return False
                    self.kill()
                    time.sleep(0.002)
        self.dirs.clear()
        return True
