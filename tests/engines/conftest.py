"""A tiny random Llama (vocab 32, ~50k parameters) saved once per test session."""
from pathlib import Path

import pytest
import torch

VOCAB = 32  # test modules repeat these three numbers (tests/engines is not a package)
EOS_ID = 2
PAD_ID = 0


def build_tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform next-token distributions; sharpen them so that sampling,
    # greedy and top-k/top-p behave differently enough to be told apart in tests.
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
