"""Every code_tests test is checked by `host_unaffected`: nothing of a sandboxed row outlives it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.rewards.code.helpers import row_cgroups, sandbox_processes, sysv_ipc, work_dirs


@pytest.fixture(autouse=True)
def host_unaffected():
    mounts, dirs, ipc = Path("/proc/self/mountinfo").read_text(), work_dirs(), sysv_ipc()
    yield
    assert sandbox_processes() == [], "a sandbox process outlived its row"
    assert work_dirs() == dirs, "a sandbox work dir was left behind"
    assert row_cgroups() == [], "a row cgroup was left behind"
    assert Path("/proc/self/mountinfo").read_text() == mounts, "a sandbox mount leaked into the host"
    assert sysv_ipc() == ipc, "System V IPC objects of a row were left on the host"
