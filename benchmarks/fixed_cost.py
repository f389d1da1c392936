"""Fixed cost of an iteration: wall time of `rlpipe run` against the pure compute its stages report.

Builds the workload itself and runs the real pipeline (DVC stages, `rlpipe run`'s loop, the warm
servers unless --no-servers), then reads every stage's metrics/<stage>.json after each iteration:
``compute`` (decoding, log-prob passes, optimizer steps, scoring) is the pure compute; everything
else (process start, imports, reading, engine start, compilation, writing, DVC and
`rlpipe iterate` bookkeeping) is fixed cost. The ratio wall / compute is the issue's measure (#12).

GPU workload (the issue's): a random-weight Llama with Qwen2.5-0.5B's (or 1.5B's) shape and a
151,936-word tokenizer, N prompts x G samples x T new tokens, vLLM generation, bf16, GRPO:

    python benchmarks/fixed_cost.py --workdir /tmp/fc --shape 0.5b --iterations 2 --out fc.json

CPU: the embedded tiny default (`--tiny`), e.g. for the stage server's effect on the 2-core box:

    python benchmarks/fixed_cost.py --workdir /tmp/fc-tiny --tiny --iterations 3 [--no-servers]

CPU, the file and DVC costs of the 0.5B shape (bf16 checkpoints with their float32 master copy, 3.0 GB
an iteration) with next to no compute:

    python benchmarks/fixed_cost.py --workdir /tmp/fc05 --shape 0.5b --device cpu --cpu-bf16 \
        --prompts 8 --group 2 --new-tokens 4 --eval-prompts 4 --prompt-words 16 --iterations 3

Without DVC's git integration (`dvc init --no-scm`, `rlpipe run --no-commit`), so it runs on a
machine without git; DVC's hashing, caching and lock files are all there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the device carry has no FlashInfer
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHAPES = {  # Qwen2.5 shapes as Llama configs (a Llama-type model keeps its own tokenizer.json under transformers 5)
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960},
    "check": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128},  # to check the script itself on a CPU (--device cpu)
}
# Train's tokens per micro-batch: 32768 holds the 0.5B shape's activations easily; the 1.5B shape's ran out
# of an 80 GB H100 at 32768 (75 GiB allocated, 2026-11-28), and 16384 is its fastest setting in BENCHMARKS.md.
TRAIN_TOKENS_PER_MICRO_BATCH = {"0.5b": 32768, "1.5b": 16384, "check": 32768}
VOCAB = 151_936
EOS, PAD = 151_645, 151_643
STAGES = ("generate", "score", "reference_logprob", "values", "advantage", "train", "evaluate")


def build_model(path: Path, shape: str, context: int) -> None:
    """Random bf16 weights of the shape, a WordLevel tokenizer of VOCAB words ("t0".."t151935"), saved locally."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**SHAPES[shape], vocab_size=VOCAB, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD,
                         max_position_embeddings=context)
    t0 = time.perf_counter()
    with torch.device("meta"):  # no transformers init: it took 50-100 s for these shapes on a GPU host's CPU
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.fill_(1.0)
            else:
                weight.normal_(0.0, config.initializer_range, generator=generator)
    t1 = time.perf_counter()
    model.save_pretrained(path)
    print(f"model: random weights {t1 - t0:.1f} s, saved in {time.perf_counter() - t1:.1f} s", flush=True)
    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=f"t{EOS}", pad_token=f"t{PAD}",
                                  unk_token="t0")
    tok.save_pretrained(path)


