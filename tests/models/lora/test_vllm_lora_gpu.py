"""vLLM with a LoRA adapter on a real GPU: it samples the adapter's distribution (not the base's), with the
sampler-vs-trainer gap of bf16 vLLM, reported as `sampler_mismatch_*`. Skipped without CUDA or vllm.

    python -m pytest tests/models/lora/test_vllm_lora_gpu.py -m gpu -s      (RLPIPE_GPU_REPORT=path.json for the numbers)

As in tests/engines/test_vllm_gpu.py, nothing here touches CUDA before vLLM starts: the references are
CPU float32 forward passes of the same (bf16-rounded) weights.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.varied_tiny import varied_tiny_llama

pytestmark = pytest.mark.gpu

LOGPROB_MEAN_TOL = 0.04  # as tests/engines/test_vllm_gpu.py: bf16 vLLM against fp32, weights of std 0.15


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from rlpipe.config import LoraConfig
    from rlpipe.models.lora.adapter import model_hash
    from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training

    root = tmp_path_factory.mktemp("lora_vllm")
    os.chdir(root)  # the adapter's base path is relative to the project root
    tokenizer, model = varied_tiny_llama(seed=0)
    model.save_pretrained("base")
    tokenizer.save_pretrained("base")
    lora = LoraConfig(rank=8, alpha=16.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                      train_embeddings=False)
    peft_model = wrap_for_training(model, lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16).float())
    save_adapter(peft_model, "adapter", policy_version=1, base_path="base", base_hash=model_hash("base"))
    prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+8=", "99+1=", "40+55=")]
    return root, tokenizer, prompts


def _cpu_logprobs(model_dir, prompts, completions):
    from rlpipe.models.loading import load_model

    model = load_model(model_dir, device="cpu", dtype="float32")
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids = torch.tensor([list(prompt) + list(completion)])
            lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
            out.append(lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).numpy())
    return out


def test_vllm_samples_through_the_adapter(lora_dirs):
    from rlpipe.config import load_params
    from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
    from rlpipe.stages.generate import make_engine

    root, tokenizer, prompts = lora_dirs
    g = load_params(Path(__file__).resolve().parents[3] / "params.yaml").generate
    import dataclasses

    cfg = dataclasses.replace(g, engine="vllm", device="cuda", dtype="bfloat16",
                              vllm=dataclasses.replace(g.vllm, gpu_memory_utilization=0.3, enforce_eager=True,
                                                       max_model_len=64))
    engine = make_engine(cfg, engine="vllm", model_dir="adapter", eos_token_ids=[tokenizer.eos_token_id],
                         pad_token_id=tokenizer.pad_token_id)
    requests = [PromptRequest(tuple(p), seed=derive_seed(0, i), n=8) for i, p in enumerate(prompts)]
    groups = engine.generate(requests, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12))
    engine.close()
    rows = [(r.prompt_token_ids, c) for r, g_ in zip(requests, groups) for c in g_]
    sampler = np.concatenate([np.asarray(c.sampler_logprobs) for _, c in rows])
    adapter = np.concatenate(_cpu_logprobs("adapter", [p for p, _ in rows], [c.token_ids for _, c in rows]))
    base = np.concatenate(_cpu_logprobs("base", [p for p, _ in rows], [c.token_ids for _, c in rows]))
    report = {"sampler_mismatch_mean_abs": float(np.abs(sampler - adapter).mean()),
              "sampler_mismatch_max_abs": float(np.abs(sampler - adapter).max()),
              "base_mismatch_mean_abs": float(np.abs(sampler - base).mean()), "tokens": int(sampler.size)}
    print(json.dumps(report))
    if path := os.environ.get("RLPIPE_GPU_REPORT"):
        Path(path).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    assert report["sampler_mismatch_mean_abs"] < LOGPROB_MEAN_TOL
    assert report["base_mismatch_mean_abs"] > 5 * report["sampler_mismatch_mean_abs"]  # the adapter was applied
