"""Log-prob and train-step throughput on one GPU: rlpipe's packed/chunked path vs a naive padded baseline.

Both paths run in the same process on the same random-weight models, Qwen2.5-0.5B and -1.5B shapes
(Qwen2Config with the real sizes, tied embeddings, vocab 151,936; throughput does not depend on the
weights, and nothing can be downloaded), on random token ids:

- reference_logprob (no grad): bf16 weights.
    rlpipe: `batched_completion_logprobs` (length-sorted token-budget batches packed into one
            unpadded row, varlen flash attention, LM head in chunks on completion positions only,
            float32 per chunk, results back in input order as numpy) - the stage's own call.
    naive:  fixed batches of B sequences in input order, right-padded, HF forward (SDPA), full
            [B, T, V] logits -> float32 -> log_softmax -> gather.
- train step (fwd + bwd over all sequences + one fused AdamW step): fp32 master weights, bf16 autocast.
    rlpipe: packed token-budget micro-batches through `completion_logprobs` (chunked head whose
            backward recomputes each chunk's logits), optionally `enable_gradient_checkpointing`.
    naive:  fixed micro-batches of B padded sequences, full float32 log_softmax.
  The loss is the mean negative completion log-prob (its form does not change the cost).

Lengths: uniform (prompt 128 + completion L, nothing to pad) and a long-tailed spread (prompts
32-256; completions log-normal, median 300, 97% of them, plus 3% uniform in 1024-4096).
The naive batch size B is what a fixed batch needs for the longest sequence: budget // longest.

Useful tokens = prompt + completion tokens (never padding). FLOPs per useful token, for a sequence of
length L: forward 2*(matmul params + hidden*vocab) + 2*layers*L*hidden, training 3x that.
MFU = useful FLOPs/s over the bf16 dense peak (989 TFLOP/s, H100/H200 SXM datasheet); the script
also measures a bf16 matmul ceiling and reports MFU against it.

Extra rows: "rlpipe+ckpt" (enable_gradient_checkpointing, 4x the micro-batch budget), "rlpipe
compiled layers" (compile_decoder_layers, --compiled-rows), "rlpipe eager head" (--eager-rows).
The numbers in BENCHMARKS.md came from (one H200 each, 2026-11-26):

    python benchmarks/gpu_throughput.py --check --models 0.5B --compiled-rows \
        --compiled-settings uniform-512,uniform-1024,uniform-2048,uniform-4096,spread
    python benchmarks/gpu_throughput.py --models 1.5B --repeats 1 --compiled-rows
    python benchmarks/gpu_throughput.py --check --quick   # correctness on the GPU + a short table
    python benchmarks/gpu_throughput.py --profile         # top CUDA kernels of each path
    python benchmarks/gpu_throughput.py --smoke --quick   # CPU, tiny shapes: exercises the code only
    python benchmarks/gpu_throughput.py --generation ...  # also generation tokens/s (HF engine; vLLM if installed)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rlpipe from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rlpipe.engines.chunked_head as chunked_head  # noqa: E402
import rlpipe.engines.logprobs as lp  # noqa: E402
from rlpipe.engines.logprobs import (  # noqa: E402
    batched_completion_logprobs,
    completion_logprobs,
    enable_gradient_checkpointing,
    make_packed_batch,
    make_token_batch,
    token_budget_batches,
)
from rlpipe.engines.packed_attention import _flash_varlen, _sdpa_per_sequence  # noqa: E402
from rlpipe.training.loop import _optimizer_step, cut_micro_batches  # noqa: E402
from rlpipe.training.objective import TrainingData  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_check import train_config  # noqa: E402

PEAK_TFLOPS = 989.0  # bf16 dense, H100 SXM / H200 datasheet
SHAPES = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
}
VOCAB = 151936
DEVICE = "cuda"  # --smoke: "cpu", a tiny shape and vocab, to exercise the script without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0


def allocated_gb() -> float:
    return torch.cuda.memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0


def build_model(shape: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_sliding_window=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def matmul_params(model) -> int:
    """Weights of the decoder layers' linear maps (the LM head is counted as hidden*vocab separately)."""
    return sum(m.weight.numel() for m in model.base_model.layers.modules() if isinstance(m, torch.nn.Linear))


