"""Wall time of each stage of one default iteration, split into fixed costs and real work.

Usage (from the repo root, in the project's environment):
    python benchmarks/stage_times.py [--repeats 3] [--out benchmarks/stage_times.json]

It copies the project into a temp dir, runs `dvc repro` once (so every input exists), then runs
each stage's own command (as written in dvc.yaml, without DVC) `--repeats` times (prepare once)
and reports the
median of: the process wall time; inside the process, imports (torch, transformers, polars),
setup (params, torch settings), read (Parquet + model load), compute and write phases (from the
stage's metrics JSON); "interpreter start/exit" is the rest of the process wall time: Python start-up before the
stage script's first line and tear-down (unloading torch) after its last. "fixed" = wall - compute: the share
spent on interpreter start, imports and I/O rather than on the stage's real work.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.e2e.conftest import env, make_project  # noqa: E402  (the same project copy the e2e tests use)

STAGES = ["prepare", "generate", "score", "reference_logprob", "advantage", "train", "evaluate"]


def stage_commands(root: Path) -> dict[str, str]:
    """Each stage's command, rendered by DVC itself (templating resolved)."""
    out = subprocess.run(["dvc", "stage", "list", "--name-only"], cwd=root, env=env(), capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == STAGES, out.stdout
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {name: lock["stages"][name]["cmd"] for name in STAGES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlpipe-bench-"))
    try:
        root = make_project(work, shrink=False)
        subprocess.run(["dvc", "repro", "-q"], cwd=root, env=env(), check=True)
        cmds = stage_commands(root)
        rows = []
        for name in STAGES:
            walls, phases = [], []
            for _ in range(1 if name == "prepare" else args.repeats):  # prepare is compute-bound and slow
                t0 = time.perf_counter()
                subprocess.run(cmds[name], shell=True, cwd=root, env=env(), check=True, capture_output=True)
                walls.append(time.perf_counter() - t0)
                phases.append(json.loads((root / "metrics" / f"{name}.json").read_text())["seconds"])
            med = {k: statistics.median(p.get(k, 0.0) for p in phases)
                   for k in ("imports", "setup", "read", "compute", "write", "total")}
            wall = statistics.median(walls)
            rows.append({"stage": name, "wall_s": round(wall, 2), **{f"{k}_s": round(v, 2) for k, v in med.items()},
                         "fixed_share": round((wall - med["compute"]) / wall, 3)})
        total = sum(r["wall_s"] for r in rows)
        print("| stage | process wall s | interpreter start/exit | imports | setup | read | compute | write "
              "| fixed share |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            start = r["wall_s"] - r["total_s"]  # before the script's first line and after its last
            print(f"| {r['stage']} | {r['wall_s']:.2f} | {start:.2f} | {r['imports_s']:.2f} | {r['setup_s']:.2f} | "
                  f"{r['read_s']:.2f} | {r['compute_s']:.2f} | {r['write_s']:.2f} | {r['fixed_share']:.0%} |")
        it = sum(r["wall_s"] for r in rows if r["stage"] != "prepare")
        print(f"\ntotal {total:.1f} s; one iteration after prepare: {it:.1f} s")
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
