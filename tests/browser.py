"""A real headless Chromium for the report tests, with the network blocked.

Pages are opened from disk (file://) with every host name resolving to nothing and every request
sent to a dead proxy, so a page that needs the network shows what an offline cluster would show.
Two looks at a page: its DOM after the scripts ran (``dump_dom``) and a screenshot (``screenshot``,
decoded with Pillow). Chromium is Debian's ``chromium`` package (`.ci/run` installs it); where none
is found the tests are skipped with that reason, unless ``RLPIPE_REQUIRE_BROWSER=1`` (set by
`.ci/run` once the install worked) turns the skip into a failure.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Headless on a machine without a display, sandbox or GPU, and without Chromium's own background
# traffic (updates, sync, field trials), which would otherwise try the network at every start.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--disable-default-apps", "--hide-scrollbars", "--mute-audio")
# The network, blocked: no host name resolves and anything that still tries goes to a closed port.
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=http://127.0.0.1:9",
           "--proxy-bypass-list=<-loopback>")
# A page served by a local test server (`rlpipe view`): the same, except that 127.0.0.1 itself is reached.
# (Chromium applies the resolver rules to IP literals too, hence the EXCLUDE.)
LOCAL_SERVER = ("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--proxy-server=http://127.0.0.1:9",
                "--proxy-bypass-list=127.0.0.1")


def chromium() -> str:
    """The browser's path; skips the test (or fails it, where CI installed one) when there is none."""
    named = os.environ.get("RLPIPE_CHROMIUM")
    if named:
        if not os.access(named, os.X_OK):
            pytest.fail(f"RLPIPE_CHROMIUM={named}: no such executable")
        return named
    path = next(filter(None, map(shutil.which, CANDIDATES)), None)
    if path:
        return path
    reason = ("no headless browser: install Debian's chromium package (`apt-get install -y chromium`, as "
              ".ci/run does) or set RLPIPE_CHROMIUM to a Chromium/Chrome binary")
    if os.environ.get("RLPIPE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"RLPIPE_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


def _run(page: Path | str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Chromium on a file, or on a URL of a server on 127.0.0.1 (``str``): nothing else is reachable."""
    target, network = (page, LOCAL_SERVER) if isinstance(page, str) else (page.resolve().as_uri(), OFFLINE)
    if isinstance(page, str) and not page.startswith("http://127.0.0.1:"):
        raise ValueError(f"{page}: only a server on 127.0.0.1 can be opened")
    with tempfile.TemporaryDirectory(prefix="rlpipe-chromium-") as profile:
        cmd = [chromium(), *FLAGS, *network, f"--user-data-dir={profile}", "--virtual-time-budget=15000", *extra,
               target]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def dump_dom(page: Path | str) -> str:
    """The page's DOM after its scripts ran (virtual time: timers and animation frames included)."""
    return _run(page, "--dump-dom").stdout


def screenshot(page: Path | str, png: Path, *, width: int = 1280, height: int = 1600) -> Path:
    _run(page, f"--window-size={width},{height}", f"--screenshot={png.resolve()}")
    assert png.is_file(), f"Chromium wrote no screenshot of {page}"
    return png


def colour_counts(png: Path) -> dict[tuple[int, int, int], int]:
    """How many pixels of each RGB colour the screenshot has."""
    from PIL import Image

    with Image.open(png) as im:
        rgb = im.convert("RGB")
        return {colour: n for n, colour in rgb.getcolors(maxcolors=rgb.width * rgb.height)}


def ink_fraction(counts: dict[tuple[int, int, int], int]) -> float:
    """Share of the pixels that are not (near) white: 0 for a blank page."""
    total = sum(counts.values())
    return sum(n for c, n in counts.items() if min(c) < 240) / total


def near(counts: dict[tuple[int, int, int], int], target: tuple[int, int, int], tol: int = 12) -> int:
    """Pixels within ``tol`` of ``target`` on every channel (antialiasing blends edges)."""
    return sum(n for c, n in counts.items() if all(abs(a - b) <= tol for a, b in zip(c, target)))
