"""State between test cases and rows (issue 32, items 3, 5, 6): each case starts with fresh scratch space and a
fresh IPC namespace whatever the previous case built, a scratch space that cannot be reset fails its case (never
the row), and no per-row kernel object (a keyring, a mount, a cgroup, an IPC object) is left on the host.

Where a protection depends on the host, each test asserts the strong property where it is active and the
documented fallback where it is not (`helpers.weaker_variants`). docs/reliability.md maps each to its promise.
"""
from __future__ import annotations

import base64
import glob
import json
import os
import subprocess
import sys
import time

import pytest

from rlpipe.rewards.code import runner
from rlpipe.rewards.code.judge import judge_case
from rlpipe.rewards.code.cases import Check
from rlpipe.rewards.code.process import CaseRecord
from tests.rewards.code.helpers import USED_UIDS, host_kernel_objects, key_user_lines, verdict, weaker_variants

VARIANTS = weaker_variants()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Each case prints what it finds in its scratch dirs, then leaves behind everything that defeated (or could
# defeat) a walk of the tree: a 2,500-deep directory chain (RecursionError in shutil.rmtree), 2,000 files,
# directories without permissions, symlinks (to /, to .., to themselves, dangling), a FIFO and a socket node.
HOSTILE_SCRATCH = r"""
import os, stat, sys
def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return exc.strerror
def litter(top, depth, files):
    os.chdir(top)
    for _ in range(depth):
        os.mkdir("d")
        os.chdir("d")
    open("bottom", "w").close()
    os.chdir(top)
    os.mkdir("many")
    for i in range(files):
        open(f"many/{{i}}", "w").close()
    os.makedirs("locked/inner")
    open("locked/inner/f", "w").close()
    os.chmod("locked/inner", 0)
    os.chmod("locked", 0o500)
    open("nope", "w").close()
    os.chmod("nope", 0)
    for name, target in (("root", "/"), ("up", ".."), ("loop", "loop"), ("dangling", "/nonexistent")):
        os.symlink(target, name)
    os.mkfifo("fifo")
    os.mknod("sock", stat.S_IFSOCK | 0o600)
work = os.getcwd()
print(listing("."), listing("/dev/shm") if {private_shm} else "-")
sys.stdout.flush()
litter(work, 2500, 2000)
if {private_shm}:
    litter("/dev/shm", 1500, 100)
if {host_var_tmp}:  # plain mode, a user per row: the host's /var/tmp, removed after the row
    os.mkdir(f"/var/tmp/rlpipe-chain-{{os.getuid()}}")
    litter(f"/var/tmp/rlpipe-chain-{{os.getuid()}}", 1500, 10)
"""


def interpreter_dirs_in(scratch: str) -> list[str]:
    """What a fresh private scratch dir shows: nothing, but for the way to this interpreter's read-only dirs
    when they live inside it (a virtualenv under /tmp, as in a CI clone), bound there in every test case."""
    from rlpipe.rewards.code.isolate import read_only_dirs

    return sorted({p[len(scratch) + 1:].split("/")[0] for p in read_only_dirs() if p.startswith(scratch + "/")})


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_hostile_scratch_tree_is_gone_at_the_next_case_and_the_row_is_no_error(name):
    isolation = VARIANTS[name]
    private_shm = "private_filesystem" in isolation.active
    host_var_tmp = not private_shm and isolation.users == "per_row"
    chains_before = set(glob.glob("/var/tmp/rlpipe-chain-*"))
    code = HOSTILE_SCRATCH.format(private_shm=private_shm, host_var_tmp=host_var_tmp)
    expected = f"{interpreter_dirs_in('/tmp')} {interpreter_dirs_in('/dev/shm')}\n" if private_shm else "[] -\n"
    tests = {"inputs": ["1\n", "2\n", "3\n"], "outputs": [expected] * 3}
    row = verdict(code, tests, isolation=isolation, work_dir_mb=32, timeout_s=20.0, cpu_time_s=10)
    assert (row.kind, row.passed, row.total, row.message) == ("pass", 3, 3, "")  # every case saw empty dirs
    assert set(glob.glob("/var/tmp/rlpipe-chain-*")) == chains_before  # nothing of the row left in /var/tmp


def _bare_driver(scratch_dirs: list[str]) -> runner.Driver:
    plan = {"limits": {"output_bytes": 1000, "timeout_s": 1.0, "work_bytes": 1 << 20}, "namespaces": False,
            "scratch_dirs": scratch_dirs, "cgroup_procs": [], "cgroup_kill": None, "oom_events": None,
            "uid": None, "gid": None, "per_row_uid": False, "seccomp": False}
    return runner.Driver(plan, runner.Reporter(-1, "unused"))


def test_scratch_space_that_cannot_be_reset_fails_its_case_and_not_the_driver(tmp_path):
    missing = str(tmp_path / "was-removed")
    record = _bare_driver([missing]).run_case(1, {"mode": "stdin", "stdin": ""})
    assert record["stop"] == "scratch_not_reset" and record["exit"] == 0  # the case never started
    case = CaseRecord(index=1, stop=record["stop"], exit=0, wall_s=0.0, cpu_s=0.0, oom_kills=0, out=b"",
                      err=base64.b64decode(record["err"]), status=b"")
    kind, message = judge_case(case, Check(kind="stdout", expected=""), cpu_time_s=1, tolerance=0.0)
    assert kind == "runtime_error" and "could not be reset" in message and "was-removed" in message


# Each case looks for System V IPC objects and a POSIX message queue of fixed names, then makes them.
IPC_PER_CASE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
found = [name for name, there in (("shm", libc.shmget(0x5EED, 0, 0) >= 0), ("msg", libc.msgget(0x5EED, 0) >= 0),
                                  ("sem", libc.semget(0x5EED, 0, 0) >= 0),
                                  ("mq", libc.mq_open(b"/rlpipe-case", os.O_RDONLY, 0, None) >= 0)) if there]
made = [name for name, result in (("shm", libc.shmget(0x5EED, 4096, 0o1600)), ("msg", libc.msgget(0x5EED, 0o1600)),
                                  ("sem", libc.semget(0x5EED, 1, 0o1600)),
                                  ("mq", libc.mq_open(b"/rlpipe-case", os.O_CREAT | os.O_RDWR, 0o600, None)))
        if result >= 0]
print("found", found, "made", made)
"""


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ipc_objects_of_one_case_are_not_found_by_the_next(name):
    isolation = VARIANTS[name]
    if "ipc_namespace" in isolation.active:  # made in each case, in a namespace of that case alone
        expected = "found [] made ['shm', 'msg', 'sem', 'mq']\n"
    elif "syscall_filter" in isolation.active:  # no namespace: the filter refuses the host's IPC (EPERM)
        expected = "found [] made []\n"
    else:  # nothing stops IPC here: reported as missing, documented in docs/reliability.md
        assert {"ipc_namespace", "syscall_filter"} <= set(isolation.missing)
        return
    tests = {"inputs": ["1\n", "2\n", "3\n"], "outputs": [expected] * 3}
    row = verdict(IPC_PER_CASE, tests, isolation=isolation)
    assert (row.kind, row.passed) == ("pass", 3)


def _wait_for_no_key_users(uids: set[int], timeout_s: float = 10.0) -> dict[int, str]:
    """The kernel frees keys in a work queue after their last user: give it a moment."""
    deadline = time.monotonic() + timeout_s
    while (left := key_user_lines(uids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# Adds a key to the user and the session keyring where no syscall filter refuses it.
ADD_KEYS = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
add_key = {"x86_64": 248, "aarch64": 217}[os.uname().machine]
print([libc.syscall(add_key, b"user", b"rlpipe-" + str(ring).encode(), b"x", 1, ring) >= 0 for ring in (-4, -3)])
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64/aarch64")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_no_keyring_of_a_row_user_outlives_its_row(name):
    isolation = VARIANTS[name]
    if isolation.users != "per_row":  # one user for every row: its keyring is one object, emptied per case
        return
    before = set(USED_UIDS)
    allowed = "syscall_filter" not in isolation.active
    tests = {"inputs": ["1\n", "2\n"], "outputs": [f"[{allowed}, {allowed}]\n"] * 2}
    for _ in range(3):
        row = verdict(ADD_KEYS, tests, isolation=isolation)
        assert row.kind == "pass"  # the keys were made where nothing refuses them
    uids = USED_UIDS - before
    assert len(uids) == 3
    assert _wait_for_no_key_users(uids) == {}  # /proc/key-users has no line for a row's uid


PROBE_UIDS = """
import json
from contextlib import contextmanager
from rlpipe.rewards.code import host, process
seen, row_uid = [], process.row_uid
@contextmanager
def recorded(isolation):
    with row_uid(isolation) as (uid, gid):
        seen.append(uid)
        yield uid, gid
process.row_uid = recorded
host.host_isolation()
print(json.dumps([uid for uid in seen if uid is not None]))
"""


def test_probing_the_host_leaves_no_keyring_behind():
    done = subprocess.run([sys.executable, "-c", PROBE_UIDS], capture_output=True, text=True, cwd=REPO, check=True)
    uids = set(json.loads(done.stdout))
    if not uids:  # no per-row uid on this host: nothing per row to leave
        return
    assert _wait_for_no_key_users(uids) == {}


HONEST = "def add(a, b):\n    return a + b\n"
HOSTILE_ROWS = [
    HONEST,
    ADD_KEYS.replace("print(", "_ = (") + HONEST,  # user and session keys, where nothing refuses them
    IPC_PER_CASE.replace("print(", "_ = (") + HONEST,  # IPC objects
    "import os\nshm = '/dev/shm' if os.environ['TMPDIR'] == '/tmp' else '.'  # private in namespace mode\n"
    "os.makedirs(shm + '/a/b/c', exist_ok=True)\nopen(shm + '/x', 'w').close()\n" + HONEST,
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n" + HONEST,  # a daemon
    "def add(a, b):\n    return a - b\n",  # wrong
]


def test_many_rows_leave_no_kernel_object_on_the_host():
    """RLPIPE_LEAK_ROWS rows (100 by default: 11 s on the 2-core box at load 2-4, 18 s at load 8-10) of honest
    and hostile programs in every variant: the host's kernel objects are unchanged. The issue's 500 rows would
    add 1-1.5 minutes to CI there (110 s measured), so they are counted by benchmarks/judge_soak.py instead,
    which samples the same objects every 500 rows over thousands (BENCHMARKS.md)."""
    rows = int(os.environ.get("RLPIPE_LEAK_ROWS", "100"))
    names = sorted(VARIANTS)
    verdict(HONEST, isolation=VARIANTS["host"])  # warm: the first row loads what later rows reuse
    time.sleep(0.2)
    before, used_before = host_kernel_objects(), set(USED_UIDS)
    kinds = []
    for i in range(rows):
        isolation = VARIANTS[names[i % len(names)]]
        kinds.append(verdict(HOSTILE_ROWS[i % len(HOSTILE_ROWS)], isolation=isolation).kind)
    wrong = sum(1 for i in range(rows) if i % len(HOSTILE_ROWS) == len(HOSTILE_ROWS) - 1)
    assert kinds.count("pass") == rows - wrong  # only the wrong program fails
    uids = USED_UIDS - used_before
    assert _wait_for_no_key_users(uids) == {}
    after = host_kernel_objects()
    print(f"\nkernel objects over {rows} rows: before {before}, after {after}")
    for name in ("mounts", "sysvipc", "row_cgroups", "our_fds", "our_threads", "mqueues"):
        assert after[name] == before[name], name
