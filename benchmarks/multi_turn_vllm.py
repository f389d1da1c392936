"""Multi-turn generation with vLLM: tokens/s of rlpipe's driver against single-turn generation of the same length.

Both runs sample from one vLLM engine (Qwen2.5-0.5B's shape, random bf16 weights, as
benchmarks/vllm_generate.py builds it; no download) through rlpipe's `VLLMEngine`:
  multi-turn  the driver of the generate stage (rlpipe/environments/driver.py): PROMPTS x G rollouts of
              up to MAX_TURNS turns; after each turn an environment answers with OBS_TOKENS tokens (a
              tool message in a ChatML template), and the next turn is one request per rollout whose
              prompt is the whole prefix (prefix caching on), with the turn's own seed;
  single-turn one `generate` call, the same prompts and G, each completion as long as the multi-turn
              rollouts' mean total length (turns + observations), EOS disabled so every sample runs to it.
A random model never samples its EOS from 152k tokens, so for the multi-turn run one token id in
--eos-every also ends a turn (turns are then ~that long, capped at --turn-tokens).
Reported: sampled (policy) tokens/s of each run, their ratio, and the multi-turn run's shape.

On the device machine (one H200; ~3 minutes, most of it vLLM's start):
    python benchmarks/multi_turn_vllm.py --out multi_turn_vllm.json
Plumbing check on a CPU (HF engine, a tiny model with the same tokenizer; no vllm needed):
    python benchmarks/multi_turn_vllm.py --cpu-smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the device carry has no FlashInfer
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_generate import QWEN25_05B, build_model  # noqa: E402
from rlpipe.environments import Environment, Step  # noqa: E402

PAD, START, END = 151643, 151644, 151645  # Qwen2.5's <|endoftext|>, <|im_start|>, <|im_end|>
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chatml_tokenizer(vocab_size: int):
    """A 151,936-entry word-level tokenizer (t0 t1 ...) with Qwen's three special ids and a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    for token, i in (("<|endoftext|>", PAD), ("<|im_start|>", START), ("<|im_end|>", END)):
        del vocab[f"t{i}"]
        vocab[token] = i
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    return tokenizer


