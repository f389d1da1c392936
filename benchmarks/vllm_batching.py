"""What bounds vLLM's decoding of the small shapes (issue 35): concurrency and per-request seeds, side by side.

    python benchmarks/vllm_batching.py build WORK                  # random-weight 0.5B and 1.5B shapes
    python benchmarks/vllm_batching.py sweep WORK OUT.jsonl [0.5b,1.5b]   # each engine in its own process

Why: on one H200 vLLM decoded the 1.5B shape as fast as the 0.5B one (~22k completion tokens/s for 4,096 x 512,
BENCHMARKS.md, fixed cost), so generation is bound by something other than the model's FLOPs. Two suspects, measured
here with the request rlpipe's vLLM engine makes (token-id prompts, one sampled log-prob per token, no tokenizer in
the engine): the number of sequences vLLM decodes at once (``max_num_seqs``, vLLM's default when rlpipe sets none),
and a seed per request (rlpipe seeds every prompt's samples for reproducibility; vLLM then draws each request's
noise from its own generator). Each cell: one engine, one warm-up call, then the timed call of PROMPTS prompts x
SAMPLES samples x NEW_TOKENS tokens (``ignore_eos``: every sample has exactly NEW_TOKENS tokens).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 256, 8, 128, 512


def build(work: Path) -> None:
    from fixed_cost import build_model

    for shape in ("0.5b", "1.5b"):
        build_model(work / shape, shape, PROMPT_TOKENS + NEW_TOKENS + 64)


def cell(work: Path, shape: str, max_num_seqs: int | None, seeds: list[bool]) -> list[dict]:
    """One engine; a timed generate call per entry of ``seeds`` (after one untimed warm-up call)."""
    import random

    import vllm

    kwargs = dict(model=str(work / shape), dtype="bfloat16", gpu_memory_utilization=0.85, enable_prefix_caching=True,
                  max_model_len=PROMPT_TOKENS + NEW_TOKENS + 64, seed=0, skip_tokenizer_init=True,
                  generation_config="vllm", logprobs_mode="processed_logprobs")
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    start = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [vllm.TokensPrompt(prompt_token_ids=[rng.randrange(1000, 150000) for _ in range(PROMPT_TOKENS)])
               for _ in range(PROMPTS)]

    def params(i: int, seeded: bool):
        return vllm.SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                                   ignore_eos=True, logprobs=0, detokenize=False, seed=i if seeded else None)

    llm.generate(prompts[:64], [params(i, True) for i in range(64)], use_tqdm=False)  # warm-up
    rows = []
    for seeded in seeds:
        t = time.perf_counter()
        out = llm.generate(prompts, [params(i, seeded) for i in range(PROMPTS)], use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for r in out for o in r.outputs)
        rows.append({"shape": shape, "max_num_seqs": max_num_seqs or "vllm default",
                     "effective_max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
                     "seeded": seeded, "tokens": tokens, "seconds": round(seconds, 2),
                     "tokens_per_s": round(tokens / seconds), "engine_start_s": round(start, 1),
                     "vllm": vllm.__version__})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep(work: Path, out: Path, shapes: list[str]) -> None:
    """Each (shape, max_num_seqs) engine in a fresh process (vLLM frees a GPU only at exit), both seed settings."""
    for shape in shapes:
        for max_num_seqs in (None, 1024):
            cmd = [sys.executable, __file__, "cell", str(work), shape, str(max_num_seqs or 0)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            with out.open("a") as fh:
                for line in lines:
                    fh.write(line + "\n")
            if proc.returncode:
                with out.open("a") as fh:
                    fh.write(json.dumps({"shape": shape, "max_num_seqs": max_num_seqs, "error": proc.stderr[-2000:]})
                             + "\n")


if __name__ == "__main__":
    command, work = sys.argv[1], Path(sys.argv[2])
    if command == "build":
        build(work)
    elif command == "sweep":
        sweep(work, Path(sys.argv[3]), sys.argv[4].split(",") if len(sys.argv) > 4 else ["0.5b", "1.5b"])
    elif command == "cell":
        cell(work, sys.argv[3], int(sys.argv[4]) or None, [True, False])
    else:
        raise SystemExit(__doc__)
