"""Checkpoints in the policy's own dtype: tied embeddings saved once, the float32 master copy exact."""
import json

import pytest
import torch
from safetensors import safe_open

from rlpipe.errors import ArtifactError
from rlpipe.models.loading import MASTER_DIR, load_trainable_model, save_checkpoint, stored_dtype
from rlpipe.models.master_weights import FORMAT, LOW_BITS_FILE, join, split
from rlpipe.tiny.model import build_tiny_llama
from rlpipe.tiny.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789+= ")


def model_of(tokenizer, tied: bool):
    model = build_tiny_llama(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                             max_position_embeddings=32, seed=3)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 2)
    with torch.no_grad():  # values with bits below bf16's precision, which the master copy must keep
        for p in model.parameters():
            p.add_(1e-4 * torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape).sin())
    return model


def keys(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def tensor(path, key) -> torch.Tensor:
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(key)


def test_a_bf16_checkpoint_of_a_tied_model_saves_the_embedding_once(tokenizer, tmp_path):
    model = model_of(tokenizer, tied=True)
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=4, dtype="bfloat16", master_weights=True)
    top, master = tmp_path / "ckpt/model.safetensors", tmp_path / "ckpt" / MASTER_DIR / LOW_BITS_FILE
    assert keys(top) == set(model.state_dict()) - {"lm_head.weight"}
    with safe_open(str(master), "pt") as f:
        assert f.metadata() == {"format": FORMAT}
    assert {k for k in keys(master) if not k.endswith(".ties")} == keys(top)
    assert all(tensor(master, k).dtype == torch.int16 for k in keys(top))
    assert master.stat().st_size < 0.55 * top.stat().st_size + 4096 * len(keys(top))  # 2 bytes a weight, as bf16
    embedding = tensor(top, "model.embed_tokens.weight")
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, model.model.embed_tokens.weight.detach().to(torch.bfloat16))
    assert stored_dtype(tmp_path / "ckpt") == "bfloat16"
    assert json.loads((tmp_path / "ckpt/rlpipe.json").read_text()) == {
        "dtype": "bfloat16", "master_weights": True, "policy_version": 4}

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16)), name
    exact, loaded_master = load_trainable_model(tmp_path / "ckpt", device="cpu")
    assert loaded_master and exact.lm_head.weight.data_ptr() == exact.model.embed_tokens.weight.data_ptr()
    for name, value in model.state_dict().items():  # float32 bits, not the bf16 rounding
        assert torch.equal(exact.state_dict()[name].view(torch.int32), value.view(torch.int32)), name
    assert any(not torch.equal(value, value.to(torch.bfloat16).float()) for value in model.state_dict().values())


def test_an_untied_model_keeps_both_embeddings(tokenizer, tmp_path):
    model = model_of(tokenizer, tied=False)
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=1, dtype="bfloat16")
    top = tmp_path / "ckpt/model.safetensors"
    assert keys(top) == set(model.state_dict())
    assert torch.equal(tensor(top, "lm_head.weight"), model.lm_head.weight.detach().to(torch.bfloat16))
    assert not torch.equal(tensor(top, "lm_head.weight"), tensor(top, "model.embed_tokens.weight"))
    assert not (tmp_path / "ckpt" / MASTER_DIR).exists()


def bits(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_low_bits_restore_every_float32_exactly_ties_and_edges_included():
    edges = bits(
        0x3F808000,  # a tie between bf16 0x3F80 (even) and 0x3F81: rounds down, difference +0x8000
        0x3F818000,  # a tie between 0x3F81 (odd) and 0x3F82: rounds up, difference -0x8000
        0xBF808000, 0xBF818000,  # the same, negative
        0x00000001, 0x80000001, 0x00008000, 0x0000FFFF,  # the smallest subnormals, a subnormal tie
        0x00000000, 0x80000000,  # +0 and -0
        0x7F7FFFFF, 0xFF7FFFFF,  # the largest finite float32: bf16 rounds it to infinity
        0x7F800000, 0xFF800000,  # infinities
        0x3F80FFFF, 0x3F807FFF,  # just above and below a tie
    )
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(-2**31, 2**31, (100_000,), generator=generator, dtype=torch.int64).to(torch.int32)
    random = random.view(torch.float32)
    random = random[~torch.isnan(random)]
    for master in (edges, random, torch.randn(64, 33, generator=generator) * 1e-3):
        low, ties = split(master)
        assert low.dtype == torch.int16 and low.shape == master.shape
        restored = master.to(torch.bfloat16).to(torch.float32)
        join(restored, low, ties)
        assert torch.equal(restored.view(torch.int32), master.view(torch.int32))
    low, ties = split(edges)
    assert ties.tolist() == [0, 2, 6]  # the ties rounded down to an even bf16: the one difference int16 cannot hold


def test_nan_weights_come_back_exactly(tokenizer, tmp_path):
    """How bf16 rounds a NaN depends on the kernel (this CPU's gives 0xFFFF for every NaN); whichever way,
    the weight comes back bit for bit: as low bits when the difference fits, else as a float32 tensor."""
    nans = bits(0x7FC00001, 0xFFC00001, 0x7F800001)
    parts = split(nans)
    if parts is not None:
        restored = nans.to(torch.bfloat16).float()
        join(restored, *parts)
        assert torch.equal(restored.view(torch.int32), nans.view(torch.int32))
    model = model_of(tokenizer, tied=True)
    with torch.no_grad():
        model.model.norm.weight[:3] = nans
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=1, dtype="bfloat16", master_weights=True)
    master = tmp_path / "ckpt" / MASTER_DIR / LOW_BITS_FILE
    assert ("model.norm.weight.full" in keys(master)) == (parts is None) != ("model.norm.weight" in keys(master))
    exact, _ = load_trainable_model(tmp_path / "ckpt", device="cpu")
    for name, value in model.state_dict().items():
        assert torch.equal(exact.state_dict()[name].view(torch.int32), value.view(torch.int32)), name


