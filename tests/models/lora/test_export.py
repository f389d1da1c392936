"""`rlpipe export --merge CHECKPOINT OUT`: a standalone model whose logits are base + adapter's."""
from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.models.loading import load_model
from rlpipe.models.lora.adapter import model_hash
from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training

from tests.models.lora.conftest import build_base, lora, perturb_adapter

BASE = "artifacts/prepare/model"
IDS = torch.tensor([[3, 4, 12, 5, 6, 13, 7, 1]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def saved_adapter(**over):
    peft_model = wrap_for_training(load_model(BASE, device="cpu", dtype="float32"), lora(**over))
    perturb_adapter(peft_model)
    save_adapter(peft_model, "ckpt", policy_version=3, base_path=BASE, base_hash=model_hash(BASE))


def test_export_merge_gives_the_logits_of_base_plus_adapter(project):
    saved_adapter()
    result = CliRunner().invoke(app, ["export", "--merge", "ckpt", "merged"])
    assert result.exit_code == 0, result.output
    assert (project / "merged/config.json").is_file() and (project / "merged/tokenizer.json").is_file()
    assert not (project / "merged/adapter_config.json").exists()
    assert json.loads((project / "merged/rlpipe.json").read_text())["policy_version"] == 3
    merged = load_model("merged", device="cpu", dtype="float32")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), logits(load_model("ckpt", device="cpu", dtype="float32")),
                               atol=1e-5, rtol=1e-5)


def test_export_merge_with_the_head_trained_in_full(project):
    saved_adapter(train_lm_head=True, train_embeddings=True)
    assert CliRunner().invoke(app, ["export", "--merge", "ckpt", "merged"]).exit_code == 0
    torch.testing.assert_close(logits(load_model("merged", device="cpu", dtype="float32")),
                               logits(load_model("ckpt", device="cpu", dtype="float32")), atol=1e-5, rtol=1e-5)


def test_export_refuses_without_merge_a_full_model_and_a_wrong_base_writing_nothing(project):
    saved_adapter()
    runner = CliRunner()
    no_merge = runner.invoke(app, ["export", "ckpt", "merged"])
    assert no_merge.exit_code == 2 and "pass --merge" in no_merge.output
    full = runner.invoke(app, ["export", "--merge", BASE, "merged"])
    assert full.exit_code == 2 and "not a LoRA adapter directory" in full.output
    build_base(project / "other", seed=9)
    wrong = runner.invoke(app, ["export", "--merge", "ckpt", "merged", "--base", "other"])
    assert wrong.exit_code == 2 and "base_model_hash" in wrong.output and "does not match the base model other" in wrong.output
    assert not (project / "merged").exists()
