"""Learning curves of the algorithm suite on the tiny default, through the real pipeline.

Copies the project into a scratch directory, runs `dvc repro prepare` there once, then for each
algorithm copies that prepared project and runs `rlpipe run -n N` (dvc repro + rlpipe iterate per
iteration) with the algorithm's params. Held-out greedy accuracy after each iteration comes from
the project's own history file; the table it prints is what docs/grpo.md, docs/gspo.md and docs/ppo.md report.

    python benchmarks/algorithm_curves.py --iterations 5 --algorithms grpo gspo ppo
    python benchmarks/algorithm_curves.py --list
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import edit_params, make_project  # noqa: E402  (the same project copy the e2e tests use)
from tests.e2e.test_algorithms import VARIANTS  # noqa: E402

# issue 16's losses, estimators and options one at a time (the e2e test combines several per variant to stay
# short, so its variants are not single features)
SINGLE_FEATURES: dict[str, dict[str, object]] = {
    "cispo": {"train.policy_loss": "cispo", "train.eps_low": 1.0, "train.eps_high": 4.0},
    "sapo": {"train.policy_loss": "sapo"},
    "gmpo": {"train.policy_loss": "gmpo", "train.eps_low": 0.4, "train.eps_high": 0.4},
    "token_sum": {"train.loss_aggregation": "token-sum"},
    "reinforce_pp_baseline": {"advantage.estimator": "reinforce_plus_plus_baseline"},
    "grpo_passk": {"advantage.estimator": "grpo_passk"},
    "gdpo": {"advantage.estimator": "gdpo"},
    "normalize_then_sum": {"advantage.estimator": "grpo_normalize_then_sum"},
    "batch_std": {"advantage.std_scope": "batch"},
    "ratio_cap": {"train.ratio_cap": 4.0},
    "high_entropy_80_20": {"train.top_entropy_quantile": 0.2},
    "top_p_keep_mask": {"generate.top_p": 0.9},
    "top_p_full_softmax": {"generate.top_p": 0.9, "train.keep_sampling_mask": False},
}

# the same params as the one-iteration e2e test of every algorithm (one definition of each variant)
ALGORITHMS: dict[str, dict[str, object]] = {"grpo": {}, **VARIANTS, **SINGLE_FEATURES}


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", DVC_NO_ANALYTICS="1", RLPIPE_NO_PROGRESS="1")
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    for key, value in (("GIT_AUTHOR_NAME", "bench"), ("GIT_AUTHOR_EMAIL", "bench@rlpipe.invalid"),
                       ("GIT_COMMITTER_NAME", "bench"), ("GIT_COMMITTER_EMAIL", "bench@rlpipe.invalid")):
        e.setdefault(key, value)
    return e


def sh(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def curve(prepared: Path, work: Path, name: str, updates: dict[str, object], iterations: int) -> dict:
    root = work / name
    shutil.rmtree(root, ignore_errors=True)  # a rerun starts this algorithm over
    shutil.copytree(prepared, root, symlinks=True)
    edit_params(root / "params.yaml", updates)
    sh(["git", "commit", "-q", "--allow-empty", "-am", f"algorithm {name}"], root)
    start = time.time()
    sh(["rlpipe", "run", "-n", str(iterations)], root)
    rows = [json.loads(line) for line in (root / "history/iterations.jsonl").read_text().splitlines()]
    rows = [r for r in rows if not r.get("baseline")]  # the starting model's row: warm_start_accuracy below
    warm = json.loads((root / "metrics/prepare.json").read_text())
    return {"name": name, "warm_start_accuracy": warm.get("warmstart_eval_accuracy"), "rows": rows,
            "seconds_per_iteration": (time.time() - start) / iterations}


def measured(iterations: int, name: str, command: str | None = None) -> dict:
    """Where and from what a run came: the docs cite it, and a rerun of one name replaces only that run."""
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__, "commit": commit,
            "command": command or f"python benchmarks/algorithm_curves.py --iterations {iterations} --algorithms {name}"}


def merge_results(path: Path, results: list[dict], *, iterations: int, command: str | None = None) -> None:
    """Add or replace these runs (by name) in the results file, written atomically."""
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    for r in results:
        data["runs"][r["name"]] = {**r, "measured": measured(iterations, r["name"], command)}
    data["runs"] = dict(sorted(data["runs"].items()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "gspo", "ppo"])
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also merge the runs into this results file (by name), e.g. "
                        "benchmarks/results/algorithm_curves.json, the one source of the docs' curves "
                        "(benchmarks/doc_numbers.py)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for name, updates in ALGORITHMS.items():
            print(f"{name:22s} {updates}")
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rlpipe-curves-"))
    work.mkdir(parents=True, exist_ok=True)
    prepared = work / "_prepared"
    if not prepared.exists():
        prepared.mkdir()
        make_project(prepared, shrink=False)
        sh(["dvc", "repro", "prepare", "train_reward_model"], prepared)
        sh(["git", "add", "-A"], prepared)
        sh(["git", "commit", "-qm", "prepared"], prepared)
    results = [curve(prepared, work, name, ALGORITHMS[name], args.iterations) for name in args.algorithms]
    header = "| algorithm | warm start | " + " | ".join(f"it {i + 1}" for i in range(args.iterations)) + " | s/iter |"
    print(header)
    print("|" + "---|" * (args.iterations + 3))
    for r in results:
        accs = " | ".join(f"{row['eval_accuracy']:.3f}" for row in r["rows"])
        print(f"| {r['name']} | {r['warm_start_accuracy']:.3f} | {accs} | {r['seconds_per_iteration']:.0f} |")
    if args.json:
        merge_results(Path(args.json), results, iterations=args.iterations)


if __name__ == "__main__":
    main()
