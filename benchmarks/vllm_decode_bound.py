"""What bounds vLLM's decoding of the small shapes (issue 35), measured cell by cell on one GPU.

    python benchmarks/vllm_decode_bound.py build WORK [0.5b,1.5b]     # random-weight shapes (fixed_cost.py)
    python benchmarks/vllm_decode_bound.py cell WORK SHAPE CONFIG_JSON  # one engine in this process
    python benchmarks/vllm_decode_bound.py engines WORK SHAPE CONFIG_JSON  # K engines sharing the GPU at once

Why: vLLM decoded the 1.5B shape nearly as fast as the 0.5B one (BENCHMARKS.md): about 60 ms per step of 1,024
sequences, far above what the model's FLOPs or its weight and KV reads need on an H200. A cell answers one question:
does a request option cost time (rlpipe's request: token-id prompts, one sampled log-prob per token, a seed per
prompt, against a bare request with neither), does an engine option change it (``max_num_seqs``, CUDA graphs for
batches above vLLM's default capture limit of 512, async scheduling), and is the GPU busy (torch profiler: CUDA
time of a window of steps against its wall time). ``pair`` runs two engines on the one GPU, each with half the
sequences, started one after the other and timed together: if the pair decodes ~2x one engine's tokens/s, the
bound is each engine's host-side step, not the GPU.

Each timed call: PROMPTS prompts x SAMPLES samples x NEW_TOKENS tokens (``ignore_eos``), all sequences in one wave,
so the wall time over NEW_TOKENS is the time of one decoding step.
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

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 128, 8, 128, 512
# The request rlpipe's vLLM engine makes, and the bare one: the difference is what rlpipe adds.
REQUESTS = {"rlpipe": {"logprobs": 0, "seeded": True, "flat": True}, "rlpipe, dict log-probs": {"logprobs": 0, "seeded": True},
            "log-probs only": {"logprobs": 0, "seeded": False, "flat": True}, "bare": {"logprobs": None, "seeded": False}}


def build(work: Path, shapes: list[str]) -> None:
    from fixed_cost import build_model

    for shape in shapes:
        if not (work / shape / "config.json").exists():
            build_model(work / shape, shape, PROMPT_TOKENS + NEW_TOKENS + 64)


def engine(work: Path, shape: str, config: dict):
    import vllm

    kwargs = {"model": str(work / shape), "dtype": "bfloat16", "gpu_memory_utilization": config.get("memory", 0.85),
                  "enable_prefix_caching": True, "max_model_len": PROMPT_TOKENS + NEW_TOKENS + 64, "seed": 0,
                  "skip_tokenizer_init": True, "generation_config": "vllm", "logprobs_mode": "processed_logprobs"}
    kwargs.update(config.get("engine", {}))
    if config.get("profile"):
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(work / "profile"),
                                     "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
                                     "ignore_frontend": True, "delay_iterations": 100, "max_iterations": 40}
    return vllm.LLM(**kwargs)


def timed_generate(llm, request: str, prompts: int) -> dict:
    import random

    import vllm

    rng = random.Random(0)
    token_prompts = [vllm.TokensPrompt(prompt_token_ids=[rng.randrange(1000, 150000) for _ in range(PROMPT_TOKENS)])
                     for _ in range(prompts)]
    spec = REQUESTS[request]
    params = [vllm.SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                                  ignore_eos=True, logprobs=spec["logprobs"], flat_logprobs=spec.get("flat", False),
                                  detokenize=False,
                                  seed=i if spec["seeded"] else None) for i in range(prompts)]
    start = time.time()
    out = llm.generate(token_prompts, params, use_tqdm=False)
    end = time.time()
    tokens = sum(len(o.token_ids) for r in out for o in r.outputs)
    return {"request": request, "tokens": tokens, "seconds": round(end - start, 2),
            "tokens_per_s": round(tokens / (end - start)), "ms_per_step": round(1000 * (end - start) / NEW_TOKENS, 2),
            "start": start, "end": end}


def cell(work: Path, shape: str, config: dict) -> None:
    import vllm

    t0 = time.perf_counter()
    llm = engine(work, shape, config)
    engine_s = time.perf_counter() - t0
    prompts = config.get("prompts", PROMPTS)
    timed_generate(llm, "rlpipe", 16)  # warm-up
    sched = llm.llm_engine.vllm_config.scheduler_config
    comp = llm.llm_engine.vllm_config.compilation_config
    base = {"shape": shape, "config": config.get("name", ""), "vllm": vllm.__version__, "engine_start_s": round(engine_s, 1),
            "max_num_seqs": sched.max_num_seqs, "async_scheduling": sched.async_scheduling,
            "max_cudagraph_capture_size": comp.max_cudagraph_capture_size}
    barrier = config.get("barrier")
    if barrier:  # pair mode: say we are ready, wait for the other engine
        Path(barrier[0]).touch()
        while not Path(barrier[1]).exists():
            time.sleep(0.05)
    for request in config.get("requests", ["rlpipe"]):
        print(json.dumps({**base, **timed_generate(llm, request, prompts)}), flush=True)
    if config.get("profile"):
        llm.start_profile()
        row = timed_generate(llm, "rlpipe", prompts)
        llm.stop_profile()
        print(json.dumps({**base, **row, "profiled": True}), flush=True)
        time.sleep(5)
        for table in sorted((work / "profile").glob("*.txt")):
            print(f"--- {table.name}\n" + "\n".join(table.read_text().splitlines()[:45]), flush=True)


def engines(work: Path, shape: str, config: dict) -> None:
    """K engines on one GPU, 1/K of the prompts each, started one after the other, timed together."""
    k = config.get("engines", 2)
    ready = [work / f"ready{i}" for i in range(k)]
    go = work / "go"
    for path in (*ready, go):
        path.unlink(missing_ok=True)
    procs = []
    for i in range(k):
        cfg = {**config, "memory": 0.85 / k, "prompts": config.get("prompts", PROMPTS) // k,
               "barrier": [str(ready[i]), str(go)]}
        procs.append(subprocess.Popen([sys.executable, __file__, "cell", str(work), shape, json.dumps(cfg)],
                                      stdout=subprocess.PIPE, text=True))
        while not ready[i].exists() and procs[i].poll() is None:
            time.sleep(0.2)
    go.touch()
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row), flush=True)
    for request in config.get("requests", ["rlpipe"]):
        both = [r for r in rows if r["request"] == request]
        if len(both) == k:
            seconds = max(r["end"] for r in both) - min(r["start"] for r in both)
            tokens = sum(r["tokens"] for r in both)
            print(json.dumps({"shape": shape, "config": f"{k} engines", "request": request, "tokens": tokens,
                              "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds)}), flush=True)


if __name__ == "__main__":
    command, work = sys.argv[1], Path(sys.argv[2])
    if command == "build":
        build(work, sys.argv[3].split(",") if len(sys.argv) > 3 else ["0.5b", "1.5b"])
    elif command in ("cell", "engines"):
        (cell if command == "cell" else engines)(work, sys.argv[3], json.loads(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
