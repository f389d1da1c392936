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


def varied_tiny(kind: str, seed: int = 0):
    """(character tokenizer, float32 model with bf16-representable weights) of one of the shapes whose weight
    reload the GPU tests prove: ``llama-tied`` (vLLM ties its own lm_head module to the embedding),
    ``llama-untied-bias`` (a separate lm_head, biases in attention and MLP) and ``qwen2-tied`` (Qwen2.5's small
    shapes: q/k/v biases, grouped KV heads, lm_head *is* the embedding module)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from rlpipe.tiny import TASK_ALPHABET, build_char_tokenizer

    if kind == "llama-tied":
        return varied_tiny_llama(seed)
    tokenizer = build_char_tokenizer(TASK_ALPHABET)
    shape = {"vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 64, "bos_token_id": tokenizer.bos_token_id,
             "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if kind == "llama-untied-bias":
        model = LlamaForCausalLM(LlamaConfig(**shape, num_key_value_heads=4, tie_word_embeddings=False,
                                             attention_bias=True, mlp_bias=True))
    elif kind == "qwen2-tied":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2, tie_word_embeddings=True))
    else:
        raise ValueError(f"unknown tiny kind {kind!r}")
    state = {name: redrawn(name, p, seed=seed * 1000 + i) for i, (name, p) in enumerate(model.state_dict().items())}
    model.load_state_dict(state)
    return tokenizer, model.eval()


def redrawn(name: str, tensor: torch.Tensor, *, seed: int) -> torch.Tensor:
    """A fresh draw for one weight tensor, bf16-representable: matrices and biases of std 0.15 (varied samples,
    see above), norm scales uniform in [0.5, 1.5] (a redrawn norm moves the log-probs as much as a matrix)."""
    generator = torch.Generator().manual_seed(seed)
    if "norm" in name:
        new = 0.5 + torch.rand(tensor.shape, generator=generator)
    else:
        new = torch.randn(tensor.shape, generator=generator) * 0.15
    return new.to(torch.bfloat16).to(torch.float32)


def reference_logprobs(model, prompts, completions, *, temperature, top_k=0, top_p=1.0):
    """Per completion, the log-prob of each token under the CPU fp32 model: full softmax of logits / T,
    or, with top_k / top_p, the distribution renormalised over the kept tokens (the HF engine's filter)."""
    from rlpipe.engines.hf import filter_logits

    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids = torch.tensor([list(prompt) + list(completion)])
            logits_TV = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            logits_TV = filter_logits(logits_TV, top_k=top_k, top_p=top_p)
            lp_TV = torch.log_softmax(logits_TV, dim=-1)
            out.append(lp_TV.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist())
    return out
