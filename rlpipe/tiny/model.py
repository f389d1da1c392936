"""A tiny Llama-type causal LM, built from scratch and deterministic from a seed.

Why Llama: transformers 5.x keeps a saved ``tokenizer.json`` for Llama-type checkpoints (a
Qwen2-type one is reloaded with Qwen's own tokenizer class), and RoPE makes the model's outputs
independent of a constant shift of positions, so left-padded batches need no position fix-up.
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
) -> LlamaForCausalLM:
    """A randomly initialised fp32 LlamaForCausalLM sized to ``tokenizer``'s vocabulary.

    The same arguments give a bit-identical ``state_dict``: the weights are drawn under a forked
    RNG seeded with ``seed``, so building a model neither depends on nor disturbs the caller's
    global torch RNG. Input and output embeddings are tied (at this size the embedding is a
    large share of the parameters and tying costs no accuracy).
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