def write_prompts(path: Path, count: int, words: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            prompt = " ".join(f"t{rng.randrange(1000, 150_000)}" for _ in range(words))
            f.write(json.dumps({"prompt": prompt, "answer": str(i % 10)}) + "\n")


def merge(base: dict, over: dict) -> dict:
    for key, value in over.items():
        base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return base


def gpu_params(model: str, prompts: int, group: int, new_tokens: int, prompt_words: int, vllm_memory: float,
               train_tokens: int) -> dict:
    """The GPU settings of docs/your-own-model.md for this workload (GRPO, vLLM, bf16, compiled layers)."""
    return {
        "paths": {"model_dir": model},  # the starting policy: the baseline stage evaluates it
        "policy": {"path": model, "latest_path": model}, "reference": {"path": model}, "critic": {"path": model},
        "reward_model": {"init": model, "device": "cuda", "dtype": "bfloat16"},
        "prepare": {"source": "files", "max_prompt_tokens": prompt_words + 8,
                    "files": {"train": "data/train.jsonl", "eval": "data/eval.jsonl", "tokenizer_path": model,
                              "prompt_column": "prompt", "answer_column": "answer", "chat_template": "off"}},
        "generate": {"engine": "auto", "device": "cuda", "dtype": "bfloat16", "prompts_per_iteration": prompts,
                     "group_size": group, "max_new_tokens": new_tokens, "temperature": 1.0,
                     "vllm": {"gpu_memory_utilization": vllm_memory, "max_model_len": prompt_words + new_tokens + 16}},
        "reference_logprob": {"device": "cuda", "dtype": "bfloat16", "max_tokens_per_batch": 65536},
        "values": {"device": "cuda", "dtype": "bfloat16"},
        "train": {"device": "cuda", "dtype": "bfloat16", "minibatch_size": 256, "micro_batch_size": 64,
                  "max_tokens_per_micro_batch": train_tokens, "lr": 1.0e-6, "epochs": 2},
        "evaluate": {"engine": "auto", "device": "cuda", "dtype": "bfloat16", "max_new_tokens": new_tokens,
                     "batch_size": 64},
    }


def user_mode_dvc_yaml(text: str) -> str:
    """The pipeline for prompt files instead of the tiny task: files as prepare deps, no model output."""
    pipeline = yaml.safe_load(text)
    prepare = pipeline["stages"]["prepare"]
    prepare["deps"] += ["data/train.jsonl", "data/eval.jsonl"]
    prepare["outs"] = [o for o in prepare["outs"] if o != "${paths.model_dir}"]
    return yaml.safe_dump(pipeline, sort_keys=False)


def setup(work: Path, args) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in ("stages", "rlpipe"):  # rlpipe: the stages' DVC deps (the code itself runs from the installed package)
        shutil.copytree(REPO / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("params.yaml", ".dvcignore"):
        shutil.copy(REPO / name, work / name)
    dvc_yaml = (REPO / "dvc.yaml").read_text()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    if not args.tiny:
        model = work / "models" / f"random-{args.shape}"
        build_model(model, args.shape, args.prompt_words + args.new_tokens + 64)
        (work / "data").mkdir()
        write_prompts(work / "data/train.jsonl", args.prompts, args.prompt_words, seed=1)
        write_prompts(work / "data/eval.jsonl", args.eval_prompts, args.prompt_words, seed=2)
        settings = gpu_params(str(model.relative_to(work)), args.prompts, args.group, args.new_tokens, args.prompt_words,
                              args.vllm_memory, TRAIN_TOKENS_PER_MICRO_BATCH[args.shape])
        if args.device == "cpu":
            text = json.dumps(settings).replace('"cuda"', '"cpu"')
            if not args.cpu_bf16:
                text = text.replace('"bfloat16"', '"float32"')
            settings = json.loads(text)
        params = merge(params, settings)
        dvc_yaml = user_mode_dvc_yaml(dvc_yaml)
    params = merge(params, {"worker": {"stage_server": args.servers, "engine_server": "auto" if args.servers else False,
                                       "generate_devices": args.generate_devices, "train_devices": args.train_devices}})
    if args.lora_rank:  # train a LoRA adapter (docs/lora.md) at ~10x the full fine-tuning learning rate
        params = merge(params, {"train": {"lora": {"rank": args.lora_rank},
                                          "lr": params["train"]["lr"] * 10}})
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (work / "dvc.yaml").write_text(dvc_yaml)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=work, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], cwd=work, check=True)


