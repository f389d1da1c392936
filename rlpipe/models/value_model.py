"""Scalar-head models: a transformer body with a linear head giving one number per position.

Two users, one class:
- the PPO critic reads the head at the positions that predict completion tokens, so ``V_t`` is the
  value of the state *before* completion token ``t`` (the same positions the log-probs use);
- the Bradley-Terry reward model reads the head at the last token of prompt+completion.

Why a separate model and not a value head on the policy's body: the critic and the policy then
have their own optimisers, learning rates and checkpoints, a reward or value bug cannot leak into
the policy's representation, and the policy directory stays a plain causal LM that vLLM loads as
is. The price is a second body in memory during training (see docs/ppo.md for the trade-off).

Its batched forward passes (per-token values, sequence scores) are `rlpipe.engines.scalar_head`.

On disk a scalar-head model is a Hugging Face *base model* directory (config.json + safetensors of
e.g. ``LlamaModel``), the tokenizer, ``scalar_head.safetensors`` and ``rlpipe.json`` with
``kind: scalar_head``. Starting from a plain causal-LM directory (the policy or the SFT model)
loads its body (the LM head is dropped) and draws a fresh head from a seed. A LoRA adapter directory
gives its base with the adapter merged (float32, a fresh copy): the critic and the reward model train
their whole body, so an adapter of their own would save nothing in their stages (docs/lora.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from rlpipe.data.io import CHECKPOINT_INFO, atomic_path
from rlpipe.errors import ArtifactError
from rlpipe.models.loading import DTYPES, check_model_dir
from rlpipe.models.lora.adapter import is_adapter_dir

if TYPE_CHECKING:  # the batch type only: the batched passes over this model are rlpipe.engines.scalar_head's
    from rlpipe.engines.logprobs import TokenBatch

HEAD_FILE = "scalar_head.safetensors"
KIND = "scalar_head"


class ScalarHeadModel(torch.nn.Module):
    """``body`` (an HF base model) followed by ``head`` (Linear(hidden, 1), float32)."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Linear):
        super().__init__()
        self.body = body
        self.head = head

    @property
    def config(self) -> Any:
        return self.body.config

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 head output at every position of a right-padded batch."""
        positions_BT = (batch.attention_mask_BT.cumsum(-1) - 1).clamp(min=0)
        hidden_BTH = self.body(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT,
                               position_ids=positions_BT, use_cache=False).last_hidden_state
        return self.head(hidden_BTH.float()).squeeze(-1)


def is_scalar_model_dir(path: str | Path) -> bool:
    return (Path(path) / HEAD_FILE).is_file()


def load_scalar_model(path: str | Path, *, seed: int, device: str, dtype: str = "float32") -> ScalarHeadModel:
    """A saved scalar-head model, or a fresh head on the body of a causal-LM directory.

    Why the fresh head is drawn small (std 1/(hidden+1)) rather than zero: a zero head gives the body
    no gradient on the first step, a large one starts the critic far from the rewards' scale.
    """
    from transformers import AutoModel

    if is_adapter_dir(path):  # a LoRA policy: its base with the adapter merged into a fresh copy, then its body
        from rlpipe.models.loading import merged_model

        lm = merged_model(path).to(DTYPES[dtype])
        body = getattr(lm, lm.base_model_prefix)
        p = Path(path)
    else:
        p = check_model_dir(path)
        try:
            body = AutoModel.from_pretrained(str(p), dtype=DTYPES[dtype], local_files_only=True)
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{p}: could not load a model body for the scalar head: {e}") from None
    hidden = int(body.config.hidden_size)
    head = torch.nn.Linear(hidden, 1, dtype=torch.float32)
    if is_scalar_model_dir(p):
        state = load_file(str(p / HEAD_FILE))
        if state["weight"].shape != head.weight.shape:
            raise ArtifactError(f"{p / HEAD_FILE}: head weight has shape {tuple(state['weight'].shape)}, "
                                f"the body's hidden size needs {tuple(head.weight.shape)}")
        head.load_state_dict(state)
    else:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) / (hidden + 1))
            head.bias.zero_()
    return ScalarHeadModel(body, head).to(device)


def save_scalar_model(model: ScalarHeadModel, tokenizer: Any, out_dir: str | Path, *, info: dict[str, Any]) -> None:
    """Save body, head, tokenizer and ``rlpipe.json`` (``info`` plus kind) atomically."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        model.body.save_pretrained(str(tmp), safe_serialization=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.head.state_dict().items()}, str(tmp / HEAD_FILE))
        tokenizer.save_pretrained(str(tmp))
        (tmp / CHECKPOINT_INFO).write_text(json.dumps({**info, "kind": KIND}, sort_keys=True) + "\n")
