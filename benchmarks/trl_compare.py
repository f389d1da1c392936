"""rlpipe against TRL's GRPOTrainer on the CPU: the same work, wall time side by side, learning compared.

Issue 12's CPU goal: `rlpipe run` over N iterations within 1.3x the wall time of one TRL process doing
the same work. Both sides here start from the same warm-started model directory (prepare's output of
the embedded default) and train N iterations of GRPO, each on the same 512 prompts in the same order
(rlpipe's own seeded draw for that iteration), G = 8 samples, 5 new tokens at temperature 1, the same
two rewards and weights (exact_answer 1.0, digit_match 0.5, rlpipe's functions called from TRL),
lr 1e-4 constant, AdamW without weight decay, clip 0.2, no KL term, per-sequence token mean, and
32 optimizer steps of 256 completions per iteration (TRL: steps_per_generation 16, num_iterations 2).
The runs alternate (rlpipe, TRL, TRL, rlpipe, ...), each a fresh process timed from its start, one
torch thread each. TRL's checkpoints after each iteration are scored by rlpipe's evaluate stage on the
held-out prompts, as rlpipe's own are.

What cannot match, listed in the report: TRL adds 1e-4 to the group std (rlpipe's default profile
1e-6; `profile: trl` matches it), samples with HF `generate` (rlpipe: its own decoding loop), and
shuffles each generation batch with its own RNG.

TRL is a benchmark-only dependency: install it beside rlpipe in a separate environment, e.g.
    python -m venv /tmp/bench && /tmp/bench/bin/pip install torch==2.13.0 && \
        /tmp/bench/bin/pip install -e '.[dev]' trl==1.16.0
    /tmp/bench/bin/python benchmarks/trl_compare.py --prepared PROJECT --iterations 3 --repeats 2 \
        --workdir /tmp/trl_compare --out trl_compare.json
PROJECT is any project whose artifacts/prepare holds the embedded default's warm start (`dvc repro prepare`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
STEPS_PER_ITERATION = 32


def selected_prompts(prepared: Path, iterations: int) -> list[dict]:
    """Every iteration's prompts as rlpipe's generate stage draws them, iteration after iteration."""
    from rlpipe.config import load_params
    from rlpipe.data.io import read_artifact
    from rlpipe.data.schema import PROMPTS
    from rlpipe.stages.generate import select_prompts

    p = load_params(REPO / "params.yaml")
    table = read_artifact(prepared / "artifacts/prepare/train_prompts.parquet", PROMPTS).frame
    rows = []
    for k in range(iterations):
        chosen = select_prompts(table, count=p.generate.prompts_per_iteration, seed=p.seed, iteration=k)
        rows += chosen.select("prompt", "answer", "prompt_token_ids").to_dicts()
    return rows


def trl_worker(args) -> None:
    """One TRL process: GRPOTrainer over the iterations' prompts; a checkpoint after each iteration."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlpipe.config import load_params
    from rlpipe.rewards.functions import Sample, digit_match, exact_answer

    torch.set_num_threads(1)
    p = load_params(REPO / "params.yaml")
    rows = selected_prompts(args.prepared, args.iterations)
    model_dir = args.prepared / "artifacts/prepare/model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer(rows[0]["prompt"])["input_ids"] == list(rows[0]["prompt_token_ids"]), "prompt tokens differ"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def sample(prompt: str, completion: str, answer: str) -> Sample:
        return Sample(prompt=prompt, completion=completion, answer=answer, metadata={}, completion_tokens=0,
                      truncated=False)

    def exact(prompts, completions, answer, **_):
        return [exact_answer(sample(p_, c, a), answer_prefix=None, tolerance=0.0, case_sensitive=True)
                for p_, c, a in zip(prompts, completions, answer)]

    def digits(prompts, completions, answer, **_):
        return [digit_match(sample(p_, c, a), answer_prefix=None) for p_, c, a in zip(prompts, completions, answer)]

    t = p.train
    per_step = t.minibatch_size
    completions = p.generate.prompts_per_iteration * p.generate.group_size
    config = GRPOConfig(
        output_dir=str(args.workdir / "trl_out"), use_cpu=True, bf16=False, seed=p.seed, report_to="none",
        save_strategy="no", logging_steps=STEPS_PER_ITERATION, disable_tqdm=True,
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
        steps_per_generation=completions // per_step, num_iterations=t.epochs,
        num_generations=p.generate.group_size, max_completion_length=p.generate.max_new_tokens,
        temperature=p.generate.temperature, top_p=p.generate.top_p, top_k=p.generate.top_k,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, max_grad_norm=t.max_grad_norm,
        beta=0.0, epsilon=t.eps_low, epsilon_high=t.eps_high, loss_type="grpo", scale_rewards="group",
        reward_weights=[1.0, 0.5], shuffle_dataset=False, max_steps=STEPS_PER_ITERATION * args.iterations,
    )

    class SaveEachIteration(TrainerCallback):
        def on_step_end(self, targs, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step % STEPS_PER_ITERATION == 0:
                out = args.workdir / f"trl_iteration_{state.global_step // STEPS_PER_ITERATION - 1}"
                model.save_pretrained(out)
                tokenizer.save_pretrained(out)

    trainer = GRPOTrainer(model=model, reward_funcs=[exact, digits], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[SaveEachIteration()])
    trainer.train()


def evaluate(project: Path, policy: Path, python: str) -> float:
    """Held-out greedy accuracy of a model dir, by rlpipe's own evaluate stage."""
    out = policy.parent / f"{policy.name}_eval"
    out.mkdir(exist_ok=True)
    subprocess.run([python, "stages/evaluate.py", "--params", "params.yaml", "--prompts",
                    "artifacts/prepare/eval_prompts.parquet", "--policy", str(policy), "--out",
                    str(out / "eval.parquet"), "--metrics", str(out / "evaluate.json")],
                   cwd=project, check=True, capture_output=True, env={**os.environ, "RLPIPE_STAGE_SERVER": "off"})
    return json.loads((out / "evaluate.json").read_text())["accuracy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", type=Path, required=True)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.prepared = args.prepared.resolve()
    args.workdir = args.workdir.resolve()
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    if args.trl_worker:
        return trl_worker(args)

    import trl

    from benchmarks.overlap_curves import clone
    from rlpipe.config import load_params

    seed = load_params(REPO / "params.yaml").seed
    judge = clone(args.workdir / "evaluate_project", args.prepared, seed)  # this checkout's params, the same eval set
    runs = []
    for r in range(args.repeats):
        order = ("rlpipe", "trl") if r % 2 == 0 else ("trl", "rlpipe")
        for side in order:
            work = args.workdir / f"{side}_{r}"
            if side == "rlpipe":
                project = clone(work, args.prepared, seed)  # not timed: a finished `dvc repro prepare`
                t0 = time.perf_counter()
                subprocess.run(["rlpipe", "run", "--until", str(args.iterations)], cwd=project, check=True,
                               capture_output=True)
                wall = time.perf_counter() - t0
                history = [json.loads(line) for line in (project / "history/iterations.jsonl").read_text().splitlines()]
                accuracy = [h["eval_accuracy"] for h in history if not h.get("baseline")]  # trained iterations only
            else:
                work.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--trl-worker", "--prepared", str(args.prepared),
                                "--iterations", str(args.iterations), "--workdir", str(work)], check=True,
                               capture_output=True)
                wall = time.perf_counter() - t0
                accuracy = [evaluate(judge, work / f"trl_iteration_{k}", sys.executable)
                            for k in range(args.iterations)]
            runs.append({"side": side, "repeat": r, "wall_s": round(wall, 1), "eval_accuracy": accuracy})
            print(json.dumps(runs[-1]), flush=True)
    walls = {s: [x["wall_s"] for x in runs if x["side"] == s] for s in ("rlpipe", "trl")}
    pairs = [a / b for a, b in zip(walls["rlpipe"], walls["trl"])]
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, 1 torch thread per process",
        "load_average_at_end": os.getloadavg(), "trl": trl.__version__, "iterations": args.iterations,
        "ratio_rlpipe_over_trl": {"per_repeat": [round(x, 2) for x in pairs], "min": round(min(pairs), 2),
                                  "max": round(max(pairs), 2)},
        "differences": ["group std eps: TRL 1e-4, rlpipe default 1e-6", "sampling: HF generate vs rlpipe's loop",
                        "generation-batch shuffling: each side's own RNG"],
        "runs": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("ratio_rlpipe_over_trl", "runs")}, indent=1))


if __name__ == "__main__":
    main()
