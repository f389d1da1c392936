"""The project repository as the iteration loop sees it: iteration tags, the state/ directories it carries
from one iteration to the next, and the git and DVC commands whose output it reads.

Shared by `rlpipe.run.iterate` (which writes tags and state) and `rlpipe.run.gc` (which reads them to
know what to keep), so neither imports the other.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from rlpipe.errors import RlpipeError

STATE_POLICY = "state/policy"
STATE_SAMPLER = "state/sampler"  # an older policy that samples overlapped iterations (docs/overlap.md)
STATE_REFERENCE = "state/reference"
STATE_CRITIC = "state/critic"


def tag_name(iteration: int) -> str:
    return f"iteration-{iteration}"


def run_command(cmd: list[str], cwd: Path) -> str:
    """The command's stdout; a non-zero exit is an error naming the command and what it printed."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RlpipeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout
