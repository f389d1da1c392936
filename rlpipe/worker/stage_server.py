"""The stage server: import torch, transformers, polars and pyarrow once, then fork a child per stage command.

Why: on the 2-core CPU box a torch stage spends 5-7 s importing libraries and letting transformers
load its modules lazily (BENCHMARKS.md, "fixed cost"), for less than a second of work; an iteration
starts six such processes. A fork of a process that has done this work once starts in milliseconds.

What makes a child equivalent to a fresh ``python stages/x.py``:
- it gets the stage's own argv, working directory, umask, environment and standard streams (the
  file descriptors themselves, so terminals, pipes and DVC's capture behave as before);
- every ``rlpipe`` module is dropped from ``sys.modules`` and imported again from disk, so an edited
  rlpipe file takes effect at once (only third-party libraries are shared, and they are not rlpipe's
  dependencies in DVC's sense either);
- the server never runs torch, polars or pyarrow computations and never touches CUDA, so no thread
  pool or device context is inherited half-initialised: the child sets its own thread count and
  starts CUDA itself (``setup_torch`` runs in every stage);
- it dies with the server (``PR_SET_PDEATHSIG``), and the server kills it when the process that
  handed it over goes away (DVC killed, kill -9): nothing runs on unobserved.

A stage is declined (and runs in its own process, as before) when it comes from another Python
interpreter or environment, or when an environment variable that shapes imports or thread pools
differs from the server's.

    python -P -m rlpipe.worker.stage_server --project DIR [--warm MODEL_DIR ...] [--warm-compiler] [--idle-timeout S]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import selectors
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

from rlpipe.worker import wire
from rlpipe.worker.stage_client import ENV_CHILD, ENV_STARTED_AT

# Read at import time by the libraries the server imports once: a stage that sets them differently
# must run in its own process.
# (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE and TOKENIZERS_PARALLELISM are not among them: rlpipe.models.loading
# sets all three in every stage, and the server sets them the same way before importing.)
IMPORT_TIME_VARS = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS",
                    "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


# Never imported by the server: the server itself, and what only people run.
_NOT_WARMED = ("rlpipe.worker", "rlpipe.run", "rlpipe.cli")


def warm_imports(*, compiler: bool = False) -> None:
    """Import what stages import: the third-party libraries, and through rlpipe's own modules every
    submodule of them that a stage pulls in (torch.distributed, transformers' attention code, peft...).
    ``compiler``: also torch.compile's dynamo and inductor, for projects whose stages compile their layers.

    The rlpipe modules are only a means: every child drops them and imports them again from disk.
    Nothing here creates a tensor or starts a thread beyond the idle ones numpy, polars and pyarrow start on
    import (checked in tests/e2e/test_warm_servers.py).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import importlib
    import pkgutil

    import numpy  # noqa: F401
    import polars  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    # What pyarrow imports lazily on the first Parquet read (its dataset layer, and pandas when installed):
    # ~300 modules, 0.4 s in every stage's child before these were warmed (issue 12).
    import pyarrow.compute  # noqa: F401
    import pyarrow.dataset  # noqa: F401
    import pyarrow.pandas_compat  # noqa: F401
    try:
        import pandas  # noqa: F401
    except ImportError:
        pass
    import rich.progress  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    # torch.compile's machinery, which every stage that compiles its decoder layers (the GPU default)
    # imports after the fork otherwise: dynamo and inductor are ~1,400 modules, 1.5 s on the 2-core box and
    # 3.9 s with the first compile call in a fresh process on a GPU host (issue 12). Only where a stage
    # compiles: elsewhere they would only lengthen the server's start. A fork needs the CUDA driver
    # untouched: warm_or_restart checks that after warming and restarts without these where it was not.
    if compiler:  # torch.cuda.is_available() through NVML: the driver API's device count initialises CUDA
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in ("torch._dynamo", "torch._dynamo.repro.after_dynamo", "torch._inductor.compile_fx",
                 "torch._inductor.compiler_bisector") if compiler else ():
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an exotic build: the stage that compiles meets it itself
            print(f"rlpipe stage server: not warmed: {name} ({type(e).__name__}: {e})", file=sys.stderr)
    import typer  # noqa: F401
    import yaml  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: F401

    import rlpipe

    for module in pkgutil.walk_packages(rlpipe.__path__, "rlpipe."):
        if module.name.startswith(_NOT_WARMED):
            continue
        try:
            importlib.import_module(module.name)
        except Exception as e:  # noqa: BLE001 - an optional extra that is not installed: its stage pays its own import
            print(f"rlpipe stage server: not warmed: {module.name} ({type(e).__name__}: {e})", file=sys.stderr)


def warm_models(model_dirs: list[str]) -> list[str]:
    """Let transformers resolve its lazy modules for these model dirs (their modeling code, their tokenizer class).

    Loads configs and tokenizers (pure Python and Rust, no threads with TOKENIZERS_PARALLELISM=false)
    but no weights. Returns the dirs it warmed (missing ones are skipped: iteration 0 has no
    state/policy yet, and the tiny default's model appears only after ``prepare``).
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    warmed = []
    for d in model_dirs:
        if not os.path.isfile(os.path.join(d, "config.json")):
            continue
        try:
            config = AutoConfig.from_pretrained(d, local_files_only=True)
            MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the modeling module
            AutoTokenizer.from_pretrained(d, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - a warm-up that fails only costs the stage its own import time
            print(f"rlpipe stage server: could not warm {d}: {e}", file=sys.stderr)
            continue
        warmed.append(d)
    return warmed


@dataclass
class Running:
    """A stage being run: its forked process, and the connection of the stage command that handed it over."""
    pid: int
    pidfd: int
    conn: object
    argv: list[str]
    started: float


class StageServer:
    """One event loop (selectors: the listening socket, each stage's connection and process) in one thread.

    Forking happens only in that thread, so no lock of the server's own is ever held across a fork.
    The other threads in the process belong to libraries that are idle here (polars' and pyarrow's
    jemalloc, which has fork handlers); Python's "multi-threaded fork" warning is silenced for that reason.
    """

    def __init__(self, addr: str, *, fingerprint: dict, idle_timeout: float | None, owner: int | None = None,
                 log=sys.stderr) -> None:
        self.addr = addr
        self.idle_timeout = idle_timeout
        self.log = log
        self.listener = wire.listen(addr)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        if owner is not None:  # `rlpipe run` that started it: when it dies (kill -9 too), so does the server
            self.selector.register(os.pidfd_open(owner), selectors.EVENT_READ, ("owner", None))
        self.running: dict[int, Running] = {}
        self.fingerprint = fingerprint
        self.last_activity = time.monotonic()
        self.served = 0
        self.warmed: list[str] = []

    def decline_reason(self, request: dict) -> str | None:
        if request.get("executable") != self.fingerprint["executable"] or request.get("prefix") != self.fingerprint["prefix"]:
            return f"another Python ({request.get('executable')}) than the server's ({self.fingerprint['executable']})"
        env = request.get("env", {})
        for key in IMPORT_TIME_VARS:
            if env.get(key) != self.fingerprint[key]:
                return f"{key}={env.get(key)!r} differs from the server's {self.fingerprint[key]!r}"
        return None

    def serve_forever(self) -> None:
        while True:
            timeout = None
            if self.idle_timeout is not None and not self.running:
                timeout = max(0.0, self.idle_timeout - (time.monotonic() - self.last_activity))
                if timeout == 0.0:
                    print(f"rlpipe stage server: idle for {self.idle_timeout:.0f} s, exiting", file=self.log)
                    return
            for key, _mask in self.selector.select(timeout):
                kind, running = key.data
                if kind == "owner":
                    print("rlpipe stage server: the run that started it is gone, exiting", file=self.log, flush=True)
                    return
                if kind == "accept":
                    self._accept()
                elif kind == "exit":
                    self._reap(running)
                else:
                    self._from_client(running)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        self.last_activity = time.monotonic()
        try:
            conn.settimeout(10.0)
            if not wire.same_user(conn):
                conn.close()
                return
            got = wire.recv_json(conn, with_fds=True)
            if got is None:
                conn.close()
                return
            request, fds = got
            if "control" in request:
                self._control(conn, request["control"], request)
                return
            reason = self.decline_reason(request) if len(fds) == 3 else "it did not pass its three standard streams"
            if reason is not None:
                wire.send_json(conn, {"accepted": False, "reason": reason})
                for fd in fds:
                    os.close(fd)
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                self.listener.close()
                _run_child(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            conn.settimeout(None)
            wire.send_json(conn, {"accepted": True, "pid": pid})
        except OSError as e:
            print(f"rlpipe stage server: a connection failed: {e}", file=self.log)
            conn.close()
            return
        running = Running(pid=pid, pidfd=os.pidfd_open(pid), conn=conn, argv=request["argv"], started=time.monotonic())
        self.running[pid] = running
        self.selector.register(running.pidfd, selectors.EVENT_READ, ("exit", running))
        self.selector.register(conn, selectors.EVENT_READ, ("client", running))
        self.served += 1

    def _control(self, conn, command: str, request: dict) -> None:
        """``status``: who runs; ``warm``: warm these model dirs (`rlpipe run` once prepare made them);
        ``stop``: kill any running stage and exit (what `rlpipe worker stop` sends)."""
        if command == "warm":
            self.warmed.extend(warm_models([d for d in request.get("dirs", []) if d not in self.warmed]))
        status = {"pid": os.getpid(), "served": self.served, "running": [r.argv for r in self.running.values()],
                  "warmed": self.warmed}
        wire.send_json(conn, status)
        conn.close()
        if command == "stop":
            self.shutdown()
            print("rlpipe stage server: stopped on request", file=self.log, flush=True)
            os._exit(0)

    def _from_client(self, running: Running) -> None:
        try:
            got = wire.recv_json(running.conn)
        except OSError:
            got = None
        if got is None:  # the stage's process is gone (killed): its child must not run on unobserved
            _kill(running.pid, signal.SIGKILL)
            self.selector.unregister(running.conn)
            running.conn.close()
            running.conn = None
            return
        signum = got[0].get("signal")
        if isinstance(signum, int):
            _kill(running.pid, signum)

    def _reap(self, running: Running) -> None:
        _, status = os.waitpid(running.pid, 0)
        self.selector.unregister(running.pidfd)
        os.close(running.pidfd)
        del self.running[running.pid]
        self.last_activity = time.monotonic()
        if running.conn is None:
            return
        self.selector.unregister(running.conn)
        msg = ({"killed_by": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
               else {"exit": os.WEXITSTATUS(status)})
        try:
            wire.send_json(running.conn, msg)
        except OSError:
            pass
        running.conn.close()

    def shutdown(self) -> None:
        for running in list(self.running.values()):
            _kill(running.pid, signal.SIGKILL)
        self.listener.close()


def environment_fingerprint() -> dict:
    """What a stage's process must share with the server to run in its fork; taken before any import
    (torch itself sets TORCHINDUCTOR_CACHE_DIR when imported)."""
    return {"executable": os.path.realpath(sys.executable), "prefix": sys.prefix,
            **{k: os.environ.get(k) for k in IMPORT_TIME_VARS}}


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the stage process described by ``request`` and run its script."""
    code = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        name = os.path.splitext(os.path.basename(request["argv"][0]))[0]
        libc.prctl(_PR_SET_NAME, f"rlpipe-{name}"[:15].encode(), 0, 0, 0)  # what ps/top show for this stage
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[ENV_CHILD] = "1"
        os.environ[ENV_STARTED_AT] = repr(request["started_at"])
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        for name in [m for m in sys.modules if m == "rlpipe" or m.startswith("rlpipe.")]:
            del sys.modules[name]
        script = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        sys.path.insert(0, os.path.dirname(script))  # as `python stages/x.py` has it (the server runs with -P)
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the stage's own traceback, as Python would print it
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def cuda_survives_fork() -> bool:
    """Whether a child forked now can still start CUDA: False once this process has initialised the driver.

    Why: a library that asks CUDA anything at import time (a device count, a capability) initialises the
    driver, and every stage forked afterwards fails with "Cannot re-initialize CUDA in forked subprocess".
    Asked of a real child, since the parent cannot tell without asking CUDA itself; on a machine or
    build without CUDA the child's error is another one, and forking is safe.
    """
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            import torch

            torch.cuda.init()
        except Exception as e:  # noqa: BLE001 - no CUDA here (CPU build, no device): nothing to lose by forking
            code = 3 if "forked subprocess" in str(e) else 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def warm_or_restart(*, compiler: bool) -> None:
    """warm_imports, then, if warming the compiler spoilt CUDA for forked stages, start over without it
    (the same process, re-executed without --warm-compiler): a stage then imports the compiler itself."""
    warm_imports(compiler=compiler)
    if compiler and not cuda_survives_fork():
        print("rlpipe stage server: importing torch.compile's modules initialised CUDA, which a forked stage "
              "could not use; restarting without --warm-compiler", file=sys.stderr, flush=True)
        os.execv(sys.executable, [a for a in sys.orig_argv if a != "--warm-compiler"])


def main() -> None:
    parser = argparse.ArgumentParser(description="rlpipe's warm stage server (see rlpipe/worker/stage_server.py)")
    parser.add_argument("--project", default=".", help="project directory whose stages this server runs")
    parser.add_argument("--address", default=None, help="abstract socket name (@name); default: derived from --project")
    parser.add_argument("--warm", action="append", default=[], help="model directory to warm transformers for")
    parser.add_argument("--idle-timeout", type=float, default=None, help="exit after this many idle seconds")
    parser.add_argument("--owner", type=int, default=None, help="exit when the process with this pid exits")
    parser.add_argument("--warm-compiler", action="store_true",
                        help="also import torch.compile's modules (the project's stages compile their layers)")
    args = parser.parse_args()
    addr = "\0" + args.address[1:] if args.address else wire.address("stage", args.project)
    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded, use of fork\(\)",
                            category=DeprecationWarning)  # see StageServer
    t0 = time.perf_counter()
    fingerprint = environment_fingerprint()
    warm_or_restart(compiler=args.warm_compiler)
    server = StageServer(addr, fingerprint=fingerprint, idle_timeout=args.idle_timeout, owner=args.owner)
    server.warmed = warm_models(args.warm)
    warmed = server.warmed
    signal.signal(signal.SIGTERM, lambda *_: (server.shutdown(), os._exit(0)))
    print(f"rlpipe stage server: ready at {wire.printable(addr)} after {time.perf_counter() - t0:.1f} s "
          f"(warmed {len(warmed)} model dir(s)), pid {os.getpid()}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