def useful_flops(model, lengths: list[int], *, train: bool) -> float:
    cfg = model.config
    per_token = 2 * (matmul_params(model) + cfg.hidden_size * cfg.vocab_size)
    fwd = sum(n * (per_token + 2 * cfg.num_hidden_layers * n * cfg.hidden_size) for n in lengths)
    return 3 * fwd if train else fwd


def make_data(kind: str, n_tokens: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompts and completions totalling about n_tokens: 'uniform-L' or 'spread'."""
    rng = np.random.default_rng(seed)
    prompts, completions, total = [], [], 0
    while total < n_tokens or len(prompts) < 2:
        if kind == "spread":
            p = int(rng.integers(32, 257))
            tail = rng.random() < 0.03
            c = int(rng.integers(1024, 4097)) if tail else int(np.clip(rng.lognormal(math.log(300), 0.5), 16, 4096))
        else:
            p, c = 128, int(kind.split("-")[1])
        prompts.append(rng.integers(0, VOCAB, p).tolist())
        completions.append(rng.integers(0, VOCAB, c).tolist())
        total += p + c
    if kind == "spread":  # a few up to 4096, always: the longest sequence sizes the naive batch
        completions[0] = rng.integers(0, VOCAB, 4096).tolist()
    return prompts, completions


def padded(prompts, completions):
    batch = make_token_batch(prompts, completions, pad_token_id=0)
    return batch.input_ids_BT.to(DEVICE), batch.attention_mask_BT.to(DEVICE), batch.completion_mask_BT.to(DEVICE)


def naive_logprobs(model, ids_BT, attn_BT, comp_BT):
    """Full-vocab float32 log_softmax over every position, then gather: what a first implementation does."""
    logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).logits
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1)
    return logp_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1) * comp_BT[:, 1:]


def naive_batches(lengths: list[int], budget: int) -> list[list[int]]:
    size = max(1, budget // max(lengths))
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


# ---------------------------------------------------------------------------------------------------------
# The four measured procedures; each processes all sequences once.


def ref_rlpipe(model, prompts, completions, *, budget, chunk):
    batched_completion_logprobs(model, prompts, completions, pad_token_id=0, temperature=1.0,
                                max_tokens_per_batch=budget, chunk_size=chunk, with_entropy=False)
    return len(token_budget_batches([len(p) + len(c) for p, c in zip(prompts, completions)], budget, packed=True))


def ref_naive(model, prompts, completions, *, budget, chunk):
    batches = naive_batches([len(p) + len(c) for p, c in zip(prompts, completions)], budget)
    with torch.inference_mode():
        for idx in batches:
            out = naive_logprobs(model, *padded([prompts[i] for i in idx], [completions[i] for i in idx]))
            out.cpu()
    return len(batches)


def train_rlpipe(model, prompts, completions, *, budget, chunk, optimizer):
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    batches = token_budget_batches(lengths, budget, packed=True)
    n_completion = sum(len(c) for c in completions)
    for idx in batches:
        batch = make_packed_batch([prompts[i] for i in idx], [completions[i] for i in idx])
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logp_BC, _ = completion_logprobs(model, batch, temperature=1.0, chunk_size=chunk, with_entropy=False)
        (-logp_BC.sum() / n_completion).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return len(batches)


def loop_data(prompts, completions, seed: int = 0) -> TrainingData:
    """What the train stage feeds its loop: a random advantage per sequence, reference = old = sampler log-probs."""
    rng = np.random.default_rng(seed)
    adv = rng.normal(size=len(prompts)).astype(np.float32)
    ref = [rng.normal(-11.0, 0.5, size=len(c)).astype(np.float32) for c in completions]
    data = TrainingData(prompts, completions, [np.full(len(c), a, dtype=np.float32) for c, a in zip(completions, adv)],
                        ref, sampler_logprobs=ref, sequence_advantages=adv, trainable=np.ones(len(prompts), dtype=bool))
    data.old_logprobs = ref
    return data


def train_loop(model, prompts, completions, *, budget, chunk, optimizer, data):
    """One optimizer step of the train stage's own loop, `rlpipe.training.loop._optimizer_step`.

    The GRPO/PPO clipped objective, the k3 KL to the reference (beta 0.001), the health statistics,
    bf16 autocast, gradient clipping and fused AdamW; micro-batches cut from the shuffled minibatch
    by `train.max_tokens_per_micro_batch` = the budget (not length-sorted as in "rlpipe").
    """
    n = len(prompts)
    cfg = dataclasses.replace(train_config(DEVICE, epochs=1, minibatch=n, micro_batch=n), kl_beta=0.001,
                              max_tokens_per_micro_batch=budget, chunk_size=chunk)
    order = np.random.default_rng(0).permutation(n)
    record = _optimizer_step(model, None, (optimizer, None), data, order, cfg, temperature=1.0, pad_token_id=0,
                             max_length=max(len(c) for c in completions), step=0, epoch=0)
    assert record is not None and math.isfinite(record["loss"]), record
    return len(cut_micro_batches(order, data, cfg))


def train_naive(model, prompts, completions, *, budget, chunk, optimizer):
    batches = naive_batches([len(p) + len(c) for p, c in zip(prompts, completions)], budget)
    n_completion = sum(len(c) for c in completions)
    for idx in batches:
        ids, attn, comp = padded([prompts[i] for i in idx], [completions[i] for i in idx])
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logp = naive_logprobs(model, ids, attn, comp)
        (-logp.sum() / n_completion).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return len(batches)


class eager_head:
    """Run rlpipe's LM-head element-wise work eagerly (not torch.compile'd): to show what the fusion buys."""

    def __enter__(self):
        self.saved = lp.fused
        lp.fused = chunked_head.fused = lambda fn, device: fn  # the forward (logprobs) and backward (chunked_head)

    def __exit__(self, *exc):
        lp.fused = chunked_head.fused = self.saved


def record(rows: list, shape: str, workload: str, setting: str, path: str, budget: int, result: dict) -> None:
    """Keep one table row and print it at once, so a long run on the device shows its progress."""
    rows.append((shape, workload, setting, path, budget, result))
    print(shape, workload, setting, path, result, flush=True)


def as_reference_model(model):
    """The trained-on model as the reference stage holds it: bf16 weights, no gradients; peak memory reset."""
    model = model.to(torch.bfloat16)
    model.zero_grad(set_to_none=True)
    reset_peak()
    return model


def compiled_rows(shape: str, args, rows: list) -> None:
    """rlpipe with every decoder layer torch.compile'd (compile_decoder_layers), on a fresh model."""
    settings = args.compiled_settings.split(",")
    model = build_model(shape, torch.float32)
    lp.compile_decoder_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    for setting in settings:
        data = make_data(setting, args.train_tokens, seed=0)
        kw = dict(budget=args.train_budget, chunk=args.chunk, optimizer=optimizer)
        r = measure(train_rlpipe, model, *data, train=True, repeats=args.repeats, **kw)
        record(rows, shape, "train", setting, "rlpipe compiled layers", kw["budget"], r)
        r = measure(train_loop, model, *data, train=True, repeats=args.repeats, data=loop_data(*data), **kw)
        record(rows, shape, "train", setting, "rlpipe train loop, compiled layers", kw["budget"], r)
    del optimizer
    model = as_reference_model(model)
    for setting in settings:
        data = make_data(setting, args.ref_tokens, seed=1)
        r = measure(ref_rlpipe, model, *data, train=False, repeats=args.repeats, budget=args.ref_budget,
                    chunk=args.chunk)
        record(rows, shape, "reference", setting, "rlpipe compiled layers", args.ref_budget, r)
    del model
    reset_peak()


