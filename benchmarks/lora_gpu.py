"""Peak GPU memory and tokens/s of train and reference, full fine-tuning against LoRA (issue 17).

The train stage's own optimizer step (`rlpipe.training.loop._optimizer_step`: the clipped objective, the
k3 KL, bf16 autocast, gradient clipping, fused AdamW) on packed micro-batches, and the reference
stage's own no-grad pass (`batched_completion_logprobs`), on a random-weight Qwen2.5-0.5B (or 1.5B)
shape, from gpu_throughput.py. Lengths are the fixed-cost workload's: 128 prompt + 512 completion tokens.

- train, full: float32 master weights, AdamW moments for every weight (what `train` holds).
- train, LoRA rank R on all linear layers: the float32 base frozen, AdamW moments for the adapter only.
- reference, base: the bf16 base alone (the reference of a LoRA run is its base: nothing else to load).
- reference, base + adapter: the bf16 base with the adapter applied unmerged (a refreshed reference, and
  the cost of a log-prob pass through an adapter).

    python benchmarks/lora_gpu.py --rank 16 --out lora_gpu.json          # one GPU
    python benchmarks/lora_gpu.py --smoke                                # CPU, tiny shape: the code paths only
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpu_throughput as gt  # noqa: E402  (puts this checkout's rlpipe on the path)
from rlpipe.config import LoraConfig  # noqa: E402
from rlpipe.engines.logprobs import compile_decoder_layers  # noqa: E402
from rlpipe.models.lora.peft_model import wrap_for_training  # noqa: E402


def lora_config(rank: int) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                      train_embeddings=False)


def with_adapter(model, rank: int):
    """``model`` with a fresh rank-``rank`` adapter whose B is random (so the adapter changes the outputs)."""
    peft_model = wrap_for_training(model, lora_config(rank))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.01).to(p.device, p.dtype))
    return peft_model


def model_for(shape: str, rank: int, *, reference: bool, compile_layers: bool):
    """The model a row measures: float32 weights (train) or bf16 without gradients (reference), with a
    rank-``rank`` adapter unless rank is 0, decoder layers compiled last as the stages do."""
    model = gt.build_model(shape, torch.float32)
    if rank:
        model = with_adapter(model, rank).get_base_model()
    if reference:
        model = model.to(torch.bfloat16).eval()
        for p in model.parameters():
            p.requires_grad_(False)
    if compile_layers:
        compile_decoder_layers(model)
    return model


def train_row(shape: str, rank: int, args) -> dict:
    """One optimizer step of the train loop over args.train_tokens tokens: full (rank 0) or LoRA."""
    model = model_for(shape, rank, reference=False, compile_layers=args.compile)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-7, fused=gt.DEVICE == "cuda")
    data = gt.make_data(f"uniform-{args.completion}", args.train_tokens, seed=0)
    result = gt.measure(gt.train_loop, model, *data, train=True, repeats=args.repeats, budget=args.train_budget,
                        chunk=args.chunk, optimizer=optimizer, data=gt.loop_data(*data))  # resets the peak first
    result.update(trainable_parameters=sum(p.numel() for p in params),
                  total_parameters=sum(p.numel() for p in model.parameters()))
    del model, optimizer, params
    gt.reset_peak()
    return result


def reference_row(shape: str, rank: int, args) -> dict:
    """The reference pass over args.ref_tokens tokens: the bf16 base alone (rank 0) or with an adapter."""
    model = model_for(shape, rank, reference=True, compile_layers=args.compile)
    data = gt.make_data(f"uniform-{args.completion}", args.ref_tokens, seed=1)
    result = gt.measure(gt.ref_rlpipe, model, *data, train=False, repeats=args.repeats, budget=args.ref_budget,
                        chunk=args.chunk)  # resets the peak first
    del model
    gt.reset_peak()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5B", help="comma-separated: 0.5B, 1.5B")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--completion", type=int, default=512, help="completion tokens per sequence (prompt: 128)")
    ap.add_argument("--train-tokens", type=int, default=65536, help="tokens per optimizer step")
    ap.add_argument("--ref-tokens", type=int, default=131072, help="tokens per reference pass")
    ap.add_argument("--train-budget", type=int, default=16384, help="tokens per packed micro-batch")
    ap.add_argument("--ref-budget", type=int, default=65536, help="tokens per packed reference batch")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="compile_decoder_layers, as train.compile_layers does")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape and vocab: exercise the code paths only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        gt.DEVICE, gt.VOCAB = "cpu", 512
        gt.SHAPES["0.5B"] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128)
        args.train_tokens = args.ref_tokens = args.train_budget = args.ref_budget = 3000
        args.completion, args.repeats = 64, 1
    device = torch.cuda.get_device_name() if gt.DEVICE == "cuda" else "cpu"
    rows = []
    for shape in args.shapes.split(","):
        for workload, fn in (("train", train_row), ("reference", reference_row)):
            for rank in (0, args.rank):
                start = time.perf_counter()
                r = fn(shape, rank, args)
                r.update(shape=shape, workload=workload, rank=rank, wall_s=round(time.perf_counter() - start, 1))
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{device}, torch {torch.__version__}, compiled layers: {args.compile}")
    print("| shape | workload | variant | peak GiB | tokens/s | trainable parameters |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        variant = f"LoRA r{r['rank']}" if r["rank"] else ("full" if r["workload"] == "train" else "base")
        if r["workload"] == "reference" and r["rank"]:
            variant = f"base + LoRA r{r['rank']} adapter"
        if r["oom"]:
            print(f"| {r['shape']} | {r['workload']} | {variant} | OOM | | |")
            continue
        trainable = f"{r['trainable_parameters']:,}" if "trainable_parameters" in r else ""
        print(f"| {r['shape']} | {r['workload']} | {variant} | {r['peak_gb'] * 1e9 / 2**30:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {trainable} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "compile": args.compile,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
