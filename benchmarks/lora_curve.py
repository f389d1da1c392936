"""LoRA vs full fine-tuning on the tiny default: held-out accuracy per iteration, checkpoint bytes, DVC cache growth.

Builds the real project in a scratch directory and runs `dvc repro prepare` once (`--prepare`), then
each variant in a copy of it, one `rlpipe run -n 1` per iteration, measuring after each: the bytes of
the checkpoint train wrote and of the project's DVC cache (`.dvc/cache`, everything DVC stored so far:
prepared model and tables, every stage's outputs, `state/policy`). What docs/lora.md and BENCHMARKS.md report.

    python benchmarks/lora_curve.py --workdir W --prepare
    python benchmarks/lora_curve.py --workdir W --variant full --iterations 5
    python benchmarks/lora_curve.py --workdir W --variant lora_r16 --iterations 5
    python benchmarks/lora_curve.py --workdir W --table
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.algorithm_curves import sh  # noqa: E402  (same environment: 1 thread, no progress bars)
from tests.e2e.conftest import edit_params, make_project  # noqa: E402

LORA_LR = 1.0e-3  # ~10x full fine-tuning's 1e-4 ("LoRA Without Regret"; TRL's reproduction)
VARIANTS: dict[str, dict[str, object]] = {
    "full": {},
    "lora_r16": {"train.lora.rank": 16, "train.lora.alpha": 32.0, "train.lr": LORA_LR},
    "lora_r1": {"train.lora.rank": 1, "train.lora.alpha": 32.0, "train.lr": LORA_LR},
    "lora_r16_lr1e-4": {"train.lora.rank": 16, "train.lora.alpha": 32.0},
}


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, each inode once (DVC's cache and workspace share hard links)."""
    seen, total = set(), 0
    for f in path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def run_variant(work: Path, name: str, iterations: int) -> dict:
    """Run ``iterations`` more iterations of variant ``name`` (its copy of the prepared project is made on the
    first call; later calls continue it, so a long curve can be run in pieces)."""
    root, out = work / name, work / f"{name}.json"
    if not root.is_dir():
        shutil.copytree(work / "prepared", root, symlinks=True)
        edit_params(root / "params.yaml", VARIANTS[name])
        sh(["git", "commit", "-q", "--allow-empty", "-am", f"variant {name}"], root)
        warm = json.loads((root / "metrics/prepare.json").read_text()).get("warmstart_eval_accuracy")
        out.write_text(json.dumps({"name": name, "params": VARIANTS[name], "warm_start_accuracy": warm,
                                   "cache_bytes_before": tree_bytes(root / ".dvc/cache"), "rows": []}) + "\n")
    result = json.loads(out.read_text())
    for _ in range(iterations):
        start = time.time()
        sh(["rlpipe", "run", "-n", "1"], root)
        history = [json.loads(x) for x in (root / "history/iterations.jsonl").read_text().splitlines()]
        result["rows"].append({"iteration": history[-1]["iteration"], "eval_accuracy": history[-1]["eval_accuracy"],
                               "train_accuracy": history[-1]["train_accuracy"], "kl_ref": history[-1]["kl_ref"],
                               "seconds": round(time.time() - start, 1),
                               "checkpoint_bytes": tree_bytes(root / "artifacts/train/checkpoint"),
                               "cache_bytes": tree_bytes(root / ".dvc/cache")})
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(work: Path) -> str:
    results = [json.loads((work / f"{n}.json").read_text()) for n in VARIANTS if (work / f"{n}.json").is_file()]
    results = [r for r in results if r["rows"]]
    lines = ["| variant | params | " + " | ".join(f"it {r['iteration']}" for r in results[0]["rows"])
             + " | checkpoint bytes | DVC cache growth per iteration |", "|---" * (len(results[0]["rows"]) + 4) + "|"]
    for r in results:
        growth = (r["rows"][-1]["cache_bytes"] - r["cache_bytes_before"]) / len(r["rows"])
        lines.append(f"| {r['name']} | {r['params'] or 'defaults'} | "
                     + " | ".join(f"{x['eval_accuracy']:.3f}" for x in r["rows"])
                     + f" | {r['rows'][-1]['checkpoint_bytes']:,} | {growth:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--prepare", action="store_true", help="build the project and run prepare once")
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.prepare:
        shutil.rmtree(work / "prepared", ignore_errors=True)
        root = make_project(work / "prepared", shrink=False)
        sh(["dvc", "repro", "prepare", "train_reward_model"], root)
        sh(["git", "add", "-A"], root)
        sh(["git", "commit", "-qm", "prepared"], root)
    if args.variant:
        print(json.dumps(run_variant(work, args.variant, args.iterations)))
    if args.table:
        print(table(work))


if __name__ == "__main__":
    main()