def test_low_bits_of_another_model_are_refused(tokenizer, tmp_path):
    model = model_of(tokenizer, tied=True)
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=1, dtype="bfloat16", master_weights=True)
    other = build_tiny_llama(tokenizer, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16,
                             max_position_embeddings=32, seed=3)
    save_checkpoint(other, tokenizer, tmp_path / "other", policy_version=1, dtype="bfloat16", master_weights=True)
    (tmp_path / "other" / MASTER_DIR / LOW_BITS_FILE).write_bytes((tmp_path / "ckpt" / MASTER_DIR / LOW_BITS_FILE).read_bytes())
    with pytest.raises(ArtifactError, match=r"low_bits.safetensors: lm_head.weight is not a float32 weight|low_bits.safetensors: model.\S+ has shape"):
        load_trainable_model(tmp_path / "other", device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "other format"])
def test_a_damaged_low_bits_file_is_a_clear_error(tokenizer, tmp_path, damage):
    model = model_of(tokenizer, tied=True)
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=1, dtype="bfloat16", master_weights=True)
    low_bits = tmp_path / "ckpt" / MASTER_DIR / LOW_BITS_FILE
    if damage == "truncated":
        low_bits.write_bytes(low_bits.read_bytes()[:100])
        expected = r"low_bits.safetensors: not a readable safetensors file"
    else:
        from safetensors.torch import save_file

        save_file({"model.norm.weight": torch.zeros(16, dtype=torch.int16)}, str(low_bits))
        expected = r"low_bits.safetensors: not a rlpipe/bf16-low-bits/1 file"
    with pytest.raises(ArtifactError, match=expected):
        load_trainable_model(tmp_path / "ckpt", device="cpu")


def test_a_float16_checkpoint_keeps_a_float32_model_dir(tokenizer, tmp_path):
    model = model_of(tokenizer, tied=True)
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=1, dtype="float16", master_weights=True)
    assert (tmp_path / "ckpt" / MASTER_DIR / "config.json").is_file()
    exact, loaded_master = load_trainable_model(tmp_path / "ckpt", device="cpu")
    assert loaded_master
    for name, value in model.state_dict().items():
        assert torch.equal(exact.state_dict()[name], value), name
    plain, loaded_master = load_trainable_model(tmp_path / "ckpt" / MASTER_DIR, device="cpu")
    assert not loaded_master


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_low_bits_on_cuda_match_the_cpu(tokenizer, tmp_path):
    """Train saves and loads on the GPU: the CUDA kernels round and restore exactly as the CPU's do."""
    model = model_of(tokenizer, tied=True)
    save_checkpoint(model, tokenizer, tmp_path / "cpu", policy_version=1, dtype="bfloat16", master_weights=True)
    save_checkpoint(model.to("cuda"), tokenizer, tmp_path / "cuda", policy_version=1, dtype="bfloat16",
                    master_weights=True)
    for name in ("model.safetensors", f"{MASTER_DIR}/{LOW_BITS_FILE}"):
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "cuda" / name).read_bytes(), name
    exact, _ = load_trainable_model(tmp_path / "cuda", device="cuda")
    for name, value in model.state_dict().items():
        assert torch.equal(exact.state_dict()[name].view(torch.int32), value.view(torch.int32)), name


def gemma3_of(vocab_size: int):
    """A tiny Gemma 3: it builds its embedding scale (sqrt(hidden)) as a buffer in the dtype it is built in."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=vocab_size, hidden_size=24, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=12, max_position_embeddings=64))


@pytest.mark.parametrize("family, widened_on_device", [("llama", True), ("gemma3", False)])
def test_a_bf16_model_loaded_in_float32_equals_transformers_float32_load(tokenizer, tmp_path, family,
                                                                         widened_on_device):
    """load_model reads a bf16 directory as bf16 and widens it on the device when that is exact (Llama: its
    only built buffer, RoPE's inv_freq, is float32 anyway), and loads in float32 directly when a buffer
    built in bf16 would be rounded (Gemma 3's embedding scale: 4.90625 for sqrt(24) = 4.89898). Either way:
    the same weights, buffers, logits, tie and recorded dtype as transformers' own float32 load."""
    from transformers import AutoModelForCausalLM

    from rlpipe.models.loading import _buffers_are_at_least, load_model

    model = model_of(tokenizer, tied=True) if family == "llama" else gemma3_of(len(tokenizer))
    save_checkpoint(model, tokenizer, tmp_path / "ckpt", policy_version=1, dtype="bfloat16")
    as_bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.bfloat16, local_files_only=True)
    assert _buffers_are_at_least(as_bf16, torch.float32) == widened_on_device
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32, local_files_only=True)
    ours = load_model(tmp_path / "ckpt", device="cpu", dtype="float32")
    assert {n: t.dtype for n, t in ours.state_dict().items()} == {n: torch.float32 for n in theirs.state_dict()}
    for (name, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(theirs.named_buffers(), ours.named_buffers(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.lm_head.weight is ours.get_input_embeddings().weight
    ids = torch.tensor([tokenizer.encode("12+34=")])
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)
    ours.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again/config.json").read_text())["dtype"] == "float32"