def measure(fn, model, prompts, completions, *, train: bool, repeats: int, **kwargs) -> dict:
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    try:
        reset_peak()
        n_batches = fn(model, prompts, completions, **kwargs)  # warm-up (and optimizer state allocation)
        seconds = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            fn(model, prompts, completions, **kwargs)
            sync()
            seconds.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        kwargs.get("optimizer") and kwargs["optimizer"].zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        reset_peak()
        return {"oom": True}
    s = statistics.median(seconds)
    flops = useful_flops(model, lengths, train=train)
    return {"oom": False, "seconds": s, "tokens_per_s": sum(lengths) / s, "tflops": flops / s / 1e12,
            "peak_gb": peak_gb(), "batches": n_batches, "sequences": len(lengths), "tokens": sum(lengths),
            "longest": max(lengths)}


# ---------------------------------------------------------------------------------------------------------
# Correctness on the GPU, and memory of the log-prob computation alone.


def check(model_fp32) -> list[str]:
    """Packed (flash varlen, bf16) vs padded (SDPA) vs float32; and the varlen kernel vs SDPA, with GQA."""
    lines = []
    torch.manual_seed(1)
    for hq, hk in ((14, 2), (4, 4)):
        lens = [37, 300, 1, 129]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(sum(lens), h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (hq, hk, hk))
        flash = _flash_varlen(q, k, v, cu, max(lens), 64 ** -0.5)
        ref = _sdpa_per_sequence(q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
                                 cu.tolist(), 64 ** -0.5)
        g = torch.randn_like(ref)
        grads_flash = torch.autograd.grad((flash.float() * g).sum(), (q, k, v))
        grads_ref = torch.autograd.grad((ref * g).sum(), (q, k, v))
        rel = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in
               zip((flash, *grads_flash), (ref, *grads_ref))]
        lines.append(f"varlen flash vs fp32 SDPA per sequence, heads {hq}/{hk}: rel err out/dq/dk/dv = "
                     + " / ".join(f"{r:.1e}" for r in rel))
        assert max(rel) < 2e-2, rel
    prompts, completions = make_data("spread", 6000, seed=5)
    model_bf16 = build_model("0.5B", torch.bfloat16)
    model_bf16.load_state_dict(model_fp32.state_dict())
    with torch.no_grad():
        truth, _ = completion_logprobs(model_fp32, make_token_batch(prompts, completions, pad_token_id=0),
                                       temperature=1.0, chunk_size=1024, with_entropy=False)
        packed32, _ = completion_logprobs(model_fp32, make_packed_batch(prompts, completions), temperature=1.0,
                                          chunk_size=1024, with_entropy=False)
        packed16, _ = completion_logprobs(model_bf16, make_packed_batch(prompts, completions), temperature=1.0,
                                          chunk_size=1024, with_entropy=False)
        padded16, _ = completion_logprobs(model_bf16, make_token_batch(prompts, completions, pad_token_id=0),
                                          temperature=1.0, chunk_size=1024, with_entropy=False)

    def rel(x):
        return float((x - truth).norm() / truth.norm())

    lines.append(f"0.5B log-probs, {len(prompts)} spread sequences: fp32 packed (SDPA per sequence) vs fp32 padded "
                 f"max abs {float((packed32 - truth).abs().max()):.1e}; rel err vs fp32: bf16 packed (flash varlen) "
                 f"{rel(packed16):.1e}, bf16 padded (SDPA) {rel(padded16):.1e}")
    assert rel(packed32) < 1e-5 and rel(packed16) < 2 * rel(padded16) + 1e-3
    idx = list(range(4))
    grads = []
    for make, bf16 in ((lambda p, c: make_token_batch(p, c, pad_token_id=0), False),
                       (lambda p, c: make_packed_batch(p, c), True),
                       (lambda p, c: make_token_batch(p, c, pad_token_id=0), True)):
        model_fp32.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
            logp, ent = completion_logprobs(model_fp32, make([prompts[i] for i in idx], [completions[i] for i in idx]),
                                            temperature=0.9, chunk_size=512, with_entropy=True)
        (logp.sum() + ent.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model_fp32.parameters()]))
    model_fp32.zero_grad(set_to_none=True)
    g_packed, g_padded = (float((g - grads[0]).norm() / grads[0].norm()) for g in grads[1:])
    lines.append(f"0.5B gradient (log-probs + entropies), rel err vs fp32 padded: bf16-autocast packed (flash varlen) "
                 f"{g_packed:.1e}, bf16-autocast padded (SDPA) {g_padded:.1e}")
    assert g_packed < 2 * g_padded + 1e-3
    del model_bf16
    return lines


