"""What every stage entry point shares: error reporting, phase timing, metrics output.

Kept free of torch so that the CPU-only stages (score, advantage) start in well under a second.
Importing it first thing in a stage script is also what hands the stage to a warm stage server
when one runs for the project (rlpipe/worker/stage_server.py).
"""
from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # stage scripts import this module first: ~ the start of the process

import os  # noqa: E402
import sys  # noqa: E402

from rlpipe.worker.stage_client import ENV_STARTED_AT, forward_if_served  # noqa: E402

# With a stage server for this project running (`rlpipe run`, `rlpipe worker start`), hand this stage
# to it and exit with its exit code; otherwise run here, as always (rlpipe/worker/stage_server.py).
forward_if_served(PROCESS_START)
if ENV_STARTED_AT in os.environ:  # a forked child of the server: time from when DVC started the stage
    PROCESS_START = time.perf_counter() - (time.time() - float(os.environ.pop(ENV_STARTED_AT)))

# Compilation caches under the project (stages run from its root), not in /tmp: torch.compile's
# inductor/Triton artifacts and vLLM's compiled graphs then hit across stages, iterations and runs
# (docs/fixed-cost.md). Set before anything imports torch; a user's own setting wins.
for _var, _sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                   ("VLLM_CACHE_ROOT", "vllm")):
    os.environ.setdefault(_var, os.path.abspath(os.path.join(".rlpipe", "cache", _sub)))

import errno  # noqa: E402
import functools  # noqa: E402
import shutil  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

from rlpipe.cluster.node import node_record  # noqa: E402
from rlpipe.data.io import write_json  # noqa: E402
from rlpipe.errors import RlpipeError  # noqa: E402
from rlpipe.stages.headline import headline, headline_path, writes_headline  # noqa: E402


class PhaseTimer:
    """Wall time per phase (imports, read, compute, write), reported in each stage's metrics JSON.

    Why: the iteration's cost is split between real work and fixed costs (process start-up,
    Parquet I/O); the benchmark in BENCHMARKS.md reads these numbers.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"imports": time.perf_counter() - PROCESS_START}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def move(self, seconds: float, *, to: str, source: str = "compute") -> None:
        """Book ``seconds`` of phase ``source`` under ``to`` (compilation measured inside the compute phase)."""
        if seconds > 0:
            self.seconds[source] = self.seconds.get(source, 0.0) - seconds
            self.seconds[to] = self.seconds.get(to, 0.0) + seconds

    def report(self) -> dict[str, float]:
        """Seconds per phase, the process total, and ``fixed`` = total - compute: what the stage costs beyond its
        work (process start, imports, reading, engine start, compilation, writing)."""
        out = {k: round(v, 3) for k, v in self.seconds.items()}
        total = time.perf_counter() - PROCESS_START
        out["total"] = round(total, 3)
        out["fixed"] = round(total - self.seconds.get("compute", 0.0), 3)
        return out


def engine_metrics(engine: Any) -> dict[str, Any]:
    """How a generation engine was provided: by the engine server (and what that cost it), or built here."""
    timings = getattr(engine, "timings", None)
    if timings is None:
        return {"engine_server": False}
    return {"engine_server": True, "engine_server_seconds": timings}


def write_metrics(path: str | Path, stage: str, metrics: dict[str, Any], timer: PhaseTimer) -> None:
    """The stage's metrics file, then its headline beside it (rlpipe/stages/headline.py: what `dvc metrics show`
    prints), when the file is one of the pipeline's."""
    ran_on = node_record()  # a cluster run: the node that ran the stage (rlpipe/cluster/node.py)
    full = _no_negative_zero({"stage": stage, **metrics, **({"cluster": ran_on} if ran_on else {}),
                              "seconds": timer.report()})
    write_json(path, full)
    if writes_headline(path):
        write_json(headline_path(path), headline(stage, full))


