"""After a weight reload, vLLM samples from the new weights: every tensor of the checkpoint, one at a time.

Why tensor by tensor: after 8 small training steps the old and new weights are close, and a tensor left
behind by the reload (vLLM logs "ParallelLMHead: Failed to load weights" and "RotaryEmbedding: Failed to
load weights" on every reload of a tied-embedding Llama) would hide in the noise. Here each checkpoint
differs from the one loaded before it in a tensor drawn afresh, which moves the sampled tokens' log-probs
by far more than bf16 noise; the reloaded engine's log-probs must equal transformers' on the new weights
and not the old ones. Three shapes (a Llama whose lm_head vLLM ties to the embedding, a Llama with its own
lm_head and biases everywhere, a Qwen2 whose lm_head is the embedding module), three paths (a plain
`reload_weights`; the engine server's wake / reload / sleep at level 2 with CUDA graphs; LoRA adapters
rewritten in place, served at sleep level 1).

Skipped without CUDA or vllm. On the device machine:
    python -m pytest tests/engines/test_vllm_reload_gpu.py -m gpu -s
Set RLPIPE_GPU_REPORT=path.json to get every check's numbers. Every torch computation here runs on the CPU.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.engines.reload_checks import (
    REPORT,
    check,
    checkpoints,
    params,
    place,
    requests_of,
    save,
)
from tests.varied_tiny import redrawn, varied_tiny

pytestmark = pytest.mark.gpu
# Several engines start one after another in this process: vLLM's engine process must be spawned, since a
# fork of a process that has run an engine inherits a CUDA state it cannot use.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _needs_gpu_and_vllm() -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if path := os.environ.get("RLPIPE_GPU_REPORT"):
        Path(path).write_text(json.dumps(REPORT, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama-untied-bias"])
def test_a_reload_replaces_every_tensor(kind, tmp_path):
    """A plain `reload_weights` in a running engine (eager), each saved tensor in turn."""
    _needs_gpu_and_vllm()
    from rlpipe.engines.vllm import VLLMEngine

    tokenizer, steps = checkpoints(tmp_path, kind)
    with VLLMEngine(steps[0][1], dtype="bfloat16", eos_token_ids=[tokenizer.eos_token_id], gpu_memory_utilization=0.2,
                    enforce_eager=True, max_model_len=64) as engine:
        before = steps[0][2]
        for salt, (label, model_dir, now) in enumerate(steps):
            if salt:
                engine.reload_weights(model_dir)
            requests = requests_of(tokenizer, salt)
            check(kind, label, requests, engine.generate(requests, params()), now, before)
            before = now


def test_the_engine_server_wakes_reloads_and_sleeps_with_every_tensor(tmp_path):
    """The engine server's path (EngineHost, as `rlpipe.worker.engine_server` runs it): asleep at level 2
    between requests (weights and KV cache freed), woken, reloaded from the one policy directory that each
    checkpoint replaces, with torch.compile and CUDA graphs on; the tied-embedding Llama whose reload logs
    the two warnings."""
    _needs_gpu_and_vllm()
    from rlpipe.worker.engine_server import EngineHost

    kind = "llama-tied"
    tokenizer, steps = checkpoints(tmp_path, kind)
    settings = {"engine": "vllm", "dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1,
                "gpu_memory_utilization": 0.2, "enable_prefix_caching": True, "enforce_eager": False,
                "max_model_len": 64, "eos_token_ids": [tokenizer.eos_token_id]}
    host = EngineHost(settings, str(steps[0][1]), sleep=True)
    try:
        assert host.asleep
        before = steps[0][2]
        for salt, (label, model_dir, now) in enumerate(steps):
            requests = requests_of(tokenizer, salt)  # each checkpoint written over the last, as train writes its policy
            groups, timings = host.generate(str(place(model_dir, tmp_path / "policy")), requests, params())
            assert timings["wake"] > 0 and timings["reload"] > 0 and timings["sleep"] > 0 and timings["rebuild"] == 0
            check(kind + " (server, compiled)", label, requests, groups, now, before)
            before = now
    finally:
        host.close()


def _adapter(base_dir: Path, out: Path, seed: int):
    """A rank-8 all-linear adapter with every lora_A and lora_B drawn afresh, saved as train saves one; its
    CPU reference (the base with the adapter inside its layers, as train and reference_logprob load it)."""
    from rlpipe.config import LoraConfig
    from rlpipe.models.loading import load_model
    from rlpipe.models.lora.adapter import model_hash
    from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training

    lora = LoraConfig(rank=8, alpha=16.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                      train_embeddings=False)
    peft_model = wrap_for_training(load_model(base_dir, device="cpu", dtype="float32"), lora)
    with torch.no_grad():
        for i, (name, p) in enumerate(peft_model.named_parameters()):
            if "lora_" in name:
                p.copy_(redrawn(name, p, seed=seed * 1000 + i))
    save_adapter(peft_model, out, policy_version=seed, base_path=base_dir, base_hash=model_hash(base_dir))
    return load_model(out, device="cpu", dtype="float32").eval()


def test_the_engine_server_serves_each_adapter_rewritten_in_place(tmp_path):
    """LoRA: the server keeps its base (sleep level 1) and takes each new adapter from the same directory
    (a new vLLM adapter id each time), CUDA graphs on; then the base alone."""
    _needs_gpu_and_vllm()
    from rlpipe.worker.engine_server import EngineHost

    kind = "llama-tied"
    tokenizer, base = varied_tiny(kind, seed=0)
    base_dir = save(base, tokenizer, tmp_path / "base")
    policy = tmp_path / "policy"
    settings = {"engine": "vllm", "dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1,
                "gpu_memory_utilization": 0.2, "enable_prefix_caching": True, "enforce_eager": False,
                "max_model_len": 64, "eos_token_ids": [tokenizer.eos_token_id]}
    host = EngineHost(settings, str(base_dir), sleep=True, max_lora_rank=8)
    try:
        before = base
        for salt, label in enumerate(["adapter 1", "adapter 2 (same directory)", "adapter 3 (same directory)", "base"]):
            now = base if label == "base" else _adapter(base_dir, policy, seed=salt + 1)
            requests = requests_of(tokenizer, salt)
            groups, timings = host.generate(str(base_dir if label == "base" else policy), requests, params())
            assert timings["rebuild"] == 0 and timings["sleep"] > 0
            check(kind + " (LoRA server, compiled)", label, requests, groups, now, before)
            before = now
    finally:
        host.close()
