"""Every code_tests test is checked by `host_unaffected`: nothing of a sandboxed row outlives it."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from rlpipe.rewards.code import process
from tests.rewards.code.helpers import USED_UIDS, row_cgroups, sandbox_processes, sysv_ipc

_row_uid = process.row_uid
_mkdtemp = process.tempfile.mkdtemp
WORK_DIRS: list[str] = []  # made by this test process (another run may use the sandbox meanwhile)


def _recorded_mkdtemp(*args, **kwargs):
    path = _mkdtemp(*args, **kwargs)
    if "rlpipe-sandbox-" in path:
        WORK_DIRS.append(path)
    return path


@contextmanager
def _recorded_row_uid(isolation):
    with _row_uid(isolation) as (uid, gid):
        if isolation.users == "per_row":
            USED_UIDS.add(uid)
        yield uid, gid


@pytest.fixture(autouse=True)
def host_unaffected(monkeypatch):
    monkeypatch.setattr(process, "row_uid", _recorded_row_uid)
    monkeypatch.setattr(process.tempfile, "mkdtemp", _recorded_mkdtemp)
    mounts, ipc = Path("/proc/self/mountinfo").read_text(), sysv_ipc()
    yield
    assert sandbox_processes() == [], "a sandbox process outlived its row"
    assert [d for d in WORK_DIRS if Path(d).exists()] == [], "a sandbox work dir was left behind"
    assert row_cgroups() == [], "a row cgroup was left behind"
    assert Path("/proc/self/mountinfo").read_text() == mounts, "a sandbox mount leaked into the host"
    assert sysv_ipc() == ipc, "System V IPC objects of a row were left on the host"
