"""A tiny Llama with a character tokenizer saved as a project's base model, and LoRA settings for it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpipe.config import LoraConfig

VOCAB_CHARS = "0123456789+="


def lora(**over) -> LoraConfig:
    base = dict(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                train_embeddings=False)
    return LoraConfig(**{**base, **over})


def build_base(path: Path, *, seed: int = 0, tie: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlpipe.tiny.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(VOCAB_CHARS)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # sharper next-token distributions than a random init's
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def perturb_adapter(peft_model, seed: int = 1, scale: float = 0.5) -> None:
    """Give the adapter a non-zero update (a fresh one has B = 0, i.e. it is the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project root (the working directory) holding the base model at artifacts/prepare/model."""
    monkeypatch.chdir(tmp_path)
    build_base(tmp_path / "artifacts/prepare/model")
    return tmp_path