class ToolAnswers(Environment):
    """After each turn, a tool message of ``obs_tokens`` words; done after ``turns`` turns."""

    def __init__(self, task, *, turns: int, obs_tokens: int) -> None:
        super().__init__(task)
        self.turns, self.obs_tokens = turns, obs_tokens

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return Step(done=True)
        words = " ".join(f"t{1000 + (self.task.seed + turn.index * 7 + i) % 5000}" for i in range(self.obs_tokens))
        return Step(observation=({"role": "tool", "content": words},))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256, help="max_new_tokens of one turn")
    ap.add_argument("--obs-tokens", type=int, default=32, help="words of each tool message")
    ap.add_argument("--eos-every", type=int, default=128, help="one id in this many also ends a turn")
    ap.add_argument("--max-total-tokens", type=int, default=1536)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--cpu-smoke", action="store_true", help="HF engine, tiny model, tiny sizes: plumbing only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.cpu_smoke:
        args.prompts, args.group_size, args.prompt_len, args.turn_tokens = 4, 2, 8, 16
        args.obs_tokens, args.eos_every, args.max_total_tokens = 4, 8, 96

    import numpy as np
    import polars as pl

    from rlpipe.config import EnvironmentConfig
    from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
    from rlpipe.environments.driver import Driver
    from rlpipe.environments.template import ChatRenderer

    work = Path(tempfile.mkdtemp(prefix="multi_turn_bench_"))
    vocab = QWEN25_05B["vocab_size"]
    tokenizer = chatml_tokenizer(vocab)
    max_len = args.prompt_len + args.max_total_tokens + 64
    t0 = time.perf_counter()
    turn_eos = sorted({END, *range(7, PAD, args.eos_every)})
    if args.cpu_smoke:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from rlpipe.engines.hf import HFEngine

        torch.manual_seed(0)
        small = {**QWEN25_05B, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "intermediate_size": 64}
        engine = HFEngine.from_model(LlamaForCausalLM(LlamaConfig(**small, max_position_embeddings=max_len)).eval(),
                                     batch_size=64, eos_token_ids=turn_eos, pad_token_id=PAD)
        single_engine = HFEngine.from_model(engine.model, batch_size=64, eos_token_ids=[END], pad_token_id=PAD)
    else:
        from rlpipe.engines.vllm import VLLMEngine

        build_model(work / "model", max_position_embeddings=max(4096, max_len))
        engine = VLLMEngine(work / "model", dtype="bfloat16", eos_token_ids=turn_eos,
                            gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=True,
                            max_model_len=max_len)
        single_engine = engine  # one vLLM serves both runs; only the stop ids it passes differ (set_stop_ids)
    startup_s = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    prompt_ids = [[START] + rng.integers(1000, 150_000, size=args.prompt_len - 3).tolist() + [END, START]
                  for _ in range(args.prompts)]
    prompts = pl.DataFrame({"prompt_id": list(range(args.prompts)), "prompt": ["p"] * args.prompts,
                            "prompt_token_ids": prompt_ids, "answer": [None] * args.prompts,
                            "metadata": ["{}"] * args.prompts}, schema_overrides={"answer": pl.String})
    env = EnvironmentConfig(name="bench", options={"turns": args.max_turns, "obs_tokens": args.obs_tokens},
                            max_turns=args.max_turns, max_total_tokens=args.max_total_tokens, tool_timeout_s=60.0,
                            step_timeout_s=120.0, workers=16, prompts_per_chunk=max(1, args.prompts // 2),
                            chunks_in_flight=2)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.turn_tokens)
    renderer = ChatRenderer(tokenizer, eos_token_ids=[END], source="the benchmark's ChatML tokenizer")

    def set_stop_ids(ids) -> None:
        """vLLM: the stop ids its requests carry (the replica's copy of the EOS ids); the HF smoke has two engines."""
        for replica in getattr(engine, "_replicas", []):
            replica._eos = tuple(ids)

    # warm-up: CUDA graphs, allocator, first sampler kernels
    engine.generate([PromptRequest(tuple(prompt_ids[0]), seed=1, n=args.group_size)],
                    SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16))

    set_stop_ids(turn_eos)
    driver = Driver(engine, sampling=sampling, group_size=args.group_size, env=env, env_cls=ToolAnswers,
                    tokenizer=tokenizer, renderer=renderer, eos_token_ids=turn_eos, tokenizer_hash="")
    t0 = time.perf_counter()
    out = driver.run(prompts, [derive_seed(5, i) for i in range(args.prompts)])
    multi_s = time.perf_counter() - t0
    policy_tokens = int(out["policy_mask"].list.sum().sum())
    total_tokens = int(out["completion_length"].sum())
    same_length = max(1, round(total_tokens / out.height))

    set_stop_ids([END])
    requests = [PromptRequest(tuple(p), seed=derive_seed(6, i), n=args.group_size) for i, p in enumerate(prompt_ids)]
    t0 = time.perf_counter()
    groups = single_engine.generate(requests, SamplingParams(temperature=1.0, top_p=1.0, top_k=0,
                                                             max_new_tokens=same_length))
    single_s = time.perf_counter() - t0
    single_tokens = sum(len(c.token_ids) for g in groups for c in g)

    result = {
        "date": datetime.date.today().isoformat(),
        "engine": engine.name,
        "setup": {"model": "cpu smoke: 1-layer Llama, 151,936 vocab" if args.cpu_smoke else
                  "Llama config of Qwen2.5-0.5B's shape, random bf16 weights", "prompts": args.prompts,
                  "group_size": args.group_size, "prompt_len": args.prompt_len, "max_turns": args.max_turns,
                  "turn_tokens": args.turn_tokens, "obs_tokens": args.obs_tokens, "eos_every": args.eos_every,
                  "max_total_tokens": args.max_total_tokens, "prompts_per_chunk": env.prompts_per_chunk,
                  "chunks_in_flight": env.chunks_in_flight, "prefix_caching": True},
        "startup_s": round(startup_s, 1),
        "multi_turn": {"seconds": round(multi_s, 2), "policy_tokens": policy_tokens, "total_tokens": total_tokens,
                       "policy_tokens_per_s": round(policy_tokens / multi_s),
                       "total_tokens_per_s": round(total_tokens / multi_s),  # observations are prefilled, not sampled
                       "turns_mean": round(float(out["num_turns"].mean()), 2),
                       "finish_reasons": {r: int(n) for r, n in
                                          out["finish_reason"].value_counts().sort("finish_reason").iter_rows()}},
        "single_turn": {"seconds": round(single_s, 2), "tokens": single_tokens, "max_new_tokens": same_length,
                        "tokens_per_s": round(single_tokens / single_s)},
    }
    result["multi_turn_share_of_single_turn"] = round(result["multi_turn"]["policy_tokens_per_s"]
                                                      / result["single_turn"]["tokens_per_s"], 3)
    if not args.cpu_smoke:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        engine.close()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
