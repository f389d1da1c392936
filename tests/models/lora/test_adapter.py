"""rlpipe.models.lora: an adapter saved in PEFT's format loads over its base through the one loader, equals the
in-memory PEFT model, refuses a base with another hash and a target module that does not exist."""
from __future__ import annotations

import json

import pytest
import torch

from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.models.loading import load_model, load_tokenizer, merged_model, model_eos_token_ids, read_model_config
from rlpipe.models.lora.adapter import adapter_info, is_adapter_dir, is_policy_dir, model_hash
from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training

from tests.models.lora.conftest import build_base, lora, perturb_adapter

BASE = "artifacts/prepare/model"
IDS = torch.tensor([[3, 4, 12, 5, 6, 13, 7]])


def trained_adapter(out="ckpt", **over):
    peft_model = wrap_for_training(load_model(BASE, device="cpu", dtype="float32"), lora(**over))
    perturb_adapter(peft_model)
    save_adapter(peft_model, out, policy_version=1, base_path=BASE, base_hash=model_hash(BASE))
    return peft_model


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_a_fresh_adapter_is_the_base(project):
    base = load_model(BASE, device="cpu", dtype="float32")
    expected = logits(base)
    peft_model = wrap_for_training(base, lora())
    assert torch.equal(logits(peft_model.get_base_model()), expected)
    assert all(("lora_" in n) == p.requires_grad for n, p in peft_model.named_parameters())


def test_saved_adapter_is_peft_format_with_base_path_and_hash(project):
    trained_adapter()
    files = sorted(p.name for p in (project / "ckpt").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "rlpipe.json"]
    assert is_adapter_dir("ckpt") and is_policy_dir("ckpt") and not is_adapter_dir(BASE)
    info = adapter_info("ckpt")
    assert info["kind"] == "lora" and info["policy_version"] == 1 and info["base_model_path"] == BASE
    assert info["base_model_hash"] == model_hash(BASE) and info["base_model_hash"].startswith("sha256:")
    assert json.loads((project / "ckpt/adapter_config.json").read_text())["base_model_name_or_path"] == BASE
    # megabytes, not the model: the adapter is far smaller than the base's weights
    assert (project / "ckpt/adapter_model.safetensors").stat().st_size < (project / BASE / "model.safetensors").stat().st_size


def test_the_one_loader_puts_the_adapter_over_its_base(project):
    peft_model = trained_adapter()
    loaded = load_model("ckpt", device="cpu", dtype="float32")
    assert torch.allclose(logits(loaded), logits(peft_model.get_base_model()), atol=1e-6)
    assert not torch.allclose(logits(loaded), logits(load_model(BASE, device="cpu", dtype="float32")), atol=1e-3)
    # config, tokenizer and EOS ids are the base's
    assert read_model_config("ckpt").hidden_size == 32
    assert load_tokenizer("ckpt").vocab_size == load_tokenizer(BASE).vocab_size
    assert model_eos_token_ids("ckpt", load_tokenizer("ckpt")) == model_eos_token_ids(BASE, load_tokenizer(BASE))


def test_disabling_the_adapter_gives_the_base(project):
    """The reference of a LoRA run is the base: the adapter switched off computes exactly what the base does."""
    peft_model = trained_adapter()
    base_logits = logits(load_model(BASE, device="cpu", dtype="float32"))
    with peft_model.disable_adapter():
        assert torch.equal(logits(peft_model.get_base_model()), base_logits)


def test_merged_model_gives_the_adapters_logits(project):
    peft_model = trained_adapter()
    merged = merged_model("ckpt")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(logits(merged), logits(peft_model.get_base_model()), atol=1e-5)


def test_a_base_with_another_hash_is_refused_naming_the_key(project):
    trained_adapter()
    build_base(project / BASE, seed=5)  # prepare re-ran with other weights
    with pytest.raises(ArtifactError, match=r"ckpt/rlpipe.json: base_model_hash sha256:\w+ does not match the base"):
        load_model("ckpt", device="cpu", dtype="float32")


