"""A stage that runs out of GPU memory ends like any other bad setting: one line naming what to lower, exit 2."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpipe.stage import OUT_OF_MEMORY_SETTINGS, stage_main

REPO = Path(__file__).resolve().parents[1]
# torch's message as an 80 GB H100 printed it for the 1.5B shape's train stage (2026-11-28)
TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 892.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
                 "822.56 MiB is free. Process 2563 has 1.67 GiB memory in use. Including non-PyTorch memory, this "
                 "process has 76.69 GiB memory in use. Of the allocated memory 75.19 GiB is allocated by PyTorch, "
                 "and 788.86 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
                 "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_out_of_memory_in_train_names_the_settings_to_lower(capsys):
    @stage_main("train")
    def train():
        raise torch.OutOfMemoryError(TORCH_MESSAGE)

    with pytest.raises(SystemExit) as exit_info:
        train()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "rlpipe train: error: out of GPU memory: CUDA out of memory. Tried to allocate 892.00 MiB. GPU 0 has a total "
        "capacity of 79.18 GiB of which 822.56 MiB is free. Process 2563 has 1.67 GiB memory in use. Lower "
        "train.max_tokens_per_micro_batch or train.micro_batch_size, or set train.gradient_checkpointing: true "
        "(activations recomputed in backward); under torchrun, FSDP2 shards the model state over the GPUs; a "
        "sleeping generation engine on the same GPU (worker.engine_server) holds some memory too")


def test_other_errors_pass_through_unchanged():
    @stage_main("train")
    def train():
        raise RuntimeError("a bug, with its traceback")

    with pytest.raises(RuntimeError, match="a bug"):
        train()


def test_every_stage_that_runs_torch_has_its_settings_and_they_exist():
    """Each name in the hints is a real params.yaml key, and every stage script is covered."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    stages = {p.stem for p in (REPO / "stages").glob("*.py")} - {"prepare", "advantage"}
    assert stages <= OUT_OF_MEMORY_SETTINGS.keys()
    keys = {word.rstrip(",;:") for text in OUT_OF_MEMORY_SETTINGS.values() for word in text.split()
            if "." in word and word.split(".")[0] in params}
    assert keys, "no params key named"
    for key in keys:
        node = params
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not in params.yaml"
            node = node[part]
