"""Long-run soak of the code judge (issue 32): hostile and honest rows through the score stage, watching the host.

Usage (from the repo root, as root for the full sandbox; the box is shared, so niced):
    nice -n 10 python benchmarks/judge_soak.py --rows 100000 [--interval 500] [--minutes 0] [--workers 2] \
        [--out benchmarks/results/judge_soak_<date>.json]

The rows alternate: one program of the second hostile corpus (tests/rewards/code/hostile_corpus.py, every one
wrong on every test case), then one honest program, round robin over the task shapes. They go through
`rlpipe.stages.score.score_rows` (the score stage's code, thread pool of --workers) with the corpus's options
(float_tolerance 1e-6, partial credit, 1 MB output cap): every hostile row must score exactly 0.0, every
honest row 1.0, no row may be an error. Every --interval rows (one `score_rows` call each: the stage's
tally of a call is dropped, so the scorer's memory shows what the judge keeps, not the results) it samples:
  host kernel objects  /proc/key-users lines (all, and those of the rows' uids [2^30, 2^31)), System V IPC
                       (/proc/sysvipc/*), POSIX message queues of the host's IPC namespace, the scorer's
                       mounts, row cgroups, cgroups per controller (/proc/cgroups), dying cgroup v2
                       descendants, processes of the rows' uids, the kernel's slab
  the scorer           open fds, threads, resident memory; its own CPU per row (judging, parsing, spawning:
                       RUSAGE_SELF) apart from the sandboxes' (RUSAGE_CHILDREN)
  disk                 sandbox work dirs left in the temp dir; bytes used in the temp dir and /dev/shm
  speed                rows/s of the interval
The first sample is taken after a warm-up of WARM_UP_ROWS rows (polars starts its thread pool, the sandbox
probes the host). Growth is the least-squares slope over the samples (per 1,000 rows) and end - start. It
fails (exit 1, "GROWTH" lines) if an exact counter of this run (its rows' uids, work dirs and cgroups, the
scorer's fds, threads and mounts, the host's IPC objects) ends above where it started, or the scorer's
memory is on course to grow by more than 32 MiB over the run; and if any row was scored wrong or was an
error. Global counters that other sessions on the box also move (all key-users, cgroups, slab, disk used)
are reported only.
--minutes stops after the interval that passes that wall time (0: run all --rows).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.rewards.code import host_isolation, process
from rlpipe.rewards.code.cgroups import PREFIX
from rlpipe.stages.score import score_rows
from tests.rewards.code.hostile_corpus import CORPUS, CORPUS_OPTIONS, HONEST, TASKS

EXACT = ("row_key_users", "sysvipc", "mqueues", "mounts", "row_cgroups", "row_uid_processes", "scorer_fds",
         "scorer_threads", "work_dirs", "work_dir_kib")
NOISY_TOLERANCE = {"scorer_rss_kib": 32 * 1024}
# global: other sessions on the box move them too, so they are reported, not judged
REPORTED = ("key_users", "cgroups_memory", "cgroups_pids", "dying_cgroups", "slab_kib", "tmp_used_kib", "shm_used_kib")


class Rows:
    """The uids and work dirs this process's rows were given (the sandbox's own calls, recorded), so that what
    is counted is this run's, not another session's on the same box."""

    uids: ClassVar[set[int]] = set()
    work_dirs: ClassVar[list[str]] = []

    @classmethod
    def record(cls) -> None:
        row_uid, mkdtemp = process.row_uid, process.tempfile.mkdtemp

        @contextmanager
        def recorded_uid(isolation):
            with row_uid(isolation) as (uid, gid):
                if uid is not None and isolation.users == "per_row":
                    cls.uids.add(uid)
                yield uid, gid

        def recorded_mkdtemp(*args, **kwargs):
            path = mkdtemp(*args, **kwargs)
            cls.work_dirs.append(path)
            return path

        process.row_uid = recorded_uid
        process.tempfile = SimpleNamespace(mkdtemp=recorded_mkdtemp, gettempdir=tempfile.gettempdir)


WARM_UP_ROWS = 40  # scored (and checked) before the first sample, not counted in the rows


def mixed_rows() -> list[tuple[str, str, float]]:
    """(task, program, expected reward): each hostile program followed by an honest one, round robin."""
    honest = list(HONEST.items())
    rows = []
    for i, name in enumerate(sorted(CORPUS)):
        rows.append((*CORPUS[name], 0.0))
        rows.append((*honest[i % len(honest)], 1.0))
    return rows


def table(rows: list[tuple[str, str, float]], first_id: int) -> pl.DataFrame:
    n = len(rows)
    return pl.DataFrame({
        "prompt_id": list(range(first_id, first_id + n)), "sample_idx": pl.Series([0] * n, dtype=pl.Int32),
        "prompt": ["Write the program."] * n,
        "completion_text": [f"```python\n{program}```\n" for _, program, _ in rows], "answer": [None] * n,
        "metadata": [json.dumps({"tests": TASKS[task].tests, **TASKS[task].metadata}) for task, _, _ in rows],
        "completion_length": pl.Series([len(p) for _, p, _ in rows], dtype=pl.Int32), "truncated": [False] * n,
    })


# ---------------------------------------------------------------------------------------------
# What is counted
# ---------------------------------------------------------------------------------------------

def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _mqueues() -> int:
    """POSIX message queues of the host's IPC namespace, on an mqueue mount in a mount namespace of its own."""
    with tempfile.TemporaryDirectory() as point:
        done = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t mqueue none {point} && ls -A {point}"],
                              capture_output=True, text=True, check=False)
    return len(done.stdout.split()) if done.returncode == 0 else -1