def test_a_missing_base_is_refused_naming_the_key(project):
    trained_adapter()
    info = json.loads((project / "ckpt/rlpipe.json").read_text())
    (project / "ckpt/rlpipe.json").write_text(json.dumps({**info, "base_model_path": "gone/model"}))
    with pytest.raises(ArtifactError, match="base_model_path 'gone/model' is not a model directory"):
        load_model("ckpt", device="cpu", dtype="float32")


def test_an_unknown_target_module_is_refused_naming_the_key(project):
    model = load_model(BASE, device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match=r"train.lora.target_modules: \['q_projj'\] match no module of LlamaForCausalLM; "
                                          r"its linear layers are \['down_proj', 'gate_proj', 'k_proj', 'o_proj'"):
        wrap_for_training(model, lora(target_modules=("q_projj", "v_proj")))


def test_named_target_modules_adapt_only_those(project):
    peft_model = wrap_for_training(load_model(BASE, device="cpu", dtype="float32"), lora(target_modules=("q_proj",)))
    adapted = {n.split(".")[-4] for n, p in peft_model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj"}


def test_lm_head_and_embeddings_train_in_full_beside_the_adapter(project):
    peft_model = trained_adapter(train_lm_head=True, train_embeddings=True)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n in trainable) and any("embed_tokens" in n for n in trainable)
    assert torch.allclose(logits(load_model("ckpt", device="cpu", dtype="float32")),
                          logits(peft_model.get_base_model()), atol=1e-6)


def test_a_tied_head_needs_both_flags_alike(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build_base(tmp_path / "tied", tie=True)
    with pytest.raises(ConfigError, match="train.lora.train_lm_head: the model ties its LM head"):
        wrap_for_training(load_model("tied", device="cpu", dtype="float32"), lora(train_lm_head=True))


def test_a_scalar_head_model_starts_from_an_adapters_merged_body(project):
    """The PPO critic and the reward model accept an adapter as their start: the body is base + adapter."""
    from rlpipe.models.value_model import load_scalar_model

    peft_model = trained_adapter()
    scalar = load_scalar_model("ckpt", seed=0, device="cpu")
    with torch.no_grad():
        hidden = scalar.body(input_ids=IDS).last_hidden_state
        expected = peft_model.get_base_model().model(input_ids=IDS).last_hidden_state
    assert torch.allclose(hidden, expected, atol=1e-5)


def test_adapter_bytes_do_not_depend_on_the_process_hash_seed(project):
    """PEFT keeps all-linear's module names in a set: saved in hash order they would differ between processes."""
    import subprocess
    import sys

    code = ("import torch; from tests.models.lora.test_adapter import trained_adapter; torch.manual_seed(0); "
            "trained_adapter(out={out!r})")
    for seed, out in (("1", "a"), ("2", "b")):
        subprocess.run([sys.executable, "-c", code.format(out=out)], check=True, cwd=project,
                       env={**__import__("os").environ, "PYTHONHASHSEED": seed,
                            "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[3])})
    for name in ("adapter_config.json", "adapter_model.safetensors", "rlpipe.json"):
        assert (project / "a" / name).read_bytes() == (project / "b" / name).read_bytes(), name


def test_a_tied_head_and_embeddings_train_as_one_weight(tmp_path, monkeypatch):
    """Both flags on a tied model: one trainable copy (PEFT's ensure_weight_tying); load and merge keep the tie."""
    monkeypatch.chdir(tmp_path)
    build_base(tmp_path / "tied", tie=True)
    peft_model = wrap_for_training(load_model("tied", device="cpu", dtype="float32"),
                                   lora(train_lm_head=True, train_embeddings=True))
    full = [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(full) == 1 and "embed_tokens" in full[0]
    with torch.no_grad():
        dict(peft_model.named_parameters())[full[0]].add_(0.5)
    perturb_adapter(peft_model)
    inner = peft_model.get_base_model()
    assert torch.equal(inner.get_output_embeddings().weight, inner.get_input_embeddings().weight)
    save_adapter(peft_model, "ckpt", policy_version=1, base_path="tied", base_hash=model_hash("tied"))
    expected = logits(inner)
    assert torch.allclose(logits(load_model("ckpt", device="cpu", dtype="float32")), expected, atol=1e-5)
    assert torch.allclose(logits(merged_model("ckpt")), expected, atol=1e-4)
