"""`rlpipe init`'s settings from the model's size (rlpipe/project/sizing.py): counted, banded, said."""
from __future__ import annotations

import pytest

from rlpipe.project.sizing import count_parameters, describe, fitting_settings


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "m")
    # embeddings 50x16 + head 16x50 + final norm 16 + 2 layers of (q,k,v,o 4x16x16, mlp 3x16x32, 2 norms x16)
    expected = 50 * 16 * 2 + 16 + 2 * (4 * 16 * 16 + 3 * 16 * 32 + 2 * 16)
    assert count_parameters(tmp_path / "m") == expected == sum(p.numel() for p in model.parameters())
    (tmp_path / "m" / "model.safetensors").unlink()  # no weights: built from config.json on the meta device
    assert count_parameters(tmp_path / "m") == expected
    (tmp_path / "m" / "config.json").write_text("{}")
    assert count_parameters(tmp_path / "m") is None


def test_bands_follow_trl_and_verl_from_100m_and_keep_rlpipes_below():
    assert fitting_settings(5_000_000, samples_per_iteration=4096) == {}
    # 0.5B: lr 1e-6, one epoch, a quarter of the 512 x 8 samples per optimizer step, 16 per micro-batch
    assert fitting_settings(494_000_000, samples_per_iteration=512 * 8) == {
        "train.lr": 1e-6, "train.epochs": 1, "train.micro_batch_size": 16, "train.minibatch_size": 1024}
    seven = fitting_settings(7_600_000_000, samples_per_iteration=24 * 8)  # 24 prompts x 8: 48 a step
    assert (seven["train.micro_batch_size"], seven["train.minibatch_size"], seven["train.gradient_checkpointing"]) == (
        8, 48, True)
    assert fitting_settings(32_000_000_000, samples_per_iteration=8)["train.minibatch_size"] == 4  # one micro-batch


@pytest.mark.parametrize("count, line", [
    (527_000, ("model: 0.53M parameters (under 100M parameters): kept rlpipe's defaults, tuned on the tiny default; "
               "no RL framework publishes settings this small (train.lr 0.0001, train.epochs 2); if the rewards do not "
               "move, raise train.lr (docs/your-own-model.md)")),
    (1_540_000_000, ("model: 1.54B parameters (1B-10B parameters): train.lr 1e-06, train.epochs 1, "
                     "train.micro_batch_size 8, train.gradient_checkpointing True, train.minibatch_size 1024, from "
                     "TRL's GRPOConfig and verl's Qwen2.5-3B/7B examples (docs/your-own-model.md)")),
])
def test_init_says_what_it_chose_and_why(count, line):
    chosen = fitting_settings(count, samples_per_iteration=4096)
    assert describe(count, chosen, {"train.lr": 1e-4, "train.epochs": 2}) == line