def _row_uid_processes() -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            count += uid in Rows.uids
    return count


def _work_dir_kib() -> tuple[int, int]:
    """(work dirs of this run still on disk, KiB in them)."""
    left, size = 0, 0
    for path in Rows.work_dirs:
        if os.path.lexists(path):
            left += 1
            for top, _, files in os.walk(path):
                size += sum(os.lstat(os.path.join(top, f)).st_size for f in files)
    return left, size // 1024


def _used_kib(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


def _status_kib(field: str) -> int:
    for line in _lines("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def sample(parents: set[str]) -> dict[str, int]:
    """Every counter of the module docstring, now."""
    key_users = _lines("/proc/key-users")
    cgroups = {line.split()[0]: int(line.split()[2]) for line in _lines("/proc/cgroups")[1:] if line.split()}
    dying = 0
    for parent in parents:
        for line in _lines(f"{parent}/cgroup.stat"):
            if line.startswith("nr_dying_descendants"):
                dying += int(line.split()[1])
    meminfo = {line.split(":")[0]: int(line.split()[1]) for line in _lines("/proc/meminfo")}
    return {
        "key_users": len(key_users),
        "row_key_users": sum(int(line.split(":")[0]) in Rows.uids for line in key_users),
        "sysvipc": sum(len(_lines(f"/proc/sysvipc/{name}")) for name in ("shm", "msg", "sem")),
        "mqueues": _mqueues(),
        "mounts": len(_lines("/proc/self/mountinfo")),
        "row_cgroups": sum(1 for parent in parents for name in os.listdir(parent)
                           if name.startswith(f"{PREFIX}{os.getpid()}-")),
        "cgroups_memory": cgroups.get("memory", -1), "cgroups_pids": cgroups.get("pids", -1),
        "dying_cgroups": dying,
        "row_uid_processes": _row_uid_processes(),
        "slab_kib": meminfo.get("Slab", -1),
        "scorer_fds": len(os.listdir("/proc/self/fd")),
        "scorer_threads": len(os.listdir("/proc/self/task")),
        "scorer_rss_kib": _status_kib("VmRSS"),
        **dict(zip(("work_dirs", "work_dir_kib"), _work_dir_kib())),
        "tmp_used_kib": _used_kib(tempfile.gettempdir()),
        "shm_used_kib": _used_kib("/dev/shm"),
    }


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, times 1,000 (growth per 1,000 rows)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def growth(samples: list[dict]) -> tuple[dict, list[str]]:
    """Per counter: start, end, slope per 1,000 rows; and the lines saying what grew."""
    rows = [s["rows"] for s in samples]
    summary, grew = {}, []
    for name in (*EXACT, *NOISY_TOLERANCE, *REPORTED):
        ys = [s["counters"][name] for s in samples]
        slope = slope_per_1000(rows, ys)
        summary[name] = {"start": ys[0], "end": ys[-1], "min": min(ys), "max": max(ys),
                         "slope_per_1000_rows": round(slope, 3)}
        if name in EXACT and ys[-1] > ys[0]:
            grew.append(f"GROWTH {name}: {ys[0]} -> {ys[-1]} (slope {slope:.3f} per 1,000 rows)")
        course = slope * (rows[-1] - rows[0]) / 1000
        if name in NOISY_TOLERANCE and course > NOISY_TOLERANCE[name]:
            grew.append(f"GROWTH {name}: {ys[0]} -> {ys[-1]}, on course for +{course:.0f} KiB over the run "
                        f"(tolerance {NOISY_TOLERANCE[name]} KiB)")
    return summary, grew


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "rlpipe"], capture_output=True, text=True, cwd=REPO, check=False)
    return done.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def wait_for_key_collector(samples_row: dict, parents: set[str], timeout_s: float = 10.0) -> dict:
    """The kernel frees keys in a work queue after their last user: let it run before the last sample."""
    deadline = time.monotonic() + timeout_s
    counters = sample(parents)
    while counters["row_key_users"] > samples_row["row_key_users"] and time.monotonic() < deadline:
        time.sleep(0.2)
        counters = sample(parents)
    return counters


