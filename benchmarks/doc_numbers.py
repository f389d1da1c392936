"""The measured learning curves in README.md, BENCHMARKS.md and docs/*.md, written from the results file.

Why: the same run's accuracy used to be copied by hand into several tables, and the copies drifted
apart (issue 15). Now each number sits in a marked block and comes from one file,
``benchmarks/results/algorithm_curves.json`` (`benchmarks/algorithm_curves.py --json` merges each run into it):

    <!-- generated: curve grpo warm -->        a run's per-iteration table (warm: with the warm-start row;
                                               critic: with the value loss and explained variance)
    <!-- generated: accuracies grpo dr_grpo --> held-out accuracy after each iteration, one row per run
    <!-- generated: multiturn NAME [turns] -->  a multi-turn run's table (benchmarks/multi_turn_curve.py):
                                               accuracy and tool use, held-out and sampled (turns: mean turns)
    <!-- generated: overlap FILE [last] -->     held-out accuracy per iteration for each staleness S, mean
                                               (seeds' range), from benchmarks/overlap_curves.py's FILE in
                                               benchmarks/results/ (last: the last iteration only)
    <!-- /generated -->                         (the table between the two markers is replaced)
    <!-- value: grpo 4 -->0.906<!-- /value -->  one number: a run, an iteration (or warm, or gain), a history key

    python benchmarks/doc_numbers.py            # rewrite the blocks from the results
    python benchmarks/doc_numbers.py --check    # exit 1 naming every block that disagrees (tests/test_docs.py)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "algorithm_curves.json"
BLOCK = re.compile(r"<!-- generated: (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- /generated -->", re.S)
VALUE = re.compile(r"<!-- value: (?P<spec>[^>]*?) -->(?P<body>[^<]*)<!-- /value -->")
CURVE_COLUMNS = (("eval_accuracy", "held-out accuracy after"), ("train_reward_mean", "train reward (mean)"),
                 ("train_accuracy", "train sample accuracy"), ("kl_ref", "KL to ref (k3)"),
                 ("clip_fraction", "clip fraction"))
CRITIC_COLUMNS = (("value_loss", "value loss"), ("explained_variance", "explained variance"))
MULTI_TURN_COLUMNS = (("eval_accuracy", "held-out accuracy after"), ("eval_tool_use_rate", "held-out tool use after"),
                      ("train_accuracy", "train sample accuracy"), ("train_tool_use_rate", "sampled tool use"))
LABELS = {  # how the docs name the runs of benchmarks/algorithm_curves.py
    "grpo": "GRPO", "dr_grpo": "Dr.GRPO", "dapo": "DAPO-style", "rloo": "RLOO", "gspo": "GSPO", "ppo": "PPO (GAE)",
    "reinforce_plus_plus": "REINFORCE++", "deepseek_v32": "DeepSeek-V3.2 corrections",
    "ppo_reward_model": "PPO against the reward model", "top_p_keep_mask": "top-p 0.9, keep sampling mask",
    "top_p_full_softmax": "top-p 0.9, full softmax", "cispo": "CISPO", "sapo": "SAPO", "gmpo": "GMPO",
    "token_sum": "token-sum", "reinforce_pp_baseline": "REINFORCE++-baseline", "grpo_passk": "GRPO pass@k",
    "gdpo": "GDPO", "normalize_then_sum": "normalize_then_sum", "batch_std": "batch std", "ratio_cap": "ratio cap 4.0",
    "high_entropy_80_20": "80/20 high-entropy tokens",
}


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text())


def _run(results: dict, name: str, where: str) -> dict:
    try:
        return results["runs"][name]
    except KeyError:
        raise SystemExit(f"{where}: no run {name!r} in {RESULTS.relative_to(REPO)}; runs: {sorted(results['runs'])}")


def _fmt(x) -> str:
    return "" if x is None else f"{x:.3f}"


def value(results: dict, spec: str, where: str) -> str:
    """``name iteration|warm|gain [key]`` -> the number, three decimals (gain: points of held-out accuracy
    from the warm start to the last iteration, e.g. +49)."""
    words = spec.split()
    run = _run(results, words[0], where)
    if words[1] == "warm":
        return _fmt(run["warm_start_accuracy"])
    if words[1] == "gain":
        return f"{round(100 * (run['rows'][-1]['eval_accuracy'] - run['warm_start_accuracy'])):+d}"
    row = run["rows"][int(words[1])]
    return _fmt(row[words[2] if len(words) > 2 else "eval_accuracy"])


def block(results: dict, spec: str, where: str) -> str:
    kind, *args = spec.split()
    if kind == "curve":
        run = _run(results, args[0], where)
        columns = CURVE_COLUMNS + (CRITIC_COLUMNS if "critic" in args[1:] else ())
        lines = ["| iteration | " + " | ".join(h for _, h in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        if "warm" in args[1:]:
            lines.append(f"| warm start (prepare) | {_fmt(run['warm_start_accuracy'])} |" + " |" * (len(columns) - 1))
        for row in run["rows"]:
            lines.append(f"| {row['iteration']} | " + " | ".join(_fmt(row[k]) for k, _ in columns) + " |")
        return "\n".join(lines) + "\n"
    if kind == "accuracies":
        runs = [(name, _run(results, name, where)) for name in args]
        n = min(len(r["rows"]) for _, r in runs)  # the iterations every run has
        lines = ["| variant | warm start | " + " | ".join(f"it {i}" for i in range(n)) + " |", "|---" * (n + 2) + "|"]
        for name, r in runs:
            accs = [_fmt(row["eval_accuracy"]) for row in r["rows"][:n]]
            lines.append(f"| {LABELS.get(name, name)} | {_fmt(r['warm_start_accuracy'])} | " + " | ".join(accs) + " |")
        return "\n".join(lines) + "\n"
    if kind == "multiturn":
        run = _run(results, args[0], where)
        columns = MULTI_TURN_COLUMNS + ((("turns_mean", "turns (mean)"),) if "turns" in args[1:] else ())
        lines = ["| iteration | " + " | ".join(h for _, h in columns) + " |", "|---" * (len(columns) + 1) + "|",
                 f"| warm start (prepare) | {_fmt(run['warm_start_accuracy'])} | "
                 f"{_fmt(run['warm_start_tool_use_rate'])} |" + " |" * (len(columns) - 2)]
        for row in run["rows"]:
            cells = [f"{row[k]:.2f}" if k == "turns_mean" else _fmt(row[k]) for k, _ in columns]
            lines.append(f"| {row['iteration']} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"
    if kind == "overlap":
        return overlap_table(args[0], last="last" in args[1:], where=where)
    raise SystemExit(f"{where}: unknown generated block {kind!r} (curve, accuracies, multiturn, overlap)")


def _mean_and_range(row: dict) -> str:
    return f"{_fmt(row['eval_accuracy_mean'])} ({_fmt(row['eval_accuracy_min'])}-{_fmt(row['eval_accuracy_max'])})"


def overlap_table(name: str, *, last: bool, where: str) -> str:
    """benchmarks/overlap_curves.py's summary: a column per S (rows: iterations), or with ``last`` a row per S."""
    path = RESULTS.parent / name
    if not path.is_file():
        raise SystemExit(f"{where}: no overlap results {path.relative_to(REPO)}")
    summary = json.loads(path.read_text())["summary"]  # {"S=0": [{iteration, eval_accuracy_mean/_min/_max}, ...]}
    keys = sorted(summary, key=lambda k: int(k.split("=")[1]), reverse=True)
    if last:
        n = min(len(summary[k]) for k in keys) - 1
        lines = [f"| S | held-out accuracy after iteration {n} |", "|---|---|"]
        return "\n".join(lines + [f"| {k.split('=')[1]} | {_mean_and_range(summary[k][n])} |" for k in keys]) + "\n"
    lines = ["| iteration | " + " | ".join(f"S = {k.split('=')[1]}" for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for i in range(min(len(summary[k]) for k in keys)):
        lines.append(f"| {i} | " + " | ".join(_mean_and_range(summary[k][i]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def render(text: str, results: dict, where: str) -> str:
    text = BLOCK.sub(lambda m: f"<!-- generated: {m['spec']} -->\n{block(results, m['spec'], where)}<!-- /generated -->",
                     text)
    return VALUE.sub(lambda m: f"<!-- value: {m['spec']} -->{value(results, m['spec'], where)}<!-- /value -->", text)


def documents(root: Path = REPO) -> list[Path]:
    return [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]


def stale(root: Path = REPO, results: dict | None = None) -> list[str]:
    """The documents whose marked numbers differ from the results (empty: all agree)."""
    results = load() if results is None else results
    out = []
    for path in documents(root):
        text = path.read_text()
        if render(text, results, str(path)) != text:
            out.append(str(path.relative_to(root)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a document disagrees")
    args = ap.parse_args()
    results = load()
    if args.check:
        bad = stale(REPO, results)
        if bad:
            print("out of date with " + str(RESULTS.relative_to(REPO)) + ": " + ", ".join(bad) +
                  "\nrun: python benchmarks/doc_numbers.py", file=sys.stderr)
            raise SystemExit(1)
        return
    for path in documents():
        text = path.read_text()
        new = render(text, results, str(path))
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
