"""Loading and saving HF models and tokenizers from local directories, with clear errors.

No hub access anywhere: a path that is not a local model directory is an error, never a download.
The policy version travels inside the checkpoint (``rlpipe.json``) so that a stage can refuse
rollouts that were sampled by a different policy than the one it is given.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlpipe.errors import ArtifactError
from rlpipe.io import CHECKPOINT_INFO, atomic_path, read_policy_version  # noqa: F401  (re-exported for stages)

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
    p = Path(path)
    if not p.is_dir():
        raise _missing(p)
    if not (p / "config.json").is_file():
        raise ArtifactError(f"{p}: not a Hugging Face model directory (no config.json)")
    return p


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in a model directory (a tokenizer-only directory works too)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise _missing(p)
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{p}: could not load a tokenizer: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # a common gap in base models; padding is masked everywhere anyway
    return tok


def load_model(path: str | Path, *, device: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype], local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{p}: could not load the model: {e}") from None
    return model.to(device)


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
        generation = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return eos_token_ids(SimpleNamespace(generation_config=generation), tokenizer)


def save_checkpoint(model: Any, tokenizer: Any, out_dir: str | Path, *, policy_version: int) -> None:
    """Save model + tokenizer atomically (temp dir + rename), tagged with the policy version."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / CHECKPOINT_INFO).write_text(json.dumps({"policy_version": policy_version}, sort_keys=True) + "\n")
