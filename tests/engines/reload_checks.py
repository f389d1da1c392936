"""Weight-reload checks shared by the GPU test (vLLM) and the CPU test (the HF engine behind the engine server).

Each checkpoint differs from the one loaded before it in a tensor drawn afresh, which moves the sampled
tokens' log-probs by far more than bf16 noise; an engine that left that tensor behind samples with
log-probs of the old weights, not of the new ones. Every torch computation here runs on the CPU.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from tests.varied_tiny import redrawn, reference_logprobs, varied_tiny

MAX_NEW = 16
LOGPROB_MEAN_TOL = 0.04  # |vLLM bf16 - CPU fp32 reference|, mean over sampled tokens (tests/engines/test_vllm_gpu.py)
LOGPROB_P99_TOL = 0.15
VISIBLE = 0.1  # a check proves something only if the new tensor moves the reference's log-probs at least this much
REPORT: dict[str, dict] = {}


def saved_tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def checkpoints(root: Path, kind: str):
    """(tokenizer, [(label, model dir, CPU reference model)]): the base, then per saved tensor a checkpoint
    with that tensor drawn afresh, then one with every tensor drawn afresh, then the base again."""
    tokenizer, base = varied_tiny(kind, seed=0)
    base_dir = root / kind / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    steps = [("base", base_dir, base)]
    names = saved_tensor_names(base_dir)
    everything = copy.deepcopy(base)
    for i, name in enumerate(names):
        changed = copy.deepcopy(base)
        with torch.no_grad():
            changed.state_dict()[name].copy_(redrawn(name, changed.state_dict()[name], seed=1000 + i))
            everything.state_dict()[name].copy_(redrawn(name, everything.state_dict()[name], seed=2000 + i))
        steps.append((name, save(changed, tokenizer, root / kind / f"t{i:02d}"), changed))
    steps.append(("every tensor", save(everything, tokenizer, root / kind / "all"), everything))
    steps.append(("base again", base_dir, base))
    return tokenizer, steps


def save(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def requests_of(tokenizer, salt: int):
    from rlpipe.engines.base import PromptRequest, derive_seed

    texts = ("12+34=", "7+8=", "99+1=", "40+55=", "3+", "1")
    return [PromptRequest(tuple(tokenizer(t)["input_ids"]), seed=derive_seed(salt, i), n=4) for i, t in enumerate(texts)]


def params():
    from rlpipe.engines.base import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)


def check(kind: str, label: str, requests, groups, now, before, *, mean_tol: float = LOGPROB_MEAN_TOL,
          p99_tol: float = LOGPROB_P99_TOL) -> None:
    """The sampled tokens' log-probs are those of ``now`` (within ``mean_tol``: bf16 noise on a GPU), far from
    those of ``before``; the numbers go to REPORT[kind][label]."""
    prompts = [r.prompt_token_ids for r, g in zip(requests, groups) for _ in g]
    completions = [c for g in groups for c in g]
    tokens = [c.token_ids for c in completions]
    got = [x for c in completions for x in c.sampler_logprobs]
    ref_now = [x for row in reference_logprobs(now, prompts, tokens, temperature=1.0) for x in row]
    ref_before = [x for row in reference_logprobs(before, prompts, tokens, temperature=1.0) for x in row]
    gaps = sorted(abs(a - b) for a, b in zip(got, ref_now))
    to_now = sum(gaps) / len(gaps)
    to_before = sum(abs(a - b) for a, b in zip(got, ref_before)) / len(got)
    moved = sum(abs(a - b) for a, b in zip(ref_now, ref_before)) / len(got)
    p99 = gaps[int(0.99 * (len(gaps) - 1))]
    REPORT.setdefault(kind, {})[label] = {"tokens": len(got), "to_new": round(to_now, 5), "p99_to_new": round(p99, 5),
                                          "to_old": round(to_before, 5), "new_vs_old": round(moved, 5)}
    if before is not now:
        assert moved > VISIBLE, f"{kind} {label}: the new weights move the log-probs by only {moved:.3f}"
        assert to_before > 3 * to_now, f"{kind} {label}: vLLM is as close to the old weights ({to_before:.3f})"
    assert to_now < mean_tol and p99 < p99_tol, \
        f"{kind} {label}: vLLM's log-probs are {to_now:.3f} (p99 {p99:.3f}) from the new weights'"


def place(src: Path, dest: Path) -> Path:
    """Put checkpoint ``src`` at ``dest`` as train writes its policy: a fresh copy renamed over the old one."""
    from rlpipe.data.io import atomic_path

    with atomic_path(dest) as tmp:
        shutil.copytree(src, tmp, copy_function=shutil.copyfile)
    return dest
