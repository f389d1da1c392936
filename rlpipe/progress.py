"""Progress bars with ETA for the long stages (generate, score, reference_logprob, train).

Library code never draws anything: it takes an optional ``progress`` callback, called with the
number of units (samples, rows, sequences, optimizer steps) finished since the last call. A stage
script opens a bar with ``stage_progress`` and passes the callback down. Callbacks only count:
they never touch tensors, seeds or iteration order, so outputs stay byte-identical with or
without a bar.

Bars draw on stderr, and only when stderr is a terminal and neither ``CI`` nor
``RLPIPE_NO_PROGRESS`` is set: logs of ``dvc repro`` in CI or in a file get the one summary line
per stage (``rlpipe.stages.runner.summary_line``), never carriage-return noise.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

Progress = Callable[[int], None]


def progress_enabled(stream: TextIO | None = None) -> bool:
    """True when bars should be drawn: ``stream`` (default stderr) is a TTY and not in CI."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("CI") or os.environ.get("RLPIPE_NO_PROGRESS"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _noop(n: int = 1) -> None:
    """The callback handed out when bars are off."""


@contextmanager
def stage_progress(description: str, *, total: int | None, unit: str,
                   stream: TextIO | None = None, force: bool = False) -> Iterator[Progress]:
    """Yield ``advance(n)``: a bar of ``total`` ``unit``s with rate and ETA, or a no-op when quiet.

    ``force`` draws even when the stream is not a terminal (tests); the bar disappears when the
    block ends (the stage's summary line follows).
    """
    if not (force or progress_enabled(stream)):
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    console = Console(file=sys.stderr if stream is None else stream, force_terminal=force or None)
    columns = [TextColumn(f"[bold]{description}[/]"), BarColumn(), MofNCompleteColumn(),
               TextColumn(unit), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    with RichProgress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)

        yield advance


def call(progress: Progress | None, n: int) -> None:
    """Report ``n`` finished units to an optional callback (library code's one-line hook)."""
    if progress is not None and n:
        progress(n)
