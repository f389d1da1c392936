"""Learning curve of the embedded multi-turn task (the calculator), through the real pipeline.

Copies the project into a scratch directory, switches it to the calculator task (`CALCULATOR`, the
settings docs/multi-turn.md lists) and runs `rlpipe run -n N` (dvc repro + rlpipe iterate per
iteration). Per iteration it reads the committed metrics: held-out greedy accuracy and tool-use rate
(evaluate), train sample accuracy (score) and the sampled tool-use rate, turns and finish reasons
(generate). The table it prints is the one in README.md and docs/multi-turn.md.

    python benchmarks/multi_turn_curve.py --iterations 6
    python benchmarks/multi_turn_curve.py --iterations 6 --workdir /tmp/curve --json curve.json \
        --results benchmarks/results/algorithm_curves.json   # the docs' tables (benchmarks/doc_numbers.py)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.algorithm_curves import merge_results, sh  # noqa: E402
from tests.e2e.conftest import make_project, metrics_at  # noqa: E402  (a stage's metrics at a tag, through DVC)
from tests.e2e.test_multi_turn import CALCULATOR  # noqa: E402  (the same settings the e2e test runs)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--results", default=None, help="also merge the run, as multi_turn_calculator, into this "
                        "results file (benchmarks/results/algorithm_curves.json: README.md and docs/multi-turn.md "
                        "take their table from it)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rlpipe-multi-turn-"))
    root = work / "calculator"
    if not root.exists():
        root.mkdir(parents=True)
        make_project(root, CALCULATOR, shrink=False)
    started = time.time()
    sh(["rlpipe", "run", "-n", str(args.iterations)], root)
    seconds = (time.time() - started) / args.iterations
    prepare = metrics_at(root, "iteration-0", "prepare")
    rows = []
    for k in range(args.iterations):
        tag = f"iteration-{k}"
        g, s, e = (metrics_at(root, tag, stage) for stage in ("generate", "score", "evaluate"))
        rows.append({"iteration": k, "eval_accuracy": e["accuracy"], "eval_tool_use_rate": e["tool_use_rate"],
                     "train_accuracy": s["accuracy"], "train_tool_use_rate": g["tool_use_rate"],
                     "turns_mean": g["turns_mean"], "finish_reasons": g["finish_reasons"],
                     "tool_call_status": g["tool_call_status"]})
    print(f"warm start: held-out accuracy {prepare['warmstart_eval_accuracy']:.3f}, "
          f"tool use {prepare['warmstart_eval_tool_use_rate']:.3f}")
    print("| iteration | held-out accuracy after | held-out tool use after | train sample accuracy | "
          "sampled tool use | turns (mean) |")
    print("|---|---|---|---|---|---|")
    print(f"| warm start (prepare) | {prepare['warmstart_eval_accuracy']:.3f} | "
          f"{prepare['warmstart_eval_tool_use_rate']:.3f} | | | |")
    for r in rows:
        print(f"| {r['iteration']} | {r['eval_accuracy']:.3f} | {r['eval_tool_use_rate']:.3f} | "
              f"{r['train_accuracy']:.3f} | {r['train_tool_use_rate']:.3f} | {r['turns_mean']:.2f} |")
    print(f"{seconds:.0f} s per iteration (dvc repro + rlpipe iterate)")
    if args.json:
        Path(args.json).write_text(json.dumps({"warm_start": prepare, "rows": rows,
                                               "seconds_per_iteration": seconds}, indent=2))
    if args.results:
        run = {"name": "multi_turn_calculator", "warm_start_accuracy": prepare["warmstart_eval_accuracy"],
               "warm_start_tool_use_rate": prepare["warmstart_eval_tool_use_rate"], "rows": rows,
               "seconds_per_iteration": seconds}
        merge_results(Path(args.results), [run], iterations=args.iterations,
                      command=f"python benchmarks/multi_turn_curve.py --iterations {args.iterations}")


if __name__ == "__main__":
    main()
