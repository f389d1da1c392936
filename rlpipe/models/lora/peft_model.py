"""LoRA with PEFT: wrap a causal LM for training, put an adapter over its loaded base, save the adapter.

Why PEFT: it is the field's format (TRL, verl, OpenRLHF, prime-rl and vLLM's LoRA loader all read
``adapter_config.json`` + ``adapter_model.safetensors``), so an rlpipe adapter is served, merged or
shared with the usual tools, and its layers are what those tools test.

The adapters live inside the causal LM's own layers (PEFT injects them in place), so the rest of
rlpipe runs ``peft_model.get_base_model()``: the same transformers module, forward and LM head as
a full model, with the adapters applied. The training weights are never merged: a bf16
merge/unmerge cycle drifts the base (2.4e-4 after one cycle, 1.5e-2 after 1,000; TRL #6688).
Merging happens only into a fresh float32 copy (`rlpipe.models.loading.merged_model`: export, a critic's or
reward model's starting body). Loading a base model is `rlpipe.models.loading`'s: this module wraps models
it is handed, so the loader may use it without a circle.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlpipe.config import LoraConfig
from rlpipe.data.io import CHECKPOINT_INFO, atomic_path
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.models.lora.adapter import ADAPTER_CONFIG, adapter_config, adapter_record

ALL_LINEAR = "all-linear"


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA needs the peft package: pip install 'rlpipe[lora]'") from e
    return peft


def _module_name(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name.rsplit(".", 1)[-1]
    return None


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every Linear layer but the LM head: what ``all-linear`` targets."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def modules_to_save(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Names of the modules trained in full beside the adapter (train_lm_head, train_embeddings)."""
    head = _module_name(model, model.get_output_embeddings())
    embed = _module_name(model, model.get_input_embeddings())
    if getattr(model.config, "tie_word_embeddings", False) and lora.train_lm_head != lora.train_embeddings:
        raise ConfigError("train.lora.train_lm_head: the model ties its LM head to its input embeddings (one weight); "
                          "set train.lora.train_lm_head and train.lora.train_embeddings alike")
    return [n for n, on in ((embed, lora.train_embeddings), (head, lora.train_lm_head)) if on and n]


def peft_config(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """The PEFT ``LoraConfig`` of ``train.lora`` for ``model``; a target module that matches nothing is an error."""
    targets = lora.target_modules
    if targets != ALL_LINEAR:
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        unknown = [t for t in targets if t not in names]
        if unknown:
            raise ConfigError(f"train.lora.target_modules: {unknown} match no module of {type(model).__name__}; "
                              f"its linear layers are {linear_module_names(model)} (or use all-linear)")
        targets = list(targets)
    save = modules_to_save(model, lora)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return _peft().LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                              target_modules=targets, modules_to_save=save or None, bias="none",
                              task_type="CAUSAL_LM", ensure_weight_tying=bool(save) and tied)


def wrap_for_training(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """A fresh adapter on ``model`` (frozen): A drawn from torch's seeded generator, B zero, so the
    wrapped model starts as exactly the base model (PEFT's default LoRA init)."""
    return _peft().get_peft_model(model, peft_config(model, lora))


def check_adapter_matches(path: str | os.PathLike, lora: LoraConfig) -> None:
    """Refuse to continue training an adapter whose shape ``train.lora`` no longer describes."""
    cfg = adapter_config(path)
    where = Path(path) / ADAPTER_CONFIG
    if int(cfg.get("r", 0)) != lora.rank:
        raise ConfigError(f"train.lora.rank: {lora.rank}, but the policy to continue ({where}) has rank {cfg.get('r')}; "
                          "a rank change starts a new adapter over the base: point policy.latest_path at the base")
    if float(cfg.get("lora_alpha", 0)) != lora.alpha:
        raise ConfigError(f"train.lora.alpha: {lora.alpha}, but {where} has lora_alpha {cfg.get('lora_alpha')}")
    have = cfg.get("target_modules")
    want = lora.target_modules
    if want != ALL_LINEAR and isinstance(have, list) and sorted(have) != sorted(want):
        raise ConfigError(f"train.lora.target_modules: {list(want)}, but {where} targets {sorted(have)}")


def apply_adapter(model: Any, path: str | os.PathLike, *, base_path: str | os.PathLike, device: str,
                  trainable: bool = False) -> Any:
    """The PEFT model of adapter directory ``path`` over ``model``, its loaded base (from ``base_path``).

    ``trainable``: the adapter's weights require grad (train continues it); else inference mode.
    """
    try:
        peft_model = _peft().PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except (OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{path}: could not load the LoRA adapter over {base_path}: {e}") from None
    return peft_model.to(device)


@dataclass
class LoraStart:
    """What train trains with ``train.lora``: the PEFT model and the base the adapter belongs to."""
    peft_model: Any
    base_path: Path
    base_hash: str
    continued: bool  # True: the start policy was an adapter, trained further; False: a fresh adapter

    def metrics(self) -> dict[str, Any]:
        params = list(self.peft_model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        return {"base_model_path": str(self.base_path), "continued": self.continued,
                "trainable_parameters": int(trainable), "total_parameters": int(sum(p.numel() for p in params))}


def dropout_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """LoRA's dropout layers: switched to train mode for the optimizer steps only (see training/loop.py)."""
    return [m for name, m in model.named_modules() if name.split(".")[-2:-1] == ["lora_dropout"]
            and isinstance(m, torch.nn.Dropout)]


def save_adapter(peft_model: Any, out_dir: str | os.PathLike, *, policy_version: int,
                 base_path: str | os.PathLike, base_hash: str) -> None:
    """Write the adapter in PEFT's format plus rlpipe.json (policy version, base path and hash), atomically.

    Float32 adapter weights (megabytes, so no separate master copy); no tokenizer or config.json: the
    base's are used. PEFT's model card (README.md) is left out: it holds nothing rlpipe reads. The
    bytes are deterministic: lists of module names in adapter_config.json are sorted.
    """
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        peft_model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "README.md").unlink(missing_ok=True)
        cfg = json.loads((tmp / ADAPTER_CONFIG).read_text())
        cfg["base_model_name_or_path"] = str(base_path)
        for key, value in cfg.items():  # PEFT writes module-name sets (all-linear) in hash order: sort them,
            if isinstance(value, list) and all(isinstance(v, str) for v in value):  # so equal adapters are equal bytes
                cfg[key] = sorted(value)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        record = adapter_record(policy_version=policy_version, base_path=base_path, base_hash=base_hash)
        (tmp / CHECKPOINT_INFO).write_text(json.dumps(record, sort_keys=True) + "\n")
