"""`generate.vllm.engines_per_gpu` end to end (issue 35): rlpipe's VLLMEngine started, then asked for the
generate stage's workload, with one engine and with K engines sharing one GPU.

    python benchmarks/engines_per_gpu.py build WORK [0.5b]              # random-weight shape (fixed_cost.py)
    python benchmarks/engines_per_gpu.py run WORK 0.5b K --out R.jsonl  # one line per run, fresh process each

Why end to end: benchmarks/vllm_decode_bound.py timed decoding alone (4 engines: 4.6-4.8x one engine's tokens/s),
but a stage also pays each engine's start, and engines that share a GPU start one after another (their memory
profiles would otherwise see each other). What a user gets per iteration is start (once per run with the warm
engine server, every iteration without it) plus generation: both are reported. The workload is fixed_cost.py's:
PROMPTS prompts x GROUP samples x NEW_TOKENS tokens, 64-token prompts, seeded requests with sampled log-probs,
CUDA graphs on. With random weights EOS is almost never drawn, so every sample has NEW_TOKENS tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
PROMPT_TOKENS = 64


def run(work: Path, shape: str, engines: int, prompts: int, group: int, new_tokens: int, memory: float) -> dict:
    from fixed_cost import EOS, VOCAB

    from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
    from rlpipe.engines.vllm import VLLMEngine

    rng = random.Random(0)
    requests = [PromptRequest(tuple(rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)), seed=derive_seed(0, i), n=group)
                for i in range(prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    engine = VLLMEngine(work / shape, dtype="bfloat16", eos_token_ids=[EOS], engines_per_gpu=engines,
                        gpu_memory_utilization=memory, enable_prefix_caching=True,
                        max_model_len=PROMPT_TOKENS + new_tokens + 64)
    started = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        groups = engine.generate(requests, params)
        generated = time.perf_counter() - t1
    finally:
        engine.close()
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    return {"shape": shape, "engines_per_gpu": engines, "prompts": prompts, "group": group, "new_tokens": new_tokens,
            "gpu_memory_utilization": memory, "start_s": round(started, 2), "generate_s": round(generated, 2),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / generated), "first_sample": groups[0][0].token_ids[:8]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("build", "run"))
    ap.add_argument("work", type=Path)
    ap.add_argument("shape", nargs="?", default="0.5b")
    ap.add_argument("engines", nargs="?", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--memory", type=float, default=0.85, help="gpu_memory_utilization of all the engines together")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.command == "build":
        from fixed_cost import build_model

        if not (args.work / args.shape / "config.json").exists():
            build_model(args.work / args.shape, args.shape, PROMPT_TOKENS + args.new_tokens + 64)
        return
    result = run(args.work, args.shape, args.engines, args.prompts, args.group, args.new_tokens, args.memory)
    import torch

    result.update(card=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d"))
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
