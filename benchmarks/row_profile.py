"""Where a sandboxed row's wall time goes (issue 32): each phase of `run_cases`, timed from the scoring process.

Usage (from the repo root, as root for the full sandbox):
    nice -n 10 python benchmarks/row_profile.py [--rows 40] [--cases 1 5]

For --rows rows of `add(a, b)` with each number of asserts in --cases, it wraps the sandbox's parent-side
steps with timers (nothing inside the sandbox changes) and prints the median per row of:
  cgroups        creating the row's cgroups (one per hierarchy) and setting their limits
  spawn          `subprocess.Popen` of the runner (fork + exec of the interpreter)
  setup          from the spawn to the runner's ``ready``: interpreter start, imports, namespaces, private root
  cases          from ``ready`` to the last case's report: per case a fork, the prologue (cgroups, limits,
                 IPC namespace, setuid, seccomp), the program, kill and reap, a fresh tmpfs (after the first),
                 and the judge; the case process's own wall time is shown apart (case_process)
  end            killing the namespace's PID 1 and waiting for it, closing the pipes
  cleanup        removing the row's cgroups and its work dir
and, for scale, a bare ``python -s -P -c pass`` (the interpreter start the runner pays once per row).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rlpipe.rewards.code import (
    SandboxLimits,
    host_isolation,
    parse_tests,
    process,
    run_code_tests,
)

LIMITS = SandboxLimits(timeout_s=10.0, cpu_time_s=10, memory_mb=512, max_processes=64, max_open_files=64,
                       max_file_mb=8, work_dir_mb=32, max_output_bytes=1_000_000)
PHASES = ("cgroups", "spawn", "setup", "cases", "case_process", "end", "cleanup", "row")


class Timers:
    """Wraps the parent-side steps of `process` and adds up their time per row."""

    def __init__(self) -> None:
        self.row: dict[str, float] = {}
        self.marks: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.row[name] = self.row.get(name, 0.0) + seconds

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return wrapper

    def install(self) -> None:
        cgroups = process.RowCgroups
        process.RowCgroups = self.timed("cgroups", cgroups)
        cgroups.remove = self.timed("cleanup", cgroups.remove)
        process._remove_quietly = self.timed("cleanup", process._remove_quietly)
        process._end = self.timed("end", process._end)
        popen = subprocess.Popen

        def spawn(*args, **kwargs):
            start = time.perf_counter()
            proc = popen(*args, **kwargs)
            self.marks["spawned"] = time.perf_counter()
            self.add("spawn", self.marks["spawned"] - start)
            return proc
        process.subprocess = type(sys)("subprocess_timed")
        process.subprocess.Popen, process.subprocess.PIPE = spawn, subprocess.PIPE
        process.subprocess.STDOUT, process.subprocess.TimeoutExpired = subprocess.STDOUT, subprocess.TimeoutExpired
        read = process._Watch._read

        def read_timed(watch, fd, which):
            before = len(watch.lines)
            read(watch, fd, which)
            now = time.perf_counter()
            for word, payload in watch.lines[before:]:
                if word == "ready":
                    self.add("setup", now - self.marks["spawned"])
                    self.marks["last"] = now
                elif word == "case":
                    self.add("cases", now - self.marks["last"])
                    self.add("case_process", payload.get("wall_s", 0.0))
                    self.marks["last"] = now
        process._Watch._read = read_timed


def profile(rows: int, cases: int, timers: Timers) -> dict[str, float]:
    code = "def add(a, b):\n    return a + b\n"
    tests = parse_tests("".join(f"assert add({i}, 1) == {i + 1}\n" for i in range(cases)), metadata={},
                        allow_forgeable=False)
    per_row: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(rows):
        timers.row = {}
        start = time.perf_counter()
        verdict = run_code_tests(code, tests, LIMITS, partial_credit=False)
        timers.add("row", time.perf_counter() - start)
        assert verdict.kind == "pass", verdict
        for name in PHASES:
            per_row[name].append(timers.row.get(name, 0.0))
    return {name: 1000 * statistics.median(values) for name, values in per_row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--cases", type=int, nargs="+", default=[1, 5])
    args = parser.parse_args()
    isolation = host_isolation()
    timers = Timers()
    timers.install()
    profile(3, 1, timers)  # warm
    bare = []
    for _ in range(args.rows):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-s", "-P", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
    print(f"sandbox: {isolation.mode()}, {len(isolation.active)} protections; load {Path('/proc/loadavg').read_text()[:15]}")
    print(f"bare `python -s -P -c pass`: {1000 * statistics.median(bare):.1f} ms")
    print("| cases | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for cases in args.cases:
        result = profile(args.rows, cases, timers)
        print(f"| {cases} | " + " | ".join(f"{result[name]:.1f}" for name in PHASES) + " |")


if __name__ == "__main__":
    main()
