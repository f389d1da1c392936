"""What placing stages on a Ray cluster costs: per-stage scheduling overhead, and whole iterations.

Usage (from the repo root, with rlpipe[ray] installed; OMP_NUM_THREADS=1 on a small box):
    python benchmarks/cluster_overhead.py [--stages 10] [--iterations 3] [--out cluster_overhead.json]

It starts a local Ray cluster (`ray.cluster_utils.Cluster`: a head without CPUs and one worker node of 2
CPUs, on 127.0.0.1), then measures:
1. per stage, on the executor (`rlpipe.cluster.executor`): a command that prints the time it started, run
   ``--stages`` times; "start" = from the driver's submit to the command's first line of Python (minus the
   same command's start-up run locally), "stream" = from that line's print to its arrival at the driver,
   "overhead" = the whole `run` minus the same command run locally as a subprocess;
2. whole runs: `rlpipe run -n N` and `rlpipe run -n N --cluster` on the embedded default shrunk as in the
   tests (tests/e2e/conftest.py SMALL), each in a fresh project, and `rlpipe run -n N --no-servers` (no
   warm stage server on the driver either: every stage a fresh process, as on the cluster's nodes).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
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


def whole_runs(address: str, iterations: int) -> dict[str, float]:
    from tests.e2e.conftest import env, make_project

    seconds = {}
    for name, extra in (("one_machine", []), ("one_machine_no_servers", ["--no-servers"]),
                        ("cluster", ["--cluster", address])):
        root = make_project(Path(tempfile.mkdtemp(prefix=f"cluster_bench_{name}_")))
        t0 = time.time()
        subprocess.run(["rlpipe", "run", "-n", str(iterations), *extra], cwd=root, env={**env(), **RAY_ENV},
                       check=True, capture_output=True)
        seconds[name] = round(time.time() - t0, 2)
    seconds["cluster_vs_one_machine"] = round(seconds["cluster"] / seconds["one_machine"], 3)
    seconds["cluster_vs_no_servers"] = round(seconds["cluster"] / seconds["one_machine_no_servers"], 3)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", default="cluster_overhead.json")
    args = parser.parse_args()
    cluster = local_cluster()
    try:
        result = {"per_stage": per_stage(cluster.address, args.stages),
                  f"run_{args.iterations}_iterations_s": whole_runs(cluster.address, args.iterations)}
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
