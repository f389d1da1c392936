"""Overlapped iterations on the CPU: held-out accuracy and wall time per iteration, S = 1 against S = 0.

Issue 13 asks whether sampling iteration k+1 with policy version k while iteration k trains (S = 1)
learns as well as the synchronous loop (S = 0) after the same number of samples, within seed noise.
For every seed this script runs the real loop, `rlpipe run --until N --max-staleness S`, in a fresh
clone of this repository for each S (the order of S alternates between seeds, so neither always runs
on a quieter machine), and records each iteration's held-out accuracy and the loop's seconds.

The RL seed is params `seed`; the warm start (prepare) is built once, with the repository's seed, and
copied into every clone (`--prepared DIR`, a finished project whose artifacts/prepare to reuse): the
spread measured is that of sampling and training, not of the warm start. prepare takes ~8 minutes
on a 2-core machine, so without `--prepared` the first clone builds it and the others copy it.

    python benchmarks/overlap_curves.py --seeds 1234 1 2 --iterations 4 --workdir /tmp/overlap \
        --out overlap_curves.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREPARED = ("artifacts/prepare", "metrics/prepare.json")


def sh(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd} ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def clone(dest: Path, prepared: Path | None, seed: int) -> Path:
    """A fresh clone at this repository's HEAD with params `seed` set and, if given, the warm start copied in."""
    from rlpipe.run.iterate import set_params

    if dest.exists():
        shutil.rmtree(dest)
    sh(["git", "clone", "-q", str(REPO), str(dest)], REPO)
    if prepared is None:
        sh(["dvc", "repro", "prepare"], dest)
    else:
        for rel in PREPARED:
            src, out = prepared / rel, dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copyfile)(src, out)
        from rlpipe.data.io import read_json, write_json
        from rlpipe.stages.headline import headline, headline_path

        short = dest / headline_path(PREPARED[1])  # written again: a warm start may predate the headline files
        short.parent.mkdir(parents=True, exist_ok=True)
        write_json(short, headline("prepare", read_json(dest / PREPARED[1])))
    set_params(dest / "params.yaml", {"seed": seed})
    # The copied warm start is recorded as prepare's output under the new seed: only the RL stages vary.
    sh(["dvc", "commit", "-f", "-q", "prepare"], dest)
    sh(["git", "add", "-A", "params.yaml", "dvc.lock", "metrics"], dest)
    sh(["git", "commit", "-qm", f"warm start, seed {seed}"], dest)
    return dest


def run_loop(root: Path, iterations: int, staleness: int) -> list[dict]:
    from rlpipe.run.loop import run_iterations

    rows: list[dict] = []
    cwd = os.getcwd()
    os.chdir(root)
    try:
        run_iterations(root, until=iterations, max_staleness=staleness, on_iteration=rows.append)
    finally:
        os.chdir(cwd)
    return [{"iteration": r["iteration"], "eval_accuracy": r["eval_accuracy"],
             "train_reward_mean": r["train_reward_mean"], "run_seconds": r.get("run_seconds")} for r in rows]


def summarise(runs: list[dict], staleness: list[int], iterations: int) -> dict:
    out = {}
    for s in staleness:
        mine = [r for r in runs if r["staleness"] == s]
        per_iteration = []
        for k in range(iterations):
            acc = [r["rows"][k]["eval_accuracy"] for r in mine]
            wall = [sum(r["rows"][k]["run_seconds"].values()) for r in mine if r["rows"][k]["run_seconds"]]
            per_iteration.append({"iteration": k, "eval_accuracy_mean": round(statistics.mean(acc), 4),
                                  "eval_accuracy_min": min(acc), "eval_accuracy_max": max(acc),
                                  "wall_s_mean": round(statistics.mean(wall), 1) if wall else None})
        out[f"S={s}"] = per_iteration
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--prepared", type=Path, help="a project whose artifacts/prepare and metrics/prepare.json to copy")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    sys.path.insert(0, str(REPO))

    prepared = args.prepared.resolve() if args.prepared else None
    runs = []
    started = time.time()
    for i, seed in enumerate(args.seeds):
        order = args.staleness if i % 2 == 0 else list(reversed(args.staleness))
        for s in order:
            root = clone(args.workdir / f"seed{seed}_S{s}", prepared, seed)
            prepared = prepared or root
            t0 = time.perf_counter()
            rows = run_loop(root, args.iterations, s)
            runs.append({"seed": seed, "staleness": s, "rows": rows,
                         "loop_seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(runs[-1]), flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        "load_average_at_end": os.getloadavg(),
        "iterations": args.iterations, "seeds": args.seeds, "minutes": round((time.time() - started) / 60, 1),
        "summary": summarise(runs, args.staleness, args.iterations),
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
