"""Throughput of the code_tests sandbox: rows/s through the score stage's logic, and the sandbox's overhead.

Usage (from the repo root, in the project's environment; about 1 minute on 2 cores):
    python benchmarks/sandbox_throughput.py [--rows 120] [--repeats 3] [--out benchmarks/sandbox_throughput.json]

Rows/s: `rlpipe.scoring.score_rows` over a table of N identical code rows with one `code_tests`
reward, for score.workers = 1 and 2, median of --repeats runs. Two programs:
  trivial   a one-line function and one assert (the sandbox's fixed cost dominates)
  typical   a few small functions (DP, sorting, a sieve) checked by 10 asserts, ~45 ms of CPU bare
Overhead: the median wall time of one call for the same program run three ways, one after another:
  bare      `python -c` running solution + tests in one process, no isolation
  plain     the sandbox without namespaces (limits, socket hook, scrubbed env, output cap)
  sandbox   the sandbox as this host runs it (`host_isolation()`)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rlpipe.config import RewardEntry, ScoreConfig  # noqa: E402
from rlpipe.rewards import sandbox  # noqa: E402
from rlpipe.scoring import score_rows  # noqa: E402

OPTIONS = {"tests_key": "tests", "timeout_s": 10.0, "cpu_time_s": 10, "memory_mb": 512, "max_processes": 64,
           "max_file_mb": 8, "work_dir_mb": 32, "max_output_bytes": 1_000_000, "partial_credit": False,
           "required_protections": []}

PROGRAMS = {
    "trivial": ("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5\n"),
    "typical": (
        "from functools import lru_cache\n"
        "def lcs(a, b):\n"
        "    prev = [0] * (len(b) + 1)\n"
        "    for x in a:\n"
        "        cur = [0]\n"
        "        for j, y in enumerate(b):\n"
        "            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))\n"
        "        prev = cur\n"
        "    return prev[-1]\n"
        "def primes(n):\n"
        "    sieve = bytearray([1]) * (n + 1)\n"
        "    sieve[0:2] = b'\\x00\\x00'\n"
        "    for i in range(2, int(n ** 0.5) + 1):\n"
        "        if sieve[i]:\n"
        "            sieve[i * i::i] = bytearray(len(sieve[i * i::i]))\n"
        "    return [i for i, p in enumerate(sieve) if p]\n"
        "@lru_cache(maxsize=None)\n"
        "def ways(n):\n"
        "    return 1 if n <= 1 else ways(n - 1) + ways(n - 2)\n"
        "def top_k(xs, k):\n"
        "    return sorted(xs, reverse=True)[:k]\n",
        "import random\n"
        "rng = random.Random(0)\n"
        "assert lcs('ABCBDAB', 'BDCABA') == 4\n"
        "assert lcs('x' * 50, 'y' * 50) == 0\n"
        "assert lcs(''.join(rng.choice('ACGT') for _ in range(300)), ''.join(rng.choice('ACGT') for _ in range(300))) > 150\n"
        "assert primes(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]\n"
        "assert len(primes(200_000)) == 17984\n"
        "assert ways(10) == 89\n"
        "assert ways(90) == 4660046610375530309\n"
        "xs = [rng.randrange(10**6) for _ in range(50_000)]\n"
        "assert top_k(xs, 3) == sorted(xs)[-3:][::-1]\n"
        "assert top_k([], 2) == []\n"
        "assert top_k([1, 2], 5) == [2, 1]\n"
    ),
}


def table(program: str, rows: int) -> pl.DataFrame:
    code, tests = PROGRAMS[program]
    return pl.DataFrame({
        "prompt_id": list(range(rows)), "sample_idx": pl.Series([0] * rows, dtype=pl.Int32),
        "prompt": ["q"] * rows, "completion_text": [f"```python\n{code}```"] * rows, "answer": [None] * rows,
        "metadata": [json.dumps({"tests": tests})] * rows,
        "completion_length": pl.Series([len(code)] * rows, dtype=pl.Int32), "truncated": [False] * rows,
    })


def rows_per_s(program: str, rows: int, workers: int, repeats: int) -> float:
    cfg = ScoreConfig(rewards=(RewardEntry("code_tests", 1.0, OPTIONS),), accuracy_reward="code_tests",
                      fallback_reward=0.0, max_error_fraction=0.0, workers=workers, row_timeout_s=None)
    frame = table(program, rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        scores, metrics = score_rows(frame, cfg)
        times.append(time.perf_counter() - start)
        assert metrics["details"] == {"code_tests": {"pass": rows}}, metrics
    return rows / statistics.median(times)


def per_call_ms(program: str, calls: int) -> dict[str, float]:
    code, tests = PROGRAMS[program]
    limits = sandbox.SandboxLimits(**{k: OPTIONS[k] for k in ("timeout_s", "cpu_time_s", "memory_mb", "max_processes",
                                                               "max_file_mb", "work_dir_mb", "max_output_bytes")})
    plain = sandbox.Isolation(False, None, None, sandbox._ALWAYS)
    ways = {
        "bare": lambda: subprocess.run([sys.executable, "-c", code + "\n" + tests], check=True),
        "plain": lambda: sandbox.run_code_tests(code, tests, limits, plain),
        "sandbox": lambda: sandbox.run_code_tests(code, tests, limits),
    }
    out = {}
    for name, call in ways.items():
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[name] = 1000 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30, help="calls per way for the overhead table")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    isolation = sandbox.host_isolation()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    result = {"python": platform.python_version(), "cpus": len(__import__("os").sched_getaffinity(0)),
              "isolation": {"namespaces": isolation.namespaces, "active": list(isolation.active)},
              "rows": args.rows, "repeats": args.repeats, "rows_per_s": {}, "per_call_ms": {}}
    for program in PROGRAMS:
        for workers in (1, 2):
            result["rows_per_s"][f"{program}/workers={workers}"] = rows_per_s(program, args.rows, workers, args.repeats)
        result["per_call_ms"][program] = per_call_ms(program, args.calls)
    result["loadavg_before_after"] = [load_before, Path("/proc/loadavg").read_text().split()[:3]]
    print(f"load average (1, 5, 15 min) before: {' '.join(load_before)}, after: {' '.join(result['loadavg_before_after'][1])}")
    print("| program | workers=1 rows/s | workers=2 rows/s | bare `python -c` ms | plain sandbox ms | sandbox ms |")
    print("|---|---|---|---|---|---|")
    for program in PROGRAMS:
        r, c = result["rows_per_s"], result["per_call_ms"][program]
        print(f"| {program} | {r[f'{program}/workers=1']:.1f} | {r[f'{program}/workers=2']:.1f} | {c['bare']:.1f} | "
              f"{c['plain']:.1f} | {c['sandbox']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
