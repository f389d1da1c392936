"""Start, find and stop the project's servers (`rlpipe worker start|stop|status`, and `rlpipe run`).

Each server is a detached process (its own session, so a Ctrl-C meant for `dvc repro` does not reach
it) logging to ``.rlpipe/worker/<kind>.log``. It is found through its abstract socket address,
derived from the project directory, so nothing on disk can point at a dead server.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from rlpipe.errors import RlpipeError
from rlpipe.worker import wire

LOG_DIR = ".rlpipe/worker"
KINDS = ("stage", "engine", "train-engine")  # train-engine: evaluate's engine on the training GPUs (rlpipe.run.servers)
ENGINE_KINDS = ("engine", "train-engine")


@dataclass(frozen=True)
class ServerInfo:
    kind: str
    address: str
    pid: int
    detail: dict


def status(kind: str, project: str | os.PathLike) -> ServerInfo | None:
    """The running server of this kind for the project, or None."""
    addr = wire.address(kind, project)
    try:
        sock = wire.connect(addr, timeout=5.0)
    except OSError:
        return None
    try:
        wire.send_json(sock, {"control": "status"})
        reply = wire.recv_json(sock)
    except OSError:
        return None
    finally:
        sock.close()
    if reply is None:
        return None
    return ServerInfo(kind=kind, address=wire.printable(addr), pid=int(reply[0]["pid"]), detail=reply[0])


def warm(project: str | os.PathLike, model_dirs: list[str]) -> None:
    """Have the project's stage server warm transformers for these model dirs (no-op without a server)."""
    try:
        sock = wire.connect(wire.address("stage", project), timeout=5.0)
    except OSError:
        return
    try:
        wire.send_json(sock, {"control": "warm", "dirs": model_dirs})
        wire.recv_json(sock)
    except OSError:
        pass
    finally:
        sock.close()


def stop(kind: str, project: str | os.PathLike, *, timeout: float = 30.0) -> bool:
    """Ask the server to stop (it kills any stage it is running); True if one was running."""
    addr = wire.address(kind, project)
    try:
        sock = wire.connect(addr, timeout=5.0)
    except OSError:
        return False
    try:
        wire.send_json(sock, {"control": "stop"})
        wire.recv_json(sock)
    except OSError:
        pass
    finally:
        sock.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and status(kind, project) is not None:
        time.sleep(0.05)
    return True


@dataclass
class Launched:
    """A server process started by `launch`, not yet known to answer (`wait_until_serving`)."""
    kind: str
    root: Path
    proc: subprocess.Popen
    log_path: Path


def start(kind: str, project: str | os.PathLike, args: list[str], *, timeout: float = 900.0,
          env: dict[str, str] | None = None, owner: int | None = None) -> ServerInfo:
    """Start server ``kind`` for the project (``args``: its extra command-line options) and wait until it answers.

    ``owner``: a pid whose exit ends the server (`rlpipe run` passes its own, so a killed run leaves
    no server behind); None: it runs until `stop` (`rlpipe worker start`).

    Returns the running server's info; a server already running is left as it is. Waits for the
    warm-up (seconds for the stage server; for a vLLM engine server the engine start and its
    compilation, minutes on a cold machine), and fails with the tail of its log if it exits first.
    """
    started = launch(kind, project, args, env=env, owner=owner)
    return started if isinstance(started, ServerInfo) else wait_until_serving(started, timeout=timeout)


def launch(kind: str, project: str | os.PathLike, args: list[str], *, env: dict[str, str] | None = None,
           owner: int | None = None) -> ServerInfo | Launched:
    """`start` without the wait: the running server's info, or the process just started (two engines
    on different GPUs start side by side this way)."""
    running = status(kind, project)
    if running is not None:
        return running
    root = Path(project).resolve()
    log_path = root / LOG_DIR / f"{kind}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    module = "rlpipe.worker.engine_server" if kind in ENGINE_KINDS else "rlpipe.worker.stage_server"
    # -P: no working directory on the module path, so `rlpipe` resolves as it does for `python stages/x.py`
    # (whose path starts at stages/), whatever the project directory holds.
    if kind in ENGINE_KINDS:  # vLLM's compile cache under the project, as the stages set it (rlpipe/stages/runner.py)
        env = dict(os.environ if env is None else env)
        env.setdefault("VLLM_CACHE_ROOT", str(root / ".rlpipe" / "cache" / "vllm"))
    with open(log_path, "ab") as log:
        own = ([] if owner is None else ["--owner", str(owner)]) + (["--kind", kind] if kind in ENGINE_KINDS else [])
        proc = subprocess.Popen([sys.executable, "-P", "-m", module, "--project", str(root), *own, *args], cwd=root,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                env=env)
    return Launched(kind, root, proc, log_path)


def wait_until_serving(started: Launched, *, timeout: float = 900.0) -> ServerInfo:
    """Wait until a launched server answers; fails with the tail of its log if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = status(started.kind, started.root)
        if info is not None:
            return info
        if started.proc.poll() is not None:
            tail = started.log_path.read_text(errors="replace").splitlines()[-15:]
            raise RlpipeError(f"the {started.kind} server exited with code {started.proc.returncode} while starting; "
                              f"the end of {started.log_path}:\n" + "\n".join(tail))
        time.sleep(0.1)
    started.proc.kill()
    raise RlpipeError(f"the {started.kind} server did not answer within {timeout:.0f} s (log: {started.log_path})")


@contextmanager
def serving(kind: str, project: str | os.PathLike, args: list[str], *, env: dict[str, str] | None = None
            ) -> Iterator[ServerInfo]:
    """A server for the duration of a block: started if none runs, stopped afterwards only if started here."""
    already = status(kind, project)
    info = already or start(kind, project, args, env=env, owner=os.getpid())
    try:
        yield info
    finally:
        if already is None:
            stop(kind, project)
