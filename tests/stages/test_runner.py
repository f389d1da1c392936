"""A stage that runs out of GPU memory or of disk ends like any other bad setting: one line saying what to do,
exit 2, and (disk) nothing half-written left behind."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors import SafetensorError

from rlpipe.stages.runner import OUT_OF_MEMORY_SETTINGS, stage_main
from tests.shipped import shipped_params

REPO = Path(__file__).resolve().parents[2]
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

    params = yaml.safe_load(shipped_params().read_text())
    # prepare, advantage and check_params (the params file alone) hold no model: no out-of-memory hint
    stages = {p.stem for p in (REPO / "stages").glob("*.py")} - {"prepare", "advantage", "check_params"}
    assert stages <= OUT_OF_MEMORY_SETTINGS.keys()
    keys = {word.rstrip(",;:") for text in OUT_OF_MEMORY_SETTINGS.values() for word in text.split()
            if "." in word and word.split(".")[0] in params}
    assert keys, "no params key named"
    for key in keys:
        node = params
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not in params.yaml"
            node = node[part]


# ---------------------------------------------------------------------------------------------
# Out of disk
# ---------------------------------------------------------------------------------------------

def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


# Each writer's error as it came out of a full 1 MiB tmpfs on 2026-11-28 (pyarrow 19, polars, safetensors, torch).
FULL_DISK_ERRORS = {
    "pyarrow": (OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device"),
                "[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device"),
    "polars": (pl.exceptions.ComputeError("parquet: File out of specification: underlying IO error: No space left "
                                          "on device (os error 28)"),
               "parquet: File out of specification: underlying IO error: No space left on device (os error 28)"),
    "safetensors": (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                    "Error while serializing: I/O error: No space left on device (os error 28)"),
    "torch.save": (_raised_from(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                                RuntimeError("basic_ios::clear: iostream error")),
                   "torch could not write a file ([enforce fail at inline_container.cc:672] . unexpected pos 576 "
                   "vs 534); the usual cause is a full disk"),
    "wrapped by our code": (_raised_from(RuntimeError("saving the checkpoint failed"),
                                         OSError(errno.ENOSPC, "No space left on device")),
                            "[Errno 28] No space left on device"),
    "quota": (OSError(errno.EDQUOT, "Disk quota exceeded"), "[Errno 122] Disk quota exceeded"),
}


@pytest.mark.parametrize("writer", sorted(FULL_DISK_ERRORS))
def test_a_full_disk_is_one_line_whatever_library_was_writing(writer, capsys, monkeypatch, tmp_path):
    error, cause = FULL_DISK_ERRORS[writer]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 7 * 2**29, 7 * 2**29))
    monkeypatch.chdir(tmp_path)

    @stage_main("train")
    def train():
        raise error

    with pytest.raises(SystemExit) as exit_info:
        train()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"rlpipe train: error: out of disk space: {cause}. The stage's unfinished output was removed (outputs are "
        f"written to a temp file, then renamed); 3.5 GiB are free now on the disk of {tmp_path}. Each iteration's "
        f"checkpoints stay in DVC's cache: prune old ones with iterate.keep_checkpoints or `rlpipe gc --keep K` "
        f"(docs/multi-machine.md), then rerun")


@pytest.mark.parametrize("error", [OSError(errno.EACCES, "Permission denied"),
                                   RuntimeError("unexpected pos in a list we built"),
                                   ValueError("inline_container.cc is only torch's when torch raises it")],
                         ids=["other errno", "similar words", "not a RuntimeError"])
def test_other_write_errors_keep_their_traceback(error):
    @stage_main("train")
    def train():
        raise error

    with pytest.raises(type(error)):
        train()


# A stage's real writers onto a real full disk: a 256 KiB tmpfs mounted in a user and mount namespace.
WRITERS = {
    "parquet": """
        import numpy as np, pyarrow as pa, pyarrow.parquet as pq
        from rlpipe.data.io import atomic_path
        with atomic_path("rollouts.parquet") as tmp:
            pq.write_table(pa.table({"x": np.random.default_rng(0).random(200_000)}), tmp)
    """,
    "json": """
        import random
        from rlpipe.data.io import write_json
        write_json("metrics.json", {"x": [random.Random(0).random() for _ in range(50_000)]})
    """,
    "torch resume state": """
        from pathlib import Path
        import torch
        from rlpipe.training.resume import save_state
        save_state(Path("state"), {"moments": torch.randn(200_000, generator=torch.Generator().manual_seed(0))})
    """,
    "safetensors checkpoint": """
        import torch
        from safetensors.torch import save_file
        from rlpipe.data.io import atomic_path
        with atomic_path("model.safetensors") as tmp:
            save_file({"w": torch.randn(200_000, generator=torch.Generator().manual_seed(0))}, str(tmp))
    """,
}
STAGE = """
import json, os, sys
from rlpipe.stages.runner import stage_main

@stage_main("train")
def write():
{body}

try:
    write()
except SystemExit as e:
    print(json.dumps(sorted(os.listdir("."))))
    sys.exit(e.code)
"""


MOUNT_SMALL_DISK = 'mount -t tmpfs -o size=256k tmpfs "$1" && cd "$1" && exec "$2" -c "$3"'


@pytest.fixture(scope="module")
def small_disk_namespace(tmp_path_factory):
    """Skip where no user and mount namespace may mount a tmpfs (a container without the rights)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux) to mount a small disk with")
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", MOUNT_SMALL_DISK, "sh",
                            str(tmp_path_factory.mktemp("probe")), sys.executable, "pass"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small disk in a user and mount namespace here: {probe.stderr.decode().strip()}")


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_stage_writing_onto_a_full_disk_leaves_nothing_and_says_so(writer, small_disk_namespace, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = STAGE.format(body=textwrap.indent(textwrap.dedent(WRITERS[writer]), "    "))
    run = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", MOUNT_SMALL_DISK, "sh", str(disk),
                          sys.executable, script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("rlpipe train: error: out of disk space: "), run.stderr
    assert ("No space left on device" in last) or ("torch could not write a file" in last)
    assert re.search(rf" (0\.[0-9]|1\.0) MiB are free now on the disk of {re.escape(str(disk))}\. Each iteration", last)
    assert json.loads(run.stdout) == []  # no temp file or half-written output on the full disk
