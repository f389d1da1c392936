"""FSDP2 on N GPUs against one GPU: the same train_policy, the same data, step 1 compared, throughput and memory.

    python benchmarks/fsdp_check.py --out single.json                      # one GPU (or --device cpu)
    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_check.py --out fsdp.json --compare single.json
    (--compile-layers in both: decoder layers compiled before sharding, as the train stage does on CUDA;
    --lora-rank R in both: a rank-R all-linear LoRA adapter trained over the frozen model)

A random-weight Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads / 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings; `--tiny` for a small one to try the script on
CPU), float32 weights, bf16 autocast, fused AdamW. Synthetic iteration: 128 sequences of a
64-token prompt and a 128-1024-token completion, random token ids, a random advantage per
sequence; minibatch 32 (one optimizer step), micro-batch 4 (packed), two epochs: 8 steps
(`--minibatch`, `--micro-batch`, `--sequences` change them). Both runs go
through rlpipe.training.loop.train_policy (the torchrun one with dist=ShardedTraining), so they
share every line but the sharding. Throughput counts the prompt+completion tokens of the last
epoch's steps (the first compiles the fused LM-head kernels, again for each new chunk shape
until torch.compile goes dynamic). Imports no polars (not in the GPU image).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlpipe.config import CriticTrainConfig, LoraConfig, TrainConfig  # noqa: E402
from rlpipe.distributed import finish, start  # noqa: E402
from rlpipe.training.loop import train_policy  # noqa: E402
from rlpipe.training.objective import TrainingData  # noqa: E402

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512)


def build_model(shape: dict, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                         attn_implementation="sdpa")
    torch.manual_seed(0)  # every rank builds the same weights on the CPU; FSDP keeps each rank's shard
    return Qwen2ForCausalLM(config).float().to(device)


def synthetic(vocab: int, n: int, *, tiny: bool) -> TrainingData:
    rng = np.random.default_rng(0)
    lo, hi, prompt = (4, 32, 8) if tiny else (128, 1024, 64)
    prompts = [rng.integers(1, vocab, size=prompt).tolist() for _ in range(n)]
    completions = [rng.integers(1, vocab, size=rng.integers(lo, hi + 1)).tolist() for _ in range(n)]
    adv = rng.normal(size=n).astype(np.float32)
    ref = [rng.normal(-11.0, 0.5, size=len(c)).astype(np.float32) for c in completions]
    return TrainingData(prompts, completions, [np.full(len(c), a, dtype=np.float32) for c, a in zip(completions, adv)],
                        ref, sampler_logprobs=[r.copy() for r in ref], sequence_advantages=adv,
                        trainable=np.ones(n, dtype=bool))


def train_config(device: str, epochs: int, minibatch: int = 32, micro_batch: int = 4) -> TrainConfig:
    return TrainConfig(
        policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip_c=None, gspo_form="sequence", kl_beta=0.0,
        kl_estimator="k3", kl_importance_weighted=False, kl_log_ratio_clamp=20.0, kl_value_clamp=10.0,
        kl_clamp_scope="every_estimator", token_mean_scope="minibatch", off_policy_mask_delta=None,
        off_policy_mask_scope="whole_loss", sequence_count="nonempty",
                gmpo_clip_sign="sequence", entropy_mask_form="policy_term", ratio_cap=None, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
        policy_log_ratio_clamp=20.0, gspo_log_ratio_clamp=20.0, top_entropy_quantile=1.0, keep_sampling_mask=True, tis_cap=None, target_kl=None,
        gradient_checkpointing=False, compile_layers=False,
        critic=CriticTrainConfig(lr=1e-5, value_coef=0.5, value_clip_eps=0.2, max_grad_norm=1.0),
        loss_aggregation="seq-mean-token-mean", epochs=epochs, minibatch_size=minibatch, micro_batch_size=micro_batch,
        max_tokens_per_micro_batch=0, lr=1e-6,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, entropy_coef=0.0, device=device,
        dtype="bfloat16", chunk_size=1024, max_skipped_steps=0, checkpoint_every_steps=0,
        checkpoint_every_s=0.0, checkpoint_fsync=False, save_dtype="auto", master_weights="auto",
        max_sampler_mismatch=None, lora=LoraConfig(rank=None, alpha=32.0, dropout=0.0, target_modules="all-linear",
                                                   train_lm_head=False, train_embeddings=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="the one-process run's --out, to compare step 1 with")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2, help="throughput is timed over the last epoch")
    parser.add_argument("--minibatch", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward (packed)")
    parser.add_argument("--compile-layers", action="store_true", help="compile_decoder_layers before sharding")
    parser.add_argument("--lora-rank", type=int, default=0, help="R > 0: train a rank-R all-linear LoRA adapter "
                        "(train.lora.rank R) over the frozen model, as the train stage does")
    args = parser.parse_args()

    dist = start(args.device)
    device = args.device
    model = build_model(TINY if args.tiny else QWEN_05B, device)
    data = synthetic(model.config.vocab_size, args.sequences, tiny=args.tiny)
    cfg = train_config(device, args.epochs, args.minibatch, args.micro_batch)
    if args.lora_rank:  # as the train stage does: PEFT injects the adapter, the loop trains the causal LM inside
        from rlpipe.models.lora.peft_model import wrap_for_training

        cfg = dataclasses.replace(cfg, lr=1e-5, lora=dataclasses.replace(cfg.lora, rank=args.lora_rank))
        model = wrap_for_training(model, cfg.lora).get_base_model()
    if args.compile_layers:  # as the train stage does: compile in place, then shard
        from rlpipe.engines.logprobs import compile_decoder_layers

        compile_decoder_layers(model)
    sharded = None
    if dist is not None:
        from rlpipe.training.distributed import shard_for_training

        sharded = shard_for_training(model, dist)
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    stamps: list[float] = []

    def progress(n: int) -> None:
        if on_cuda:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    result = train_policy(model, data, cfg, temperature=1.0, pad_token_id=0, seed=0, iteration=0, max_length=1024,
                          progress=progress, dist=sharded)
    total_s = time.perf_counter() - t0
    prompt_len = len(data.prompt_token_ids[0])
    tokens = [s["tokens"] + prompt_len * s["sequences"] for s in result.steps]  # every token a forward sees
    per_epoch = len(stamps) // args.epochs
    timed = slice(len(stamps) - per_epoch, None)  # the last epoch: no compilation left (see the docstring)
    steady_tokens_per_s = sum(tokens[timed]) / (stamps[-1] - stamps[-per_epoch - 1])
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0
    peaks = dist.gather(peak_gib) if dist is not None else [peak_gib]
    report = {
        "world_size": dist.world_size if dist is not None else 1, "compiled_layers": args.compile_layers,
        "lora_rank": args.lora_rank, "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "torch": torch.__version__, "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "steps": [{k: s[k] for k in ("loss", "grad_norm", "approx_kl", "clip_fraction", "tokens")}
                  for s in result.steps],
        "step_seconds": np.diff([t0] + stamps).round(3).tolist(),
        "tokens_per_s_last_epoch": steady_tokens_per_s, "train_policy_seconds": total_s,
        "peak_gib_per_rank": peaks,
        "old_logprobs_head": [float(x) for x in np.concatenate(result.old_logprobs)[:4]],
        "old_logprobs_sum": float(sum(float(x.sum()) for x in result.old_logprobs)),
    }
    if dist is None or dist.is_main:
        if args.compare:
            single = json.loads(Path(args.compare).read_text())
            s1, f1 = single["steps"][0], report["steps"][0]
            report["vs_one_process"] = {
                "step1_loss_abs_diff": abs(s1["loss"] - f1["loss"]),
                "step1_grad_norm_rel_diff": abs(s1["grad_norm"] - f1["grad_norm"]) / s1["grad_norm"],
                "last_step_loss_abs_diff": abs(single["steps"][-1]["loss"] - report["steps"][-1]["loss"]),
                "old_logprobs_sum_abs_diff": abs(single["old_logprobs_sum"] - report["old_logprobs_sum"]),
                "speedup_tokens_per_s": report["tokens_per_s_last_epoch"] / single["tokens_per_s_last_epoch"],
            }
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
    finish(dist)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