def stage_main(stage: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a stage's CLI function: an RlpipeError, or running out of GPU memory or of disk, becomes one
    clear line on stderr and exit code 2; any other exception keeps its traceback (a bug to report)."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except RlpipeError as e:
                print(f"rlpipe {stage}: error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            except Exception as e:
                if _is_out_of_memory(e):
                    message = out_of_memory_message(stage, e)
                elif (cause := out_of_disk_cause(e)) is not None:
                    message = out_of_disk_message(cause)
                else:
                    raise
                print(f"rlpipe {stage}: error: {message}", file=sys.stderr)
                raise SystemExit(2) from None

        return inner

    return wrap


# What to lower when a stage runs out of GPU memory: the settings that size its batches.
OUT_OF_MEMORY_SETTINGS = {
    "generate": "generate.batch_size (HF engine) or generate.vllm.gpu_memory_utilization (vLLM)",
    "evaluate": "evaluate.batch_size (HF engine) or generate.vllm.gpu_memory_utilization (vLLM)",
    "score": "max_tokens_per_batch in the options of a reward_model reward (score.rewards)",
    "reference_logprob": "reference_logprob.max_tokens_per_batch",
    "values": "values.max_tokens_per_batch",
    "train": "train.max_tokens_per_micro_batch or train.micro_batch_size, or set train.gradient_checkpointing: "
             "true (activations recomputed in backward); under torchrun, FSDP2 shards the model state over the GPUs",
    "train_reward_model": "reward_model.batch_size",
}


def _is_out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error, without importing torch in a stage that never did."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _first_line(error: BaseException) -> str:
    """An error's message up to its first line break: torch's and the Rust libraries' go on for lines."""
    return str(error).strip().split("\n")[0]


def out_of_memory_message(stage: str, error: BaseException) -> str:
    """torch's first line (what was asked, what is free, which other processes hold memory) and the settings to lower.

    Why: torch's message names allocator flags, not the stage's batch sizes, and a user's own model on
    a smaller card meets it first in train (the 1.5B shape at 32,768 tokens per micro-batch on an 80 GB H100).
    """
    first = _first_line(error).split(". Including non-PyTorch memory")[0].rstrip(".")
    settings = OUT_OF_MEMORY_SETTINGS.get(stage, "the stage's batch size")
    return (f"out of GPU memory: {first}. Lower {settings}; a sleeping generation engine on the same GPU "
            f"(worker.engine_server) holds some memory too")


# How a full disk reads once a library has wrapped the OS error: Rust's io::Error (safetensors, polars)
# keeps the OS text; torch's file writer keeps none of it, only where its C++ writer stopped.
_OUT_OF_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_OUT_OF_DISK_TEXTS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
_TORCH_WRITER_TEXTS = ("PytorchStreamWriter failed", "inline_container.cc")


def out_of_disk_cause(error: BaseException) -> str | None:
    """The first line of the error in ``error``'s chain that says the disk is full, else None.

    Why: writing a checkpoint or a table onto a full disk surfaces as pyarrow's OSError, a polars
    ComputeError, a SafetensorError or torch's bare "unexpected pos", several frames deep; a user
    needs to read "out of disk" once, not recognise each library's wording.
    """
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        first = _first_line(link)
        if isinstance(link, OSError) and link.errno in _OUT_OF_DISK_ERRNOS:
            return first
        if any(text in first for text in _OUT_OF_DISK_TEXTS):
            return first
        if isinstance(link, RuntimeError) and any(text in first for text in _TORCH_WRITER_TEXTS):
            return f"torch could not write a file ({first}); the usual cause is a full disk"
        link = link.__cause__ or link.__context__
    return None


def out_of_disk_message(cause: str) -> str:
    """The error, that the unfinished output is gone, the room left now, and what takes the room in a project."""
    project = os.getcwd()  # stages run from the project root, and write their outputs under it
    free = shutil.disk_usage(project).free
    room = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
    return (f"out of disk space: {cause}. The stage's unfinished output was removed (outputs are written to a "
            f"temp file, then renamed); {room} are free now on the disk of {project}. Each "
            f"iteration's checkpoints stay in DVC's cache: prune old ones with iterate.keep_checkpoints or "
            f"`rlpipe gc --keep K` (docs/multi-machine.md), then rerun")


def summary_line(stage: str, **fields: Any) -> None:
    """One line per stage at the end: what it did and how long it took."""
    parts = " ".join(f"{k}={_no_negative_zero(v)}" for k, v in fields.items())
    print(f"rlpipe {stage}: {parts}", file=sys.stderr)


def warn(stage: str, message: str) -> None:
    """A line on stderr for a setting that did not do what it says, while the stage goes on."""
    print(f"rlpipe {stage}: warning: {message}", file=sys.stderr)


def _no_negative_zero(value: Any) -> Any:
    """``value`` with every -0.0 in it made 0.0: a rounded tiny negative is no information, and reads as a sign."""
    if isinstance(value, float):
        return value + 0.0  # -0.0 + 0.0 == +0.0; every other float is unchanged
    if isinstance(value, dict):
        return {k: _no_negative_zero(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_negative_zero(v) for v in value]
    return value


def run(app: Callable[[], None]) -> None:
    """Run a stage's CLI app, then exit without Python's tear-down of torch (about 1 s a stage).

    Every output is already complete on disk (atomic renames) when the app returns, so skipping
    the interpreter's module clean-up loses nothing but time.
    """
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
