"""Loading and saving HF models and tokenizers from local directories, with clear errors.

No hub access anywhere: a path that is not a local model directory is an error, never a download.
Every model-directory argument may also be a LoRA adapter directory (rlpipe/models/lora): `load_model` is the
one loader that puts the adapter over its base; config, tokenizer and EOS ids come from the base.
The policy version travels inside the checkpoint (``rlpipe.json``) so that a stage can refuse
rollouts that were sampled by a different policy than the one it is given.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from rlpipe.data.io import CHECKPOINT_INFO, atomic_path
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.models.lora.adapter import adapter_info, checked_base, is_adapter_dir, model_dir_of, model_hash

if TYPE_CHECKING:
    from rlpipe.config import LoraConfig
    from rlpipe.models.lora.peft_model import LoraStart

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()  # per-shard bars drown the one summary line per stage


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def setup_torch(threads: int, seed: int) -> None:
    """One place for the process-wide torch settings that affect results.

    CPU kernels are deterministic for a fixed thread count, which is what byte-identical outputs
    need; `torch.use_deterministic_algorithms` is left off: it costs a second of start-up per
    stage and only matters for some CUDA kernels, where rlpipe promises no bit-exactness.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def _missing(p: Path) -> ArtifactError:
    return ArtifactError(f"{p}: model directory not found (rlpipe never downloads models; point policy.path / "
                         "reference.path / prepare.files.tokenizer_path at a local Hugging Face model directory)")