def head_memory(hidden: int, vocab: int, positions: int, chunk: int) -> tuple[float, float]:
    """Peak extra GB of the log-prob computation from [positions, hidden] bf16 hidden states: naive vs chunked."""
    head = torch.nn.Linear(hidden, vocab, bias=False, device=DEVICE, dtype=torch.bfloat16)
    h = torch.randn(positions, hidden, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (positions,), device=DEVICE)
    out = []
    for chunked in (False, True):
        reset_peak()
        base = allocated_gb()
        with torch.inference_mode():
            if chunked:
                stats = lp.fused(lp.logit_stats, h.device)
                torch.cat([stats(head(h[i:i + chunk]), target[i:i + chunk], 1.0, False)[0]
                           for i in range(0, positions, chunk)])
            else:
                torch.log_softmax(head(h).float(), dim=-1).gather(-1, target[:, None])
        sync()
        out.append(peak_gb() - base)
    del head, h
    return out[0], out[1]


def profile(shape: str, tokens: int, args) -> None:
    """Where the time goes: top CUDA kernels of one rlpipe reference pass and one rlpipe train step."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    data = make_data("spread", tokens, seed=3)
    model = build_model(shape, torch.float32)
    if args.profile_compiled:
        lp.compile_decoder_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    cases = [("train rlpipe", train_rlpipe, dict(budget=args.train_budget, chunk=args.chunk, optimizer=optimizer)),
             ("train loop", train_loop, dict(budget=args.train_budget, chunk=args.chunk, optimizer=optimizer,
                                             data=loop_data(*data))),
             ("train naive", train_naive, dict(budget=args.naive_train_budget, chunk=args.chunk, optimizer=optimizer))]
    if args.profile_compiled:
        cases.pop()  # the naive path does not use the compiled layers' packed attention
    for name, fn, kw in cases + [("reference rlpipe", ref_rlpipe, dict(budget=args.ref_budget, chunk=args.chunk))]:
        if name.startswith("reference"):
            del optimizer
            model = model.to(torch.bfloat16)
        fn(model, *data, **kw)
        sync()
        start = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(model, *data, **kw)
            sync()
        wall = time.perf_counter() - start
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e6
        print(f"\n{shape} {name}{' (compiled layers)' if args.profile_compiled else ''}: wall {wall:.3f} s (profiled), "
              f"GPU kernels {gpu:.3f} s ({100 * gpu / wall:.0f}% busy)")
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=70))
    del model


def generation_rows(args) -> list[dict]:
    """Generation tokens/s: rlpipe's HF engine here, and vLLM's generate path through vllm_generate.py.

    vLLM runs in a child process (its engine must start where CUDA is not initialised yet) and only
    where it is installed; that script also times bare vLLM on the same prompts (the stage's
    >= 90% target). Both: a 0.5B-shaped random-weight model, bf16, prompts of 64 random ids,
    G = 8 samples each, temperature 1, no EOS in practice (random weights), so every sample runs
    to max_new_tokens.
    """
    import importlib.util
    import subprocess
    import tempfile

    from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
    from rlpipe.engines.hf import HFEngine

    out = []
    if DEVICE == "cuda" and importlib.util.find_spec("vllm") is not None:
        report = Path(tempfile.mkdtemp()) / "vllm.json"
        cmd = [sys.executable, str(Path(__file__).with_name("vllm_generate.py")), "--prompts", str(args.gen_prompts),
               "--max-new-tokens", str(args.gen_tokens), "--repeats", "1", "--out", str(report)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            rates = json.loads(report.read_text())["tokens_per_s"]
            out += [{"engine": f"vLLM ({name})", "tokens_per_s": rates[name]} for name in ("bare_vllm", "rlpipe")]
        else:
            print("vllm_generate.py failed:", proc.stderr[-2000:], flush=True)
    model = build_model("0.5B", torch.bfloat16)
    engine = HFEngine.from_model(model, batch_size=args.gen_batch, eos_token_ids=[VOCAB - 1], pad_token_id=0)
    rng = np.random.default_rng(0)
    requests = [PromptRequest(prompt_token_ids=tuple(rng.integers(0, VOCAB - 1, 64).tolist()), seed=derive_seed(0, i),
                              n=8) for i in range(args.gen_prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.gen_tokens)
    engine.generate(requests[:2], SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8))  # warm-up
    sync()
    start = time.perf_counter()
    groups = engine.generate(requests, params)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    out.append({"engine": f"rlpipe HF engine (batch {args.gen_batch})", "tokens_per_s": tokens / seconds})
    for row in out:
        row.update(sequences=8 * args.gen_prompts, max_new_tokens=args.gen_tokens)
        print("generation", row, flush=True)
    del engine, model
    reset_peak()
    return out


def matmul_ceiling() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192 ** 3 / statistics.median(times) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.5B,1.5B")
    ap.add_argument("--quick", action="store_true", help="0.5B, two length settings, fewer tokens")
    ap.add_argument("--check", action="store_true", help="correctness checks on the GPU first")
    ap.add_argument("--ref-tokens", type=int, default=131072, help="useful tokens per reference pass")
    ap.add_argument("--train-tokens", type=int, default=65536, help="useful tokens per train step")
    ap.add_argument("--ref-budget", type=int, default=65536, help="rlpipe tokens per packed reference batch")
    ap.add_argument("--train-budget", type=int, default=16384, help="rlpipe tokens per packed micro-batch")
    ap.add_argument("--naive-ref-budget", type=int, default=32768, help="naive: B = this // longest sequence")
    ap.add_argument("--naive-train-budget", type=int, default=8192, help="naive: B = this // longest sequence")
    ap.add_argument("--chunk", type=int, default=2048, help="rlpipe LM-head chunk (positions)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file for all numbers")
    ap.add_argument("--settings", default="uniform-512,uniform-1024,uniform-2048,uniform-4096,spread")
    ap.add_argument("--eager-rows", action="store_true",
                    help="also rlpipe with an eager (uncompiled) LM-head element-wise part on 'spread'")
    ap.add_argument("--check-only", action="store_true", help="only the correctness checks")
    ap.add_argument("--compiled-rows", action="store_true", help="also rlpipe with compile_decoder_layers")
    ap.add_argument("--compiled-settings", default="uniform-2048,spread")
    ap.add_argument("--only-compiled", action="store_true", help="only the compiled rows (and their naive rows: none)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of each path, then stop")
    ap.add_argument("--profile-compiled", action="store_true", help="--profile with compile_decoder_layers")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape and vocab: exercise the code paths only")
    ap.add_argument("--generation", action="store_true",
                    help="also generation tokens/s: rlpipe's HF engine, and vLLM (bare and rlpipe) where installed")
    ap.add_argument("--generation-only", action="store_true", help="only the generation rows")
    ap.add_argument("--gen-prompts", type=int, default=32, help="generation: prompts (x G=8 samples)")
    ap.add_argument("--gen-tokens", type=int, default=512, help="generation: new tokens per sample")
    ap.add_argument("--gen-batch", type=int, default=256, help="generation: HF engine sequences per batch")
    args = ap.parse_args()
    import transformers

    global DEVICE, VOCAB
    if args.smoke:
        DEVICE, VOCAB = "cpu", 512
        SHAPES["0.5B"] = SHAPES["1.5B"] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128)
        args.ref_tokens = args.train_tokens = 6000
        args.ref_budget = args.train_budget = args.naive_ref_budget = args.naive_train_budget = 4500
        args.repeats = 1
        args.gen_prompts, args.gen_tokens, args.gen_batch = 2, 8, 16

    if args.profile or args.profile_compiled:
        for shape in args.models.split(","):
            profile(shape, args.train_tokens, args)
        return
    settings = ["uniform-1024", "spread"] if args.quick else args.settings.split(",")
    models = ["0.5B"] if args.quick else args.models.split(",")
    if args.quick:
        args.ref_tokens, args.train_tokens = args.ref_tokens // 2, args.train_tokens // 2
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    ceiling = matmul_ceiling() if DEVICE == "cuda" else 1.0
    header = (f"{datetime.date.today()} | {card} | torch {torch.__version__} | transformers {transformers.__version__}"
              f" | bf16 matmul ceiling (8192^3) {ceiling:.0f} TFLOP/s | MFU peak {PEAK_TFLOPS:.0f} TFLOP/s")
    print(header, flush=True)
    results: dict = {"header": header, "ceiling_tflops": ceiling, "runs": [], "check": [], "head_memory": [],
                     "generation": generation_rows(args) if args.generation or args.generation_only else []}
    rows = []
    if args.generation_only:
        models = []
    if args.check_only:
        print("\n".join(check(build_model("0.5B", torch.float32))), flush=True)
        return
    for shape in models:
        if args.compiled_rows:
            compiled_rows(shape, args, rows)
        if args.only_compiled:
            continue
        model = build_model(shape, torch.float32)
        if args.check and shape == "0.5B":
            results["check"] = check(model)
            print("\n".join(results["check"]), flush=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=DEVICE == "cuda")
        plans = []
        for setting in settings:
            data = make_data(setting, args.train_tokens, seed=0)
            plans.append(("train", setting, "naive", train_naive, data,
                          dict(budget=args.naive_train_budget, chunk=args.chunk, optimizer=optimizer)))
            plans.append(("train", setting, "rlpipe", train_rlpipe, data,
                          dict(budget=args.train_budget, chunk=args.chunk, optimizer=optimizer)))
            plans.append(("train", setting, "rlpipe train loop", train_loop, data,
                          dict(budget=args.train_budget, chunk=args.chunk, optimizer=optimizer, data=loop_data(*data))))
        for workload, setting, path, fn, data, kw in plans:
            r = measure(fn, model, *data, train=True, repeats=args.repeats, **kw)
            record(rows, shape, workload, setting, path, kw["budget"], r)
        if args.eager_rows:
            data = make_data("spread", args.train_tokens, seed=0)
            kw = dict(budget=args.train_budget, chunk=args.chunk, optimizer=optimizer)
            with eager_head():
                r = measure(train_rlpipe, model, *data, train=True, repeats=args.repeats, **kw)
            record(rows, shape, "train", "spread", "rlpipe eager head", kw["budget"], r)
        # Gradient checkpointing last: it stays on for this model (hooks), and frees memory for a bigger budget.
        enable_gradient_checkpointing(model)
        data = make_data("spread", args.train_tokens, seed=0)
        kw = dict(budget=4 * args.train_budget, chunk=args.chunk, optimizer=optimizer)
        r = measure(train_rlpipe, model, *data, train=True, repeats=args.repeats, **kw)
        record(rows, shape, "train", "spread", "rlpipe+ckpt", kw["budget"], r)
        del optimizer
        model = as_reference_model(model)
        for setting in settings:
            data = make_data(setting, args.ref_tokens, seed=1)
            for path, fn, budget in (("naive", ref_naive, args.naive_ref_budget),
                                     ("rlpipe", ref_rlpipe, args.ref_budget)):
                r = measure(fn, model, *data, train=False, repeats=args.repeats, budget=budget, chunk=args.chunk)
                record(rows, shape, "reference", setting, path, budget, r)
            if args.eager_rows and setting == "spread":
                with eager_head():
                    r = measure(ref_rlpipe, model, *data, train=False, repeats=args.repeats, budget=args.ref_budget,
                                chunk=args.chunk)
                record(rows, shape, "reference", setting, "rlpipe eager head", args.ref_budget, r)
        # Same batch, whole reference forward: 16 x (128 + 2048), naive padded vs rlpipe packed in one row.
        completion = 2048 if DEVICE == "cuda" else 64
        budget = 16 * (128 + completion)
        data = make_data(f"uniform-{completion}", budget, seed=2)
        for path, fn in (("naive", ref_naive), ("rlpipe", ref_rlpipe)):
            weights = allocated_gb()
            r = measure(fn, model, *data, train=False, repeats=1, budget=budget, chunk=1024)
            r["above_weights_gb"] = None if r["oom"] else r["peak_gb"] - weights
            record(rows, shape, "reference same batch", f"uniform-{completion}", path, budget, r)
        hidden = model.config.hidden_size
        del model
        reset_peak()
        for vocab in (VOCAB, 2 * VOCAB):
            naive_gb, chunked_gb = head_memory(hidden, vocab, positions=16384 if DEVICE == "cuda" else 512, chunk=1024)
            results["head_memory"].append({"model": shape, "vocab": vocab, "positions": 16384, "chunk": 1024,
                                           "naive_gb": naive_gb, "chunked_gb": chunked_gb})
            print(shape, "head memory", vocab, naive_gb, chunked_gb, flush=True)

    results["runs"] = [dict(model=m, workload=w, setting=s, path=p, budget=b, **r) for m, w, s, p, b, r in rows]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_tables(results, ceiling)


def print_tables(results: dict, ceiling: float) -> None:
    print("\n" + results["header"])
    print("FLOPs per useful token (sequence length L): forward 2*(matmul params + hidden*vocab) + 2*layers*L*hidden;"
          " train step 3x forward. Useful tokens = prompt + completion, never padding.\n")
    print(f"| model | workload | lengths | path | batch | useful tok/s | MFU vs {PEAK_TFLOPS:.0f} "
          f"| MFU vs {ceiling:.0f} "
          "| peak GB | vs naive |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    naive = {(r["model"], r["workload"], r["setting"]): r for r in results["runs"] if r["path"] == "naive"}
    for r in results["runs"]:
        if r["oom"]:
            print(f"| {r['model']} | {r['workload']} | {r['setting']} | {r['path']} | {r['budget']} | OOM | | | | |")
            continue
        base = naive.get((r["model"], r["workload"], r["setting"]))
        comparable = r["path"] != "naive" and base and not base["oom"]
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if comparable else ""
        batch = (f"{r['batches']} rows <= {r['budget']} tok" if r["path"].startswith("rlpipe")
                 else f"{r['batches']} x B={max(1, r['budget'] // r['longest'])}")
        print(f"| {r['model']} | {r['workload']} | {r['setting']} | {r['path']} | {batch} | {r['tokens_per_s']:,.0f} "
              f"| {100 * r['tflops'] / PEAK_TFLOPS:.1f}% | {100 * r['tflops'] / ceiling:.1f}% | {r['peak_gb']:.1f}"
              + (f" ({r['above_weights_gb']:.1f} above weights)" if r.get("above_weights_gb") is not None else "") + " "
              f"| {speed} |")
    if results["head_memory"]:
        print("\nLog-prob computation alone (from bf16 hidden states, 16384 positions, chunk 1024), peak extra GB:\n")
        print("| model | vocab | naive [N, V] fp32 log_softmax | rlpipe chunked | ratio |")
        print("|---|---|---|---|---|")
        for h in results["head_memory"]:
            ratio = h["chunked_gb"] / h["naive_gb"] if h["naive_gb"] else float("nan")
            print(f"| {h['model']} | {h['vocab']:,} | {h['naive_gb']:.2f} | {h['chunked_gb']:.2f} | {ratio:.3f} |")
    if results.get("generation"):
        hf = results["generation"][-1]["tokens_per_s"]
        print("\nGeneration, 0.5B shape, bf16, 64-token prompts x G=8, every sample max_new_tokens long:\n")
        print("| engine | sequences | new tokens each | tokens/s | vs rlpipe HF engine |")
        print("|---|---|---|---|---|")
        for g in results["generation"]:
            print(f"| {g['engine']} | {g['sequences']} | {g['max_new_tokens']} | {g['tokens_per_s']:,.0f} "
                  f"| {g['tokens_per_s'] / hf:.1f}x |")
    for line in results["check"]:
        print("check:", line)


if __name__ == "__main__":
    main()
