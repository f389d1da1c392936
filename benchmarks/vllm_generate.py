"""Generation throughput: bare vLLM against rlpipe's generate path on the same prompts and seeds.

rlpipe's path is what the generate stage does after loading: VLLMEngine.generate (one request per
prompt, n = G, seeded, sampled-token log-probs) + rollout_frame (flatten, decode) + write_artifact
(validate, sort, Parquet). The baseline is LLM.generate on the same LLM with the same sampling
settings written out by hand. Both sample the same tokens (same seeds), so tokens/s compare directly;
the issue's target is rlpipe >= 90% of bare vLLM.

The model is random-weight with Qwen2.5-0.5B's shape as a Llama config (throughput does not depend on
the weights; no download): hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936, tied
embeddings, bf16. Prompts are random token ids; decoding uses a 151,936-entry WordLevel tokenizer
(Rust, as a real tokenizer's decode), so the text column costs what it would in the stage.

Needs a CUDA GPU and vllm (see benchmarks/vllm_generate.md for the device recipe):
    python benchmarks/vllm_generate.py --out bench.json                 # 128 prompts x G=8 x 512 tokens
    python benchmarks/vllm_generate.py --prompts 16 --max-new-tokens 64  # a quick look
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the device carry has no FlashInfer
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}


def build_model(path: Path, max_position_embeddings: int) -> None:
    """Random bf16 Llama of Qwen2.5-0.5B's shape, saved with save_pretrained (on the CPU: CUDA stays untouched)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**QWEN25_05B, max_position_embeddings=max_position_embeddings)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)