def check_model_dir(path: str | Path) -> Path:
    """The directory holding ``path``'s config.json: ``path``, or the base model of an adapter directory."""
    p = model_dir_of(path) if is_adapter_dir(path) else Path(path)
    if not p.is_dir():
        raise _missing(p)
    if not (p / "config.json").is_file():
        raise ArtifactError(f"{p}: not a Hugging Face model directory (no config.json)")
    return p


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in a model directory (a tokenizer-only directory works too; an adapter's is its base's)."""
    from transformers import AutoTokenizer

    p = model_dir_of(path) if is_adapter_dir(path) else Path(path)
    if not p.is_dir():
        raise _missing(p)
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{p}: could not load a tokenizer: {e}") from None
    if not tok("a b c 1 2 3", add_special_tokens=False)["input_ids"]:
        # transformers builds an empty tokenizer for a model directory without tokenizer files: every prompt
        # would become no token, found only at generate ("prompt_token_ids must not be empty")
        raise ArtifactError(f"{p}: holds no usable tokenizer (text encodes to no token: no tokenizer.json or "
                            "vocabulary files there); save it with the model: tokenizer.save_pretrained(DIR)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # a common gap in base models; padding is masked everywhere anyway
    return tok


def load_model(path: str | Path, *, device: str, dtype: str) -> Any:
    """The causal LM of a model directory, or of an adapter directory: its base (hash-checked) with the
    adapter applied inside its layers (PEFT, unmerged), as a plain transformers module in inference use."""
    if is_adapter_dir(path):
        return load_adapter_model(path, device=device, dtype=dtype).get_base_model()
    p = check_model_dir(path)
    target = DTYPES[dtype]
    # Widen on the device, not on the way there: a bf16 checkpoint that train wants in float32 is read
    # as bf16 (half the bytes to copy to the GPU) and converted by one GPU kernel, where transformers would
    # convert 494M weights on one CPU thread first (~1.5 s for the 0.5B shape). Widening is exact, so the
    # weights are bit-identical; a buffer that the model computes when it is built (RoPE's inv_freq, Gemma 3's
    # embedding scale) is not, when the build ran in bf16: such a model is loaded in float32 directly.
    stored = DTYPES[stored_dtype(p)]
    load_as = stored if stored.itemsize < target.itemsize else target
    model = _from_pretrained(p, load_as)
    if load_as != target and not _buffers_are_at_least(model, target):
        load_as, model = target, _from_pretrained(p, target)
    model = model.to(device)
    if load_as != target:
        model = model.to(target)
        model.config.dtype = target  # what save_pretrained records
    return model


def _from_pretrained(p: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{p}: could not load the model: {e}") from None


def _buffers_are_at_least(model: Any, dtype: torch.dtype) -> bool:
    """Whether every floating-point buffer already has ``dtype``'s precision, so widening the model later
    gives the same buffers as building it in ``dtype``."""
    return all(b.dtype.itemsize >= dtype.itemsize for b in model.buffers() if b.is_floating_point())


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """All ids that end a completion: the tokenizer's EOS plus the generation config's (chat models have several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    if not ids:
        raise ArtifactError("the tokenizer and model define no EOS token; completions could never stop")
    return sorted(ids)


def read_model_config(path: str | Path) -> Any:
    """A model directory's config.json (transformers' AutoConfig), without loading weights."""
    from transformers import AutoConfig

    p = check_model_dir(path)
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{p}: could not read config.json: {e}") from None


def model_eos_token_ids(path: str | Path, tokenizer: Any) -> list[int]:
    """`eos_token_ids` of a model directory without loading its weights.

    Reads generation_config.json, or derives it from config.json when absent, as `from_pretrained` does.
    """
    from transformers import GenerationConfig

    config = read_model_config(path)
    try:
        generation = GenerationConfig.from_pretrained(str(check_model_dir(path)), local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return eos_token_ids(SimpleNamespace(generation_config=generation), tokenizer)


MASTER_DIR = "master"  # the float32 weights for the next train stage only: low bits beside bf16, or a model dir


def stored_dtype(path: str | Path) -> str:
    """The dtype a model directory's config.json records for its weights ("float32" when it records none)."""
    config = json.loads((check_model_dir(path) / "config.json").read_text())
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    return name if name in DTYPES else "float32"


def load_trainable_model(path: str | Path, *, device: str) -> tuple[Any, bool]:
    """The policy in float32 as train starts from it, and whether those are its exact master weights.

    A bf16 checkpoint carries its float32 master weights as the low bits bf16 drops
    (``master/low_bits.safetensors``, `rlpipe.models.master_weights`); a float16 one (and checkpoints written
    before that format) as a float32 model dir in ``master/``; others have none, and their own weights
    are the master.
    """
    from rlpipe.models.master_weights import LOW_BITS_FILE, apply_low_bits

    master = Path(path) / MASTER_DIR
    low_bits = master / LOW_BITS_FILE
    if low_bits.is_file() and not is_adapter_dir(path):
        model = load_model(path, device=device, dtype="float32")
        try:
            apply_low_bits(model, low_bits)
        except ValueError as e:  # the message names the file
            raise ArtifactError(str(e)) from None
        return model, True
    if (master / "config.json").is_file():
        return load_model(master, device=device, dtype="float32"), True
    return load_model(path, device=device, dtype="float32"), False


def _converted_state_dict(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``model``'s state dict in ``dtype``, with tensors that share storage (tied embeddings) converted once.

    Why: converted one by one, the tied input and output embeddings become two tensors, and
    `save_pretrained` then writes both: 0.27 GB more for a Qwen2.5-0.5B shape in bf16 (a 151,936 x 896
    matrix), to write, hash, cache, push and load every iteration. Shared, they are saved once, as in
    the float32 model.
    """
    from rlpipe.models.master_weights import storage_key

    converted: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = storage_key(tensor)
        if key not in converted:
            converted[key] = tensor.detach().to(dtype)
        out[name] = converted[key]
    return out


def save_checkpoint(model: Any, tokenizer: Any, out_dir: str | Path, *, policy_version: int,
                    dtype: str = "float32", master_weights: bool = False) -> None:
    """Save model + tokenizer atomically (temp dir + rename), tagged with the policy version.

    ``dtype``: the precision of the saved weights, which generate, reference_logprob and evaluate load
    (the policy's own, bf16 for most models: half the bytes of float32 to write, cache, push and load).
    ``master_weights``: also save the exact float32 weights in ``master/``, where the next train stage
    starts from (`load_trainable_model`), so an iteration's update is not rounded away (bf16 keeps 8
    significant bits: a change of less than ~0.4% of a weight vanishes when rounded). For bf16, the 16
    bits that rounding dropped (`rlpipe.models.master_weights`: 2 bytes a parameter, not 4); for float16 a
    float32 model dir. vLLM and transformers read only the top-level weights.
    """
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        target = DTYPES[dtype]
        if target == torch.float32:
            model.save_pretrained(str(tmp), safe_serialization=True)
        else:
            converted = _converted_state_dict(model, target)
            if master_weights and target == torch.bfloat16:
                from rlpipe.models.master_weights import LOW_BITS_FILE, save_low_bits

                (tmp / MASTER_DIR).mkdir()
                save_low_bits(model.state_dict(), tmp / MASTER_DIR / LOW_BITS_FILE, rounded=converted)
            elif master_weights:
                model.save_pretrained(str(tmp / MASTER_DIR), safe_serialization=True)
            model.save_pretrained(str(tmp), safe_serialization=True, state_dict=converted)
            # save_pretrained records the in-memory (float32) dtype; loaders with dtype "auto" read this field
            config = json.loads((tmp / "config.json").read_text())
            config.pop("torch_dtype", None)
            config["dtype"] = dtype
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(str(tmp))
        info = {"policy_version": policy_version, "dtype": dtype,
                "master_weights": bool(master_weights and target != torch.float32)}
        (tmp / CHECKPOINT_INFO).write_text(json.dumps(info, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# LoRA adapters over their base (rlpipe/models/lora holds the format and the PEFT wrappers)


def load_adapter_model(path: str | os.PathLike, *, device: str, dtype: str, trainable: bool = False,
                       base: str | os.PathLike | None = None) -> Any:
    """The PEFT model of adapter directory ``path`` over its base (hash-checked), adapter active.

    ``trainable``: the adapter's weights require grad (train continues it); else inference mode.
    ``base``: another directory to take the base from (it must have the recorded content hash).
    """
    from rlpipe.models.lora.peft_model import apply_adapter

    base_path = checked_base(path, base)
    model = load_model(base_path, device=device, dtype=dtype)
    return apply_adapter(model, path, base_path=base_path, device=device, trainable=trainable)


def merged_model(path: str | os.PathLike, *, base: str | os.PathLike | None = None) -> torch.nn.Module:
    """A standalone float32 causal LM: the base with the adapter of ``path`` merged in (a fresh copy, on the CPU)."""
    peft_model = load_adapter_model(path, device="cpu", dtype="float32", base=base)
    return peft_model.merge_and_unload()


def lora_for_training(policy: str | os.PathLike, lora: LoraConfig, *, device: str,
                      replaced: list[str | os.PathLike]) -> LoraStart:
    """The model train optimises with ``train.lora``: the adapter ``policy`` is, continued (its shape must be
    ``lora``'s), or a fresh adapter over the model directory ``policy``, which becomes the base.

    ``replaced``: paths the pipeline overwrites every iteration (the checkpoint, state/, the overlap
    store); a base there would vanish under its adapter, so it is refused. The base is loaded from its
    top-level weights, the ones generate and reference_logprob read (not a float32 ``master/`` copy).
    """
    from rlpipe.models.lora.peft_model import LoraStart, check_adapter_matches, wrap_for_training

    if is_adapter_dir(policy):
        check_adapter_matches(policy, lora)
        info = adapter_info(policy)
        peft_model = load_adapter_model(policy, device=device, dtype="float32", trainable=True)
        return LoraStart(peft_model, Path(info["base_model_path"]), info["base_model_hash"], continued=True)
    here = Path(policy).resolve()
    for path in replaced:
        r = Path(path).resolve()
        if here == r or r in here.parents:
            raise ConfigError(f"train.lora: the start model {policy} (policy.latest_path) would become the adapter's "
                              f"base, but {path} is replaced every iteration; copy it where it stays (e.g. "
                              f"models/base) and point policy.path and policy.latest_path there")
    model = load_model(policy, device=device, dtype="float32")
    return LoraStart(wrap_for_training(model, lora), Path(policy), model_hash(policy), continued=False)
