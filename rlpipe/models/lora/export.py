"""`rlpipe export --merge`: a LoRA checkpoint as a standalone Hugging Face model, for serving.

The merge happens in float32 on a fresh copy of the base (W + (alpha / r) B @ A), then the weights
are cast to the base's own dtype, as train saves full checkpoints. Training never merges: this is
the one place an adapter meets its base's weights for good.
"""
from __future__ import annotations

import os

from rlpipe.errors import ArtifactError
from rlpipe.models.lora.adapter import adapter_info, checked_base, is_adapter_dir


def export_merged(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                  base: str | os.PathLike | None = None, dtype: str = "auto") -> dict:
    """Write base + adapter of ``checkpoint`` merged to ``out`` (model, tokenizer, rlpipe.json); returns a summary.

    ``base``: take the base from here instead of the recorded path (its content hash must match).
    ``dtype``: of the written weights; auto = the base's. Nothing is written on any error.
    """
    from rlpipe.models.loading import DTYPES, load_tokenizer, merged_model, save_checkpoint, stored_dtype

    if not is_adapter_dir(checkpoint):
        raise ArtifactError(f"{checkpoint}: not a LoRA adapter directory (no adapter_config.json); a full "
                            "checkpoint is already a standalone model")
    if dtype != "auto" and dtype not in DTYPES:
        raise ArtifactError(f"--dtype: {dtype!r} is not one of {['auto', *DTYPES]}")
    base_path = checked_base(checkpoint, base)
    model = merged_model(checkpoint, base=base_path)
    out_dtype = stored_dtype(base_path) if dtype == "auto" else dtype
    version = int(adapter_info(checkpoint)["policy_version"])
    save_checkpoint(model, load_tokenizer(base_path), out, policy_version=version, dtype=out_dtype)
    return {"base": str(base_path), "dtype": out_dtype, "policy_version": version}