def word_level_decoder(vocab_size: int):
    """A Rust tokenizer with one token per id ("t0", "t1", ...): decode costs what a real one does."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    return lambda ids: tokenizer.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="bare / rlpipe pairs, alternated")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compare-logprobs-mode", action="store_true",
                    help="then restart vLLM with its default raw_logprobs mode: bare runs with and without log-probs")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import numpy as np
    import polars as pl

    from rlpipe.data.io import write_artifact
    from rlpipe.data.schema import ROLLOUTS
    from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
    from rlpipe.engines.vllm import VLLMEngine, vllm_seed
    from rlpipe.stages.generate import rollout_frame

    work = Path(tempfile.mkdtemp(prefix="vllm_bench_"))
    max_len = args.prompt_len + args.max_new_tokens + 16
    t0 = time.perf_counter()
    build_model(work / "model", max_position_embeddings=max(4096, max_len))
    build_s = time.perf_counter() - t0
    eos = QWEN25_05B["eos_token_id"]
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(0, 151_000, size=(args.prompts, args.prompt_len)).tolist()  # below the special ids
    requests = [PromptRequest(prompt_token_ids=tuple(p), seed=derive_seed(0, i), n=args.group_size)
                for i, p in enumerate(prompt_ids)]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    prompts_frame = pl.DataFrame({"prompt_id": pl.Series(range(args.prompts), dtype=pl.Int64),
                                  "prompt_token_ids": prompt_ids})
    decode = word_level_decoder(QWEN25_05B["vocab_size"])

    t0 = time.perf_counter()
    engine = VLLMEngine(work / "model", dtype="bfloat16", eos_token_ids=[eos],
                        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=True,
                        enforce_eager=args.enforce_eager, max_model_len=max_len)
    init_s = time.perf_counter() - t0
    replica = engine._replicas[0]  # the same LLM serves the bare runs
    vllm, llm = replica._vllm, replica._llm

    def bare(seeded: bool, llm=llm, logprobs: int | None = 0) -> dict:
        """LLM.generate with the settings spelled out by hand (seeded: exactly what rlpipe asks for)."""
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        extra = {"stop_token_ids": [eos], "detokenize": False}
        if seeded:
            sampling = [vllm.SamplingParams(n=r.n, seed=vllm_seed(r.seed), temperature=1.0, top_p=1.0, top_k=-1,
                                            max_tokens=args.max_new_tokens, logprobs=logprobs, flat_logprobs=True,
                                            **extra)
                        for r in requests]
        else:  # what one would write without rlpipe's needs: no seeds, default log-prob layout
            sampling = [vllm.SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_new_tokens,
                                            logprobs=0, **extra)] * len(requests)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(o.token_ids) for r in outputs for o in sorted(r.outputs, key=lambda o: o.index)]
        return {"seconds": seconds, "tokens": sum(map(len, tokens)), "token_ids": tokens}

    def rlpipe_path() -> dict:
        t0 = time.perf_counter()
        groups = engine.generate(requests, params)
        t1 = time.perf_counter()
        frame = rollout_frame(prompts_frame, requests, groups, policy_version=0, decode=decode)
        t2 = time.perf_counter()
        write_artifact(frame, work / "rollouts.parquet", ROLLOUTS, metadata={"engine": engine.name})
        t3 = time.perf_counter()
        return {"seconds": t3 - t0, "generate_s": t1 - t0, "frame_s": t2 - t1, "write_s": t3 - t2,
                "tokens": int(frame["completion_length"].sum()),
                "token_ids": [c.token_ids for g in groups for c in g]}

    # Warm-up on other prompts: CUDA graphs, allocator, the first sampler kernels.
    warm = [PromptRequest(prompt_token_ids=tuple(range(10, 10 + args.prompt_len)), seed=i, n=args.group_size)
            for i in range(8)]
    engine.generate(warm, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=32))

    runs: list[tuple[str, dict]] = []
    for _ in range(args.repeats):
        runs.append(("bare_vllm", bare(seeded=True)))
        runs.append(("rlpipe", rlpipe_path()))
    runs.append(("bare_vllm_unseeded", bare(seeded=False)))
    same_tokens = [sum(a == b for a, b in zip(r["token_ids"], runs[0][1]["token_ids"])) for _, r in runs]
    engine.close()
    if args.compare_logprobs_mode:  # the cost of rlpipe's processed_logprobs against vLLM's default mode
        raw_llm = vllm.LLM(**{**engine.llm_kwargs, "logprobs_mode": "raw_logprobs"})
        bare(seeded=True, llm=raw_llm)  # first pass: prompt prefills, as the main runs had before theirs
        runs.append(("bare_vllm_raw_logprobs", bare(seeded=True, llm=raw_llm)))
        runs.append(("bare_vllm_no_logprobs", bare(seeded=True, llm=raw_llm, logprobs=None)))
        raw_llm.llm_engine.engine_core.shutdown()

    import torch
    import transformers

    def rate(name: str) -> float:
        picked = [r for n, r in runs if n == name]
        return sum(r["tokens"] for r in picked) / sum(r["seconds"] for r in picked)

    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),  # only now: CUDA untouched in this process before vLLM started
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "polars": pl.__version__},
        "setup": {"model": "Llama config of Qwen2.5-0.5B's shape, random bf16 weights", "prompts": args.prompts,
                  "group_size": args.group_size, "prompt_len": args.prompt_len,
                  "max_new_tokens": args.max_new_tokens, "enforce_eager": args.enforce_eager,
                  "gpu_memory_utilization": args.gpu_memory_utilization, "prefix_caching": True,
                  "logprobs": "sampled token (logprobs=0), processed_logprobs"},
        "build_model_s": round(build_s, 1), "engine_init_s": round(init_s, 1),
        "runs": [{"path": n, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "token_ids"}}
                 for n, r in runs],
        "tokens_per_s": {name: round(rate(name)) for name in dict(runs)},
        # Samples (of prompts x G) whose tokens equal the first run's: vLLM is not bitwise reproducible from
        # run to run (float noise flips a few samples of this near-uniform random model), see the .md.
        "samples_equal_to_first_run": same_tokens[:2 * args.repeats],
    }
    result["rlpipe_share_of_bare"] = round(result["tokens_per_s"]["rlpipe"] / result["tokens_per_s"]["bare_vllm"], 3)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
