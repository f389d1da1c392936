"""What placing stages on a Ray cluster costs: per-stage scheduling overhead, and whole iterations.

Usage (from the repo root, with rlpipe[ray] installed; OMP_NUM_THREADS=1 on a small box):
    python benchmarks/cluster_overhead.py [--stages 10] [--iterations 3] [--repeats 3]
        [--runs one_machine,cluster,one_machine_no_servers] [--out cluster_overhead.json]

It starts a local Ray cluster (`ray.cluster_utils.Cluster`: a head without CPUs and one worker node of 2
CPUs, on 127.0.0.1), then measures:
1. per stage, on the executor (`rlpipe.cluster.executor`): a command that prints the time it started, run
   ``--stages`` times; "start" = from the driver's submit to the command's first line of Python (minus the
   same command's start-up run locally), "stream" = from that line's print to its arrival at the driver,
   "overhead" = the whole `run` minus the same command run locally as a subprocess;
2. whole runs: `rlpipe run -n N` and `rlpipe run -n N --cluster` on the embedded default shrunk as in the
   tests (tests/e2e/conftest.py SMALL), each in a fresh project, and `rlpipe run -n N --no-servers` (no
   warm stage server anywhere: every stage a fresh process); ``--repeats`` times, the runs of one repeat one
   after another (side by side: a shared box's load hits both alike), with each stage's start and span as
   the driver saw them (its "Running stage" line to the next), to show where the seconds go.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.conftest import env, make_project

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # everything on 127.0.0.1 (docs/cluster.md)
PROBE = [sys.executable, "-c", "import time; print(repr(time.time()), flush=True)"]


def local_cluster():
    from ray.cluster_utils import Cluster

    os.environ.update(RAY_ENV)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * 2**20})
    cluster.add_node(num_cpus=2, node_name="worker", object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    return cluster


def per_stage(address: str, repeats: int) -> dict[str, float]:
    import shlex

    from rlpipe.cluster.connect import connect
    from rlpipe.cluster.executor import ClusterExecutor
    from rlpipe.config import ClusterConfig, StageResourcesConfig

    connect(address)
    command = shlex.join(PROBE)
    local, startup = [], []
    for _ in range(repeats):
        t0 = time.time()
        printed = float(subprocess.run(PROBE, capture_output=True, text=True).stdout)
        local.append(time.time() - t0)
        startup.append(printed - t0)
    rows = []
    for _ in range(repeats + 1):  # the first warms the node's Ray worker up: reported apart
        out = io.StringIO()
        executor = ClusterExecutor(ClusterConfig(stages={"probe": StageResourcesConfig()}), out=out, err=io.StringIO())
        arrived = {}
        original = executor._print

        def stamp(text, stream, original=original, arrived=arrived):
            arrived.setdefault("t", time.time())
            original(text, stream)

        executor._print = stamp
        t0 = time.time()
        executor.run("probe", [command], str(REPO), dict(os.environ))
        total = time.time() - t0
        printed = float(out.getvalue().split("] ", 1)[1])
        rows.append({"start": printed - t0 - statistics.median(startup), "stream": arrived["t"] - printed,
                     "overhead": total - statistics.median(local)})
    steady = rows[1:]
    return {"first_overhead_s": round(rows[0]["overhead"], 3),
            **{f"{k}_s": round(statistics.median(r[k] for r in steady), 3) for k in ("start", "stream", "overhead")},
            "max_overhead_s": round(max(r["overhead"] for r in steady), 3), "repeats": repeats}


RUNS = {"one_machine": [], "one_machine_no_servers": ["--no-servers"], "cluster": ["--cluster", "{address}"]}
STAGE_LINE = re.compile(r"^Running stage '([^']+)'")


def timed_run(argv: list[str], root: Path) -> tuple[float, list[tuple[float, str]]]:
    """Run ``argv`` in ``root``; its seconds, and (seconds since start, stage) for each stage DVC started.

    A stage's span is from its "Running stage" line to the next one (the last: to the run's end), so it
    holds what the driver waits for: placement, the node's start-up, the stage, DVC's hashing and commit."""
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=root, env={**env(), **RAY_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    starts = []
    for line in proc.stdout:
        found = STAGE_LINE.match(line)
        if found:
            starts.append((round(time.time() - t0, 2), found.group(1)))
    if proc.wait():
        raise SystemExit(f"{' '.join(argv)} failed in {root} (exit {proc.returncode})")
    return round(time.time() - t0, 2), starts


def stage_spans(total: float, starts: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """Each stage start with its span (to the next start) and its iteration (prepare: -1; a stage seen
    before in this iteration starts the next one)."""
    spans, iteration, seen = [], 0, set()
    for i, (at, stage) in enumerate(starts):
        if stage in seen:
            iteration, seen = iteration + 1, set()
        seen.add(stage)
        end = starts[i + 1][0] if i + 1 < len(starts) else total
        spans.append({"iteration": iteration if stage != "prepare" else -1, "stage": stage,
                      "start_s": at, "span_s": round(end - at, 2)})
    return spans


def whole_runs(address: str, iterations: int, names: list[str], repeats: int) -> dict[str, Any]:
    """Each run in ``names`` ``repeats`` times, side by side (one after another within each repeat)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names:
            root = make_project(Path(tempfile.mkdtemp(prefix=f"cluster_bench_{name}_")))
            extra = [a.format(address=address) for a in RUNS[name]]
            total, starts = timed_run(["rlpipe", "run", "-n", str(iterations), *extra], root)
            runs[name].append({"seconds": total, "stages": stage_spans(total, starts)})
            print(f"repeat {repeat}: {name} {total:.1f} s", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for name, rows in runs.items():
        seconds = [r["seconds"] for r in rows]
        summary[name] = {"median_s": round(statistics.median(seconds), 2), "min_s": min(seconds),
                         "max_s": max(seconds)}
    if "one_machine" in runs:
        for name, rows in runs.items():
            if name != "one_machine":
                ratios = [c["seconds"] / o["seconds"] for c, o in zip(rows, runs["one_machine"])]
                summary[f"{name}_vs_one_machine"] = {"median": round(statistics.median(ratios), 3),
                                                     "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
    return {"summary": summary, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="whole runs: each this many times, side by side")
    parser.add_argument("--runs", default="one_machine,cluster,one_machine_no_servers",
                        help=f"whole runs to measure, comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--out", default="cluster_overhead.json")
    args = parser.parse_args()
    names = [n for n in args.runs.split(",") if n]
    if not set(names) <= set(RUNS):
        parser.error(f"--runs: {sorted(set(names) - set(RUNS))} not among {', '.join(RUNS)}")
    cluster = local_cluster()
    try:
        result = {"per_stage": per_stage(cluster.address, args.stages),
                  f"run_{args.iterations}_iterations": whole_runs(cluster.address, args.iterations, names,
                                                                  args.repeats)}
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"per_stage": result["per_stage"],
                      **{k: v["summary"] for k, v in result.items() if k != "per_stage"}}, indent=2))


if __name__ == "__main__":
    main()
