"""The stage side of the stage server: hand this stage process over to a warm server, or run it here.

Called by ``rlpipe.stages.runner`` before anything heavy is imported. It returns (and the stage runs in
this process, as it always did) unless a stage server for this project is running and accepts
the stage; then this process only relays signals and exits with the stage's exit code.

Standard library only: this runs at the start of every stage process.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from rlpipe.worker import wire

ENV_SERVER = "RLPIPE_STAGE_SERVER"  # "off": never forward; "@name": that server; unset: the project's own
ENV_CHILD = "RLPIPE_STAGE_CHILD"  # set in the forked child, so it never forwards again
ENV_STARTED_AT = "RLPIPE_STAGE_STARTED_AT"  # wall-clock start of the forwarding process (stage timing)
# Launchers whose processes must each run their own stage (torchrun ranks talk to each other).
_LAUNCHER_VARS = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def _is_stage_script() -> bool:
    """True when this process runs a script from a ``stages/`` directory as ``__main__``."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if not script or not sys.argv or not sys.argv[0]:
        return False
    path = os.path.abspath(script)
    return os.path.basename(os.path.dirname(path)) == "stages" and path == os.path.abspath(sys.argv[0])


def server_address(cwd: str | None = None) -> str | None:
    """The stage server this process would use, or None when forwarding is off here."""
    setting = os.environ.get(ENV_SERVER, "")
    if setting == "off" or os.environ.get(ENV_CHILD) or any(v in os.environ for v in _LAUNCHER_VARS):
        return None
    if setting.startswith("@"):
        return "\0" + setting[1:]
    return wire.address("stage", cwd or os.getcwd())


def forward_if_served(process_start: float) -> None:
    """Run this stage in the project's stage server if one accepts it; otherwise return.

    ``process_start``: ``time.perf_counter()`` at the start of the stage process, passed on so the
    stage's ``imports`` time still counts from when DVC started it.
    """
    if not _is_stage_script():
        return
    addr = server_address()
    if addr is None:
        return
    try:
        sock = wire.connect(addr, timeout=2.0)
    except OSError:
        return  # no server for this project: the usual case
    started_at = time.time() - (time.perf_counter() - process_start)
    request = {"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
               "executable": os.path.realpath(sys.executable), "prefix": sys.prefix, "started_at": started_at}
    try:
        wire.send_json(sock, request, fds=[0, 1, 2])
        reply = wire.recv_json(sock)
    except OSError as e:
        print(f"rlpipe: stage server {wire.printable(addr)} failed ({e}); running the stage in this process",
              file=sys.stderr)
        sock.close()
        return
    if reply is None or not reply[0].get("accepted"):
        reason = "it closed the connection" if reply is None else reply[0].get("reason")
        print(f"rlpipe: stage server {wire.printable(addr)} declined ({reason}); running the stage in this process",
              file=sys.stderr)
        sock.close()
        return
    os._exit(_relay(sock))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _relay(sock) -> int:
    """Forward SIGINT/SIGTERM/SIGHUP to the stage; return the exit code to leave with."""
    def forward(signum, _frame):
        try:
            wire.send_json(sock, {"signal": signum})
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            reply = wire.recv_json(sock)
        except InterruptedError:
            continue
        except OSError:
            reply = None
        if reply is None:
            print("rlpipe: the stage server went away before the stage finished", file=sys.stderr)
            return 1
        msg = reply[0]
        if "exit" in msg:
            return int(msg["exit"])
        if "killed_by" in msg:  # leave the way the stage did, so DVC reports the same as without the server
            signum = int(msg["killed_by"])
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return 128 + signum