def score_interval(rows: list[tuple[str, str, float]], first_id: int, cfg: ScoreConfig, tally: dict) -> None:
    frame, metrics = score_rows(table(rows, first_id), cfg)
    for (task, program, expected), reward, error in zip(rows, frame["reward"], frame["score_error"]):
        if error is not None:
            tally["errors"] += 1
            tally["examples"].append(f"error on a {task} row: {error[:200]}")
        elif reward != expected:
            tally["forged" if expected == 0.0 else "honest_failed"] += 1
            tally["examples"].append(f"{task}: expected {expected}, got {reward}: {program[:80]!r}")
    for label, count in metrics["details"].get("code_tests", {}).items():
        tally["details"][label] = tally["details"].get(label, 0) + count


def run(args: argparse.Namespace) -> dict:
    isolation = host_isolation()
    parents = isolation.cgroups.parents()
    options = {"tests_key": "tests", **CORPUS_OPTIONS}
    cfg = ScoreConfig(rewards=(RewardEntry("code_tests", 1.0, options),), accuracy_reward="code_tests",
                      fallback_reward=0.0, max_error_fraction=1.0, workers=args.workers, row_timeout_s=None)
    mix = mixed_rows()
    tally = {"errors": 0, "forged": 0, "honest_failed": 0, "details": {}, "examples": []}
    Rows.record()
    score_interval(mix[:WARM_UP_ROWS], -WARM_UP_ROWS, cfg, tally)  # the thread pools of polars, caches, imports
    start, done = time.monotonic(), 0
    usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    samples = [{"rows": 0, "wall_s": 0.0, "counters": sample(parents)}]
    print(f"start: {json.dumps(samples[0]['counters'])}", flush=True)
    while done < args.rows and not (args.minutes and time.monotonic() - start > 60 * args.minutes):
        n = min(args.interval, args.rows - done)
        rows = [mix[(done + i) % len(mix)] for i in range(n)]
        t0, self0, kids0 = time.monotonic(), *usage
        score_interval(rows, done, cfg, tally)
        done += n
        usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.monotonic() - t0
        point = {"rows": done, "wall_s": round(time.monotonic() - start, 1), "rows_per_s": round(n / wall, 3),
                 "scorer_cpu_ms_per_row": round(1000 * (usage[0].ru_utime + usage[0].ru_stime - self0.ru_utime
                                                        - self0.ru_stime) / n, 2),
                 "sandbox_cpu_ms_per_row": round(1000 * (usage[1].ru_utime + usage[1].ru_stime - kids0.ru_utime
                                                         - kids0.ru_stime) / n, 2),
                 "loadavg": Path("/proc/loadavg").read_text().split()[:3], "counters": sample(parents)}
        samples.append(point)
        print(f"{done} rows, {point['rows_per_s']} rows/s, scorer {point['scorer_cpu_ms_per_row']} ms CPU/row, "
              f"load {' '.join(point['loadavg'])}, forged {tally['forged']}, honest failed {tally['honest_failed']}, "
              f"errors {tally['errors']}: {json.dumps(point['counters'])}", flush=True)
    samples[-1]["counters"] = wait_for_key_collector(samples[0]["counters"], parents)
    summary, grew = growth(samples)
    wall = time.monotonic() - start
    scorer_cpu = usage[0].ru_utime + usage[0].ru_stime
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(),
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, Linux {platform.release()}",
            "python": platform.python_version(), "nice": os.nice(0), "workers": args.workers,
            "isolation": {"mode": isolation.mode(), "users": isolation.users, "active": list(isolation.active)},
            "options": options, "rows_asked": args.rows, "rows": done, "wall_s": round(wall, 1),
            "rows_per_s": round(done / wall, 3), "scorer_cpu_ms_per_row": round(1000 * scorer_cpu / max(done, 1), 2),
            "warm_up_rows": WARM_UP_ROWS, "mix": {"hostile": sum(1 for i in range(done) if mix[i % len(mix)][2] == 0.0),
                    "honest": sum(1 for i in range(done) if mix[i % len(mix)][2] == 1.0)},
            "scoring": {k: v for k, v in tally.items() if k != "examples"}, "examples": tally["examples"][:20],
            "growth": summary, "grew": grew, "samples": samples}


