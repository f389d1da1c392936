"""vLLM generation through a LoRA adapter (rlpipe's path: base + LoRARequest) against the same adapter merged.

The model is vllm_generate.py's random-weight Llama of Qwen2.5-0.5B's shape (bf16); the adapter is rank R
on all linear layers with random B (so it changes the outputs), saved as train saves it, and merged with
`rlpipe export --merge`'s code. Each engine samples the same prompts and seeds; tokens/s compare the decode
cost of an unmerged adapter. The mean sampled-token log-prob of each is printed beside (they sample from
the same distribution up to bf16 rounding of the merge).

Needs a CUDA GPU and vllm; nothing touches CUDA before vLLM starts (the model, adapter and merge are built
on the CPU):
    python benchmarks/lora_vllm.py --rank 16 --out lora_vllm.json            # 128 prompts x 8 x 512 tokens
    python benchmarks/lora_vllm.py --prompts 16 --max-new-tokens 64           # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.vllm_generate import QWEN25_05B, build_model  # noqa: E402  (sets vLLM's env defaults too)


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer with one token per id ("t0", "t1", ...), saved beside the base (export copies it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(QWEN25_05B["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token=f"t{QWEN25_05B['eos_token_id']}", pad_token=f"t{QWEN25_05B['pad_token_id']}")
    tok.save_pretrained(path)


def build_adapter(work: Path, rank: int) -> None:
    """A rank-``rank`` all-linear adapter with random B over work/base, saved as train saves one, and merged."""
    import torch

    from rlpipe.config import LoraConfig
    from rlpipe.models.loading import load_model
    from rlpipe.models.lora.adapter import model_hash
    from rlpipe.models.lora.export import export_merged
    from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training

    lora = LoraConfig(rank=rank, alpha=32.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                      train_embeddings=False)
    peft_model = wrap_for_training(load_model(work / "base", device="cpu", dtype="float32"), lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    save_adapter(peft_model, work / "adapter", policy_version=1, base_path=work / "base",
                 base_hash=model_hash(work / "base"))
    export_merged(work / "adapter", work / "merged")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import numpy as np

    from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
    from rlpipe.engines.vllm import VLLMEngine

    work = Path(tempfile.mkdtemp(prefix="lora_vllm_"))
    max_len = args.prompt_len + args.max_new_tokens + 16
    build_model(work / "base", max_position_embeddings=max(4096, max_len))
    save_tokenizer(work / "base")
    build_adapter(work, args.rank)
    eos = QWEN25_05B["eos_token_id"]
    rng = np.random.default_rng(0)
    requests = [PromptRequest(tuple(rng.integers(0, 151_000, size=args.prompt_len).tolist()), seed=derive_seed(0, i),
                              n=args.group_size) for i in range(args.prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    results = {}
    for name in ("adapter", "merged"):
        adapter = name == "adapter"
        t0 = time.perf_counter()
        engine = VLLMEngine(work / ("base" if adapter else "merged"), dtype="bfloat16", eos_token_ids=[eos],
                            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_len,
                            max_lora_rank=args.rank if adapter else None)
        if adapter:
            engine.use_adapter(work / "adapter")
        start_s = time.perf_counter() - t0
        engine.generate(requests[:2], params)  # warm-up (and the adapter's first load)
        t0 = time.perf_counter()
        groups = engine.generate(requests, params)
        seconds = time.perf_counter() - t0
        engine.close()
        logprobs = np.concatenate([c.sampler_logprobs for g in groups for c in g])
        results[name] = {"engine_start_s": round(start_s, 1), "generate_s": round(seconds, 2),
                         "tokens": int(logprobs.size), "tokens_per_s": round(logprobs.size / seconds),
                         "mean_sampled_logprob": float(logprobs.mean())}
        print(name, json.dumps(results[name]), flush=True)
    results["adapter_over_merged_throughput"] = round(results["adapter"]["tokens_per_s"]
                                                      / results["merged"]["tokens_per_s"], 3)
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**results, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1) + "\n")
    os._exit(0)  # vLLM's atexit hooks can stall on closed engines


if __name__ == "__main__":
    main()
