"""What issue 32's per-case resets cost: sandbox wall time per row, before and after, in one run on one box.

Usage (from the repo root, as root, in the project's environment; ~2 minutes on a 2-core box):
    git archive main | tar -x -C /tmp/rlpipe-before     # the code before the change, anywhere
    python benchmarks/case_state_cost.py before=/tmp/rlpipe-before after=. [--rows 40] [--rounds 3]
    python benchmarks/case_state_cost.py --micro 300     # the added per-case steps alone

Each round runs every tree once, alternating, in a fresh process (`--measure`) that imports rlpipe from
that tree, probes the host sandbox, warms up with 2 rows, then times --rows rows of each program with
`run_code_tests`. A row's sandbox wall time is `RowVerdict.wall_s` (runner start to the last process
reaped); the table gives the median over rounds of each round's mean. Alternating the trees in one run
is what makes the numbers comparable on a shared box: load moves both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LIMITS = {"timeout_s": 10.0, "cpu_time_s": 10, "memory_mb": 512, "max_processes": 64, "max_open_files": 64,
          "max_file_mb": 8, "work_dir_mb": 32}
ADD = "def add(a, b):\n    return a + b\n"
ECHO_SUM = "print(sum(map(int, input().split())))\n"
PROGRAMS = {  # name: (code, tests)
    "call, 1 case": (ADD, "assert add(2, 3) == 5\n"),
    "call, 5 cases": (ADD, "".join(f"assert add({i}, 1) == {i + 1}\n" for i in range(5))),
    "call, 20 cases": (ADD, "".join(f"assert add({i}, 1) == {i + 1}\n" for i in range(20))),
    "stdin, 5 cases": (ECHO_SUM, {"inputs": [f"{i} 1\n" for i in range(5)],
                                  "outputs": [f"{i + 1}\n" for i in range(5)]}),
}


def _drop_keyrings(uid: int) -> None:
    """Invalidate `uid`'s user and user-session keyrings (the code before issue 32 leaves them on the host)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    keyctl = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
    pid = os.fork()
    if pid == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        serials = [libc.syscall(keyctl, 0, ring, 0) for ring in (-4, -5)]
        for serial in serials:
            libc.syscall(keyctl, 21, serial)
        os._exit(0)
    os.waitpid(pid, 0)


def _key_user_lines(uids: set[int]) -> int:
    with open("/proc/key-users") as f:
        return sum(1 for line in f if int(line.split(":", 1)[0]) in uids)


def measure(rows: int) -> dict[str, float]:
    """Mean sandbox wall seconds per row of each program, with the rlpipe found first on sys.path; also
    how many /proc/key-users lines the rows' uids left (then removed, so the benchmark leaves none)."""
    sys.path.insert(0, os.getcwd())
    from contextlib import contextmanager

    from rlpipe.rewards.code import SandboxLimits, host_isolation, parse_tests, process, run_code_tests

    uids, row_uid = set(), process.row_uid

    @contextmanager
    def recorded(isolation):
        with row_uid(isolation) as (uid, gid):
            uids.add(uid)
            yield uid, gid

    process.row_uid = recorded
    limits = SandboxLimits(**LIMITS, max_output_bytes=1_000_000)
    isolation = host_isolation()
    out = {}
    for name, (code, tests) in PROGRAMS.items():
        parsed = parse_tests(tests, metadata={}, allow_forgeable=False)
        walls = []
        for i in range(rows + 2):
            row = run_code_tests(code, parsed, limits, partial_credit=False, isolation=isolation)
            assert row.kind == "pass", row
            if i >= 2:
                walls.append(row.wall_s)
        out[name] = statistics.mean(walls)
    uids.discard(None)
    time.sleep(0.5)  # the kernel's key collector frees what the rows' keyrings held
    out["key_users_left_per_row"] = _key_user_lines(uids) / max(len(uids), 1)
    for uid in uids:
        _drop_keyrings(uid)
    return out


def micro(repeats: int) -> dict[str, float]:
    """Milliseconds of the two steps added per test case, alone: replacing /tmp and /dev/shm by fresh tmpfs
    (in a mount namespace of this process's own), and a case process that enters an IPC namespace (fork,
    unshare, exit, reap) against one that does not."""
    sys.path.insert(0, os.path.join(os.getcwd(), "rlpipe", "rewards", "code"))
    import ctypes
    import tempfile

    import isolate

    libc = ctypes.CDLL(None, use_errno=True)
    isolate.check(libc.unshare(isolate.CLONE_NEWNS), "unshare")
    isolate.mount(None, "/", None, isolate.MS_REC | isolate.MS_PRIVATE)
    points = [tempfile.mkdtemp(), tempfile.mkdtemp()]
    for point in points:
        isolate.mount_scratch(point, work_bytes=32 << 20, uid=0, gid=0)
    start = time.perf_counter()
    for _ in range(repeats):
        for point in points:
            isolate.replace_scratch(point, work_bytes=32 << 20, uid=0, gid=0)
    out = {"replace /tmp and /dev/shm": (time.perf_counter() - start) / repeats * 1000}
    for point in points:
        isolate.check(libc.umount2(point.encode(), isolate.MNT_DETACH), "umount")
        os.rmdir(point)
    for name, step in (("fork, exit, reap", lambda: None), ("fork, unshare IPC, exit, reap", isolate.unshare_ipc)):
        start = time.perf_counter()
        for _ in range(repeats):
            pid = os.fork()
            if pid == 0:
                step()
                os._exit(0)
            os.waitpid(pid, 0)
        out[name] = (time.perf_counter() - start) / repeats * 1000
    return out


def compare(trees: dict[str, str], rows: int, rounds: int) -> dict:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    loads = [os.getloadavg()[0]]
    for _ in range(rounds):
        for name, path in trees.items():
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", "--rows", str(rows)],
                                  cwd=path, capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": os.path.abspath(path)})
            results[name].append(json.loads(done.stdout.splitlines()[-1]))
        loads.append(os.getloadavg()[0])
    table = {name: {key: statistics.median(r[key] for r in runs) for key in (*PROGRAMS, "key_users_left_per_row")}
             for name, runs in results.items()}
    return {"date": time.strftime("%Y-%m-%d"), "rows": rows, "rounds": rounds, "load_avg_1min": loads,
            "median_of_round_means_s": table, "rounds_raw": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*", help="NAME=PATH of each source tree to compare")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help="(internal) measure the tree in the cwd")
    parser.add_argument("--micro", type=int, default=0, help="time the added per-case steps alone, N times")
    args = parser.parse_args()
    if args.micro:
        print(json.dumps(micro(args.micro)))
        return
    if args.measure:
        print(json.dumps(measure(args.rows)))
        return
    report = compare(dict(tree.split("=", 1) for tree in args.trees), args.rows, args.rounds)
    print(json.dumps(report, indent=1))
    for name, row in report["median_of_round_means_s"].items():
        print(name, "  ".join(f"{program}: {row[program] * 1000:.0f} ms" for program in PROGRAMS),
              f" key-users lines left per row: {row['key_users_left_per_row']:.2f}")


if __name__ == "__main__":
    main()