def report(result: dict) -> tuple[str, list[str]]:
    """The run as Markdown (what BENCHMARKS.md shows), and the lines saying what failed."""
    lines = [(f"{result['rows']} rows ({result['mix']['hostile']} hostile, {result['mix']['honest']} honest) in "
             f"{result['wall_s']} s: {result['rows_per_s']} rows/s, scorer CPU {result['scorer_cpu_ms_per_row']} "
             f"ms/row"), f"scoring: {json.dumps(result['scoring'])}", "",
             "| counter | judged | start | end | min | max | slope per 1,000 rows |", "|---|---|---|---|---|---|---|"]
    for name, g in result["growth"].items():
        judged = "exact" if name in EXACT else "tolerance" if name in NOISY_TOLERANCE else "reported"
        lines.append(f"| {name} | {judged} | {g['start']} | {g['end']} | {g.get('min', '')} | {g.get('max', '')} | "
                     f"{g['slope_per_1000_rows']} |")
    failed = result["grew"] + [f"SCORING {k}: {result['scoring'][k]}" for k in ("errors", "forged", "honest_failed")
                               if result["scoring"][k]]
    return "\n".join(lines), failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--interval", type=int, default=500, help="rows per sample")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop after the interval past this (0: no limit)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", default=None, help="print the report of a saved run (its --out file) and exit")
    args = parser.parse_args()
    if args.report:
        result = json.loads(Path(args.report).read_text())
    else:
        result = run(args)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    text, failed = report(result)
    print(text)
    for line in failed + result["examples"][:5]:
        print(line)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
