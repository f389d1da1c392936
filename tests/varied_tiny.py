"""The tiny Llama the vLLM GPU tests sample from: random weights of std 0.15, rounded to bfloat16.

At the default init (std 0.02) the tied embedding dominates the residual stream and the model repeats
its input token with near-uniform logits; std 0.15 everywhere gives varied samples (logit std ~2, ~45%
of 16-token samples stop on EOS) and greedy paths with clear margins. The weights are rounded to bf16,
the precision vLLM runs them in, so a CPU float32 pass of the same model is the reference.
Everything here runs on the CPU: the tests start vLLM before anything else touches CUDA.
"""
from __future__ import annotations

import torch


def varied_tiny_llama(seed: int = 0):
    """(character tokenizer, float32 model holding bf16-representable weights), deterministic in ``seed``."""
    from rlpipe.tiny import TASK_ALPHABET, build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer(TASK_ALPHABET)
    model = build_tiny_llama(tokenizer, hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512,
                             max_position_embeddings=64, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return tokenizer, model
