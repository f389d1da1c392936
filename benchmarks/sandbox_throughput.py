"""Throughput of the code_tests reward: rows/s through the score stage's logic, and the cost per row and per case.

Usage (from the repo root, in the project's environment; about 2 minutes on an idle 2-core box):
    python benchmarks/sandbox_throughput.py [--rows 120] [--repeats 3] [--calls 20] [--out FILE.json]

Rows/s: `rlpipe.stages.score.score_rows` over N identical rows with one `code_tests` reward (binary
reward, so every case of a passing row runs), for score.workers = 1 and 2, median of --repeats runs.
Four programs, each correct:
  stdin trivial    read two ints, print their sum; 1 test case
  stdin typical    a sieve and an LCS on the case's input; 5 test cases, ~40 ms of CPU in all
  call trivial     add(a, b); 1 test case (an assert)
  call typical     LCS, a sieve, memoised Fibonacci, top-k; 10 asserts, ~45 ms of CPU in all
Per row, for the same program (median of --calls, one after another):
  bare      one `python -c` process running every case in-process: no isolation, no fork per case
  sandbox   `run_code_tests` as this host runs it (a process per case, verdict here)
The JSON (--out) also records the host's sandbox protections and the load average before and after:
on a shared machine, read the numbers with the load.
"""
from __future__ import annotations

import argparse
import json
import os
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
from rlpipe.rewards.code import SandboxLimits, host_isolation, parse_tests, run_code_tests  # noqa: E402
from rlpipe.stages.score import score_rows  # noqa: E402

OPTIONS = {"tests_key": "tests", "timeout_s": 10.0, "cpu_time_s": 10, "memory_mb": 512, "max_processes": 64,
           "max_open_files": 64, "max_file_mb": 8, "work_dir_mb": 32, "max_output_bytes": 1_000_000,
           "partial_credit": False, "float_tolerance": 0.0, "allow_forgeable_tests": False, "required_protections": []}

STDIN_FUNCTIONS = """
import sys
def primes(n):
    sieve = bytearray([1]) * (n + 1)
    sieve[0:2] = b'\\x00\\x00'
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(sieve[i * i::i]))
    return sum(sieve)
def lcs(a, b):
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]
"""
STDIN_TYPICAL = STDIN_FUNCTIONS + ("n = int(sys.stdin.readline())\na, b = sys.stdin.readline().split()\n"
                                   "print(primes(n))\nprint(lcs(a, b))\n")
CALL_TYPICAL = (
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
    "    return sorted(xs, reverse=True)[:k]\n"
    "def count_primes(n):\n"
    "    return len(primes(n))\n"
)


def _stdin_typical_tests() -> dict:
    import random

    rng = random.Random(0)
    inputs, outputs = [], []
    for n in (30_000, 60_000, 90_000, 120_000, 150_000):
        a = "".join(rng.choice("ACGT") for _ in range(120))
        b = "".join(rng.choice("ACGT") for _ in range(120))
        inputs.append(f"{n}\n{a} {b}\n")
        scope: dict = {}
        exec(STDIN_FUNCTIONS, scope)
        outputs.append(f"{scope['primes'](n)}\n{scope['lcs'](a, b)}\n")
    return {"inputs": inputs, "outputs": outputs}


PROGRAMS = {  # name -> (code, tests)
    "stdin trivial": ("a, b = map(int, input().split())\nprint(a + b)\n", {"inputs": ["2 3\n"], "outputs": ["5\n"]}),
    "stdin typical": (STDIN_TYPICAL, _stdin_typical_tests()),
    "call trivial": ("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5\n"),
    "call typical": (CALL_TYPICAL,
                     "assert lcs('ABCBDAB', 'BDCABA') == 4\n"
                     f"assert lcs({'x' * 50!r}, {'y' * 50!r}) == 0\n"
                     f"assert lcs({'ACGTTGCA' * 30!r}, {'TGCAACGT' * 30!r}) == 236\n"
                     "assert primes(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]\n"
                     "assert count_primes(200000) == 17984\n"
                     "assert ways(10) == 89\n"
                     "assert ways(90) == 4660046610375530309\n"
                     f"assert top_k({list(range(0, 50000, 7))!r}, 3) == [49994, 49987, 49980]\n"
                     "assert top_k([], 2) == []\n"
                     "assert top_k([1, 2], 5) == [2, 1]\n"),
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
        _, metrics = score_rows(frame, cfg)
        times.append(time.perf_counter() - start)
        assert metrics["details"] == {"code_tests": {"pass": rows}}, metrics
    return rows / statistics.median(times)


def bare_script(code: str, tests) -> str:
    """One process, no isolation: the program run once per case in-process (the floor of any judge)."""
    parsed = parse_tests(tests, metadata={}, allow_forgeable=False)
    cases = [c.sandbox for t in parsed for c in t.cases]
    return (f"import io, sys\nsys.path.insert(0, {str(REPO / 'rlpipe/rewards/code')!r})\nimport values\n"
            f"code = compile({code!r}, '<solution>', 'exec')\ncases = {cases!r}\n"
            "for case in cases:\n"
            "    scope = {'__name__': '__main__' if case['mode'] == 'stdin' else 'solution'}\n"
            "    if case['mode'] == 'stdin':\n"
            "        sys.stdin, out, sys.stdout = io.StringIO(case['stdin']), sys.stdout, io.StringIO()\n"
            "        exec(code, scope)\n"
            "        sys.stdout = out\n"
            "    else:\n"
            "        exec(code, scope)\n"
            "        scope[case['fn']](*values.decode(case['args']))\n")


def per_row_ms(program: str, calls: int) -> dict[str, float]:
    code, tests = PROGRAMS[program]
    limits = SandboxLimits(**{k: OPTIONS[k] for k in ("timeout_s", "cpu_time_s", "memory_mb", "max_processes",
                                                       "max_open_files", "max_file_mb", "work_dir_mb",
                                                       "max_output_bytes")})
    parsed = parse_tests(tests, metadata={}, allow_forgeable=False)
    script = bare_script(code, tests)
    ways = {
        "bare": lambda: subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO),
        "sandbox": lambda: run_code_tests(code, parsed, limits, partial_credit=False),
    }
    out = {}
    for name, call in ways.items():
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[name] = 1000 * statistics.median(times)
    out["cases"] = sum(len(t.cases) for t in parsed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20, help="calls per way for the per-row table")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    isolation = host_isolation()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    result = {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
              "isolation": {"mode": isolation.mode(), "users": isolation.users, "active": list(isolation.active)},
              "rows": args.rows, "repeats": args.repeats, "rows_per_s": {}, "per_row_ms": {}}
    for program in PROGRAMS:
        for workers in (1, 2):
            result["rows_per_s"][f"{program}/workers={workers}"] = rows_per_s(program, args.rows, workers, args.repeats)
        result["per_row_ms"][program] = per_row_ms(program, args.calls)
    result["loadavg_before_after"] = [load_before, Path("/proc/loadavg").read_text().split()[:3]]
    print(f"load average (1, 5, 15 min) before: {' '.join(load_before)}, "
          f"after: {' '.join(result['loadavg_before_after'][1])}")
    print("| program | cases | workers=1 rows/s | workers=2 rows/s | bare ms/row | sandbox ms/row |")
    print("|---|---|---|---|---|---|")
    for program in PROGRAMS:
        r, c = result["rows_per_s"], result["per_row_ms"][program]
        print(f"| {program} | {c['cases']} | {r[f'{program}/workers=1']:.1f} | {r[f'{program}/workers=2']:.1f} | "
              f"{c['bare']:.1f} | {c['sandbox']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