def stage_seconds(work: Path) -> dict[str, dict]:
    out = {}
    for name in STAGES:
        f = work / "metrics" / f"{name}.json"
        if f.is_file():
            m = json.loads(f.read_text())
            out[name] = {**m["seconds"], **({"engine_server_seconds": m["engine_server_seconds"]}
                                            if "engine_server_seconds" in m else {})}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny default (CPU) instead of the GPU workload")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--servers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-staleness", type=int, default=0, help="S > 0: overlapped iterations (docs/overlap.md)")
    ap.add_argument("--vllm-memory", type=float, default=0.85,
                    help="generate.vllm.gpu_memory_utilization (lower it when train shares the GPU at the same time)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the --shape workload on the CPU "
                                                                            "(to check the script; use --shape check)")
    ap.add_argument("--cpu-bf16", action="store_true", help="with --device cpu: keep bf16 (checkpoints with a float32 "
                                                             "master copy, as on a GPU) to time the file and DVC costs")
    ap.add_argument("--generate-devices", help='worker.generate_devices, e.g. "0": generation on its own GPUs')
    ap.add_argument("--train-devices", help='worker.train_devices, e.g. "1": the other stages on these GPUs')
    ap.add_argument("--lora-rank", type=int, default=0, help="R > 0: train.lora.rank R (and 10x train.lr)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    work = Path(args.workdir).resolve()
    t0 = time.perf_counter()
    setup(work, args)
    print(f"set up {work} in {time.perf_counter() - t0:.1f} s", flush=True)

    from rlpipe.run.loop import run_iterations

    rows: list[dict] = []
    header = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "card": card_names(), "args": vars(args)}
    marks = [time.perf_counter()]

    def record(row: dict) -> None:
        marks.append(time.perf_counter())
        seconds = stage_seconds(work)
        compute = sum(s.get("compute", 0.0) for s in seconds.values())
        wall = marks[-1] - marks[-2]
        rows.append({"iteration": row["iteration"], "wall_s": round(wall, 2), "compute_s": round(compute, 2),
                     "ratio": round(wall / compute, 3) if compute else None, "stages": seconds,
                     "run_seconds": row.get("run_seconds"), "dvc_seconds": row.get("dvc_seconds"),
                     "outside_stages_s": round(wall - sum(s["total"] for s in seconds.values()), 2)})
        if args.out:  # after every iteration: a run cut short still leaves its rows
            Path(args.out).write_text(json.dumps({**header, "iterations": rows}, indent=1))
        print(f"iteration {row['iteration']}: wall {wall:.1f} s, pure compute {compute:.1f} s, "
              f"ratio {wall / compute if compute else float('nan'):.3f}; loop {row.get('run_seconds')}; "
              f"dvc {row.get('dvc_seconds')}", flush=True)
        for name, s in seconds.items():
            print(f"  {name:18s} total {s['total']:7.2f}  compute {s.get('compute', 0.0):7.2f}  "
                  f"fixed {s['fixed']:6.2f}  " + " ".join(f"{k}={v}" for k, v in s.items()
                                                          if k not in ("total", "compute", "fixed")), flush=True)

    cwd = os.getcwd()
    os.chdir(work)
    try:
        run_iterations(work, until=args.iterations, commit=False, servers=args.servers,
                       max_staleness=args.max_staleness, on_iteration=record)
    finally:
        os.chdir(cwd)
    result = {**header, "iterations": rows, "total_wall_s": round(marks[-1] - marks[0], 2)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def card_names() -> str | None:
    """The GPUs' names from nvidia-smi: asking torch here, after the run moved CUDA_VISIBLE_DEVICES
    under a torch imported before, fails (seen on a 4-GPU host)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ", ".join(sorted(set(out.stdout.split("\n")) - {""})) or None


if __name__ == "__main__":
    main()
