"""Settings that fit the model: `rlpipe init` picks the learning rate and batch settings from its parameter count.

Why: rlpipe's params.yaml is tuned for the tiny default (a 527k-parameter model, lr 1e-4, two epochs over
256-sequence mini-batches). A real model trained at that rate leaves its pretrained weights within a few
hundred steps; RL frameworks train real models at 1e-6. The values below are theirs, per size band:

- lr 1e-6 and one pass over each batch (1 epoch): TRL's ``GRPOConfig`` defaults (``learning_rate=1e-6``,
  ``num_iterations=1``) and verl's PPO/GRPO examples for Qwen2.5-0.5B to 7B (``actor.optim.lr=1e-6``,
  ``ppo_epochs=1``).
- 4 optimizer steps per iteration: verl's examples split each batch of 1024 prompts into mini-batches of 256
  (``ppo_mini_batch_size``), so mini-batch = a quarter of the iteration's samples.
- gradient checkpointing from 1B on, as verl's 7B examples have it; micro-batches that halve with each band are
  rlpipe's own choice (verl's examples run 4 to 40 sequences per GPU forward, by GPU and lengths).

Below 100M parameters no framework publishes RL settings: such a project keeps rlpipe's own, the tiny
default's, and `rlpipe init` says so.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS_PER_ITERATION = 4  # verl's examples: a batch of 1024 prompts, mini-batches of 256


@dataclass(frozen=True)
class SizeBand:
    below: float  # the band holds models with fewer parameters than this
    name: str
    settings: dict[str, Any]  # params.yaml values by dotted key (the mini-batch size is derived: `fitting_settings`)
    source: str


BANDS = (
    SizeBand(1e8, "under 100M parameters", {},
             "rlpipe's defaults, tuned on the tiny default; no RL framework publishes settings this small"),
    SizeBand(1e9, "100M-1B parameters", {"train.lr": 1e-6, "train.epochs": 1, "train.micro_batch_size": 16},
             "TRL's GRPOConfig and verl's Qwen2.5-0.5B examples"),
    SizeBand(1e10, "1B-10B parameters", {"train.lr": 1e-6, "train.epochs": 1, "train.micro_batch_size": 8,
                                         "train.gradient_checkpointing": True},
             "TRL's GRPOConfig and verl's Qwen2.5-3B/7B examples"),
    SizeBand(math.inf, "10B parameters or more", {"train.lr": 1e-6, "train.epochs": 1, "train.micro_batch_size": 4,
                                                  "train.gradient_checkpointing": True},
             "TRL's GRPOConfig and verl's 32B DAPO recipe"),
)


def size_band(num_parameters: int) -> SizeBand:
    return next(band for band in BANDS if num_parameters < band.below)


def fitting_settings(num_parameters: int, *, samples_per_iteration: int, micro_batch_size: int | None = None
                     ) -> dict[str, Any]:
    """The params.yaml values for a model of ``num_parameters`` (nothing below 100M: rlpipe's own stay).

    ``samples_per_iteration``: prompts per iteration x group size, which the mini-batch size divides into
    `STEPS_PER_ITERATION` optimizer steps (never below one micro-batch: ``micro_batch_size`` when the user
    chose it, else the band's).
    """
    band = size_band(num_parameters)
    if not band.settings:
        return {}
    micro = micro_batch_size or band.settings["train.micro_batch_size"]
    minibatch = max(micro, math.ceil(samples_per_iteration / STEPS_PER_ITERATION))
    return {**band.settings, "train.minibatch_size": minibatch}


def count_parameters(model_dir: str | Path) -> int | None:
    """The parameters stored in a Hugging Face model directory, from its safetensors headers (no weight is read);
    a directory without safetensors is counted by building the model from its config on the meta device.
    None when neither works (init then keeps rlpipe's defaults, and says why)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return sum(_safetensors_parameters(f) for f in files)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - transformers raises many types for a config it cannot build
        return None
    return sum(p.numel() for p in model.parameters())


def _safetensors_parameters(path: Path) -> int:
    """Elements of every tensor in one safetensors file: its header is 8 bytes of length, then JSON of shapes."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def describe(num_parameters: int | None, settings: dict[str, Any], kept: dict[str, Any]) -> str:
    """`rlpipe init`'s line about what it chose and why; ``kept``: the defaults a small model keeps."""
    if num_parameters is None:
        return (f"model: its parameters could not be counted (no safetensors, no config transformers can build): "
                f"kept rlpipe's defaults ({_listed(kept)}); see docs/your-own-model.md for the values by size")
    band = size_band(num_parameters)
    size = f"{num_parameters / 1e9:.2f}B" if num_parameters >= 1e9 else f"{num_parameters / 1e6:.2f}M"
    if not settings:
        return (f"model: {size} parameters ({band.name}): kept {band.source} ({_listed(kept)}); if the rewards "
                "do not move, raise train.lr (docs/your-own-model.md)")
    return f"model: {size} parameters ({band.name}): {_listed(settings)}, from {band.source} (docs/your-own-model.md)"


def _listed(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in settings.items())
