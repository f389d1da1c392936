"""The sandbox: limits, what leaks between rows (nothing), what is left when a row returns (nothing), what
the sandbox returns (no host path), infrastructure failures (an error of the row, never a score), and
the fallbacks of weaker hosts.

Where a protection depends on the host, each test asserts the strong property where the protection is
active and the documented fallback where it is not (`helpers.weaker_variants` also runs the weaker
sandboxes a CI host may get on this one). docs/reliability.md maps every case to its protection.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlpipe.rewards.code import host, process
from rlpipe.rewards.code.cgroups import CgroupHost
from rlpipe.rewards.code.host import host_isolation
from rlpipe.rewards.code.protections import PROTECTIONS, Isolation, SandboxUnavailable
from rlpipe.rewards.code.reward import redact
from rlpipe.rewards.functions import RewardResult
from tests.rewards.code.helpers import (ADD_TESTS, ISOLATION, processes_named, raw, sandbox_processes, score, variant,
                                        verdict, weaker_variants)

VARIANTS = weaker_variants()
CORRECT_ADD = "def add(a, b):\n    return a + b\n"


def test_the_host_report_names_every_protection_once():
    assert set(ISOLATION.active) | set(ISOLATION.missing) == set(PROTECTIONS)
    assert not set(ISOLATION.active) & set(ISOLATION.missing)
    assert all(ISOLATION.missing.values())
    out = subprocess.run([sys.executable, "-m", "rlpipe.rewards.code"], capture_output=True, text=True, check=True)
    assert all(name in out.stdout for name in PROTECTIONS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_scores_right_and_wrong(name):
    isolation = VARIANTS[name]
    assert verdict(CORRECT_ADD, isolation=isolation).kind == "pass"
    assert verdict("def add(a, b):\n    return a - b\n", isolation=isolation).kind == "wrong_answer"
    io = {"inputs": ["2 3\n"], "outputs": ["5\n"]}
    assert verdict("print(sum(map(int, input().split())))", io, isolation=isolation).kind == "pass"


# ---------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------

def test_an_infinite_loop_hits_the_cpu_limit():
    result = verdict("def add(a, b):\n    while True:\n        pass\n", timeout_s=10.0, cpu_time_s=1)
    assert result.kind == "timeout" and "CPU" in result.message
    assert result.wall_s < 6


def test_sleeping_past_the_limit_hits_the_wall_clock():
    result = verdict("import time\ndef add(a, b):\n    time.sleep(60)\n", timeout_s=0.5)
    assert result.kind == "timeout" and "wall clock" in result.message
    assert result.wall_s < 4


@pytest.mark.parametrize("code", [
    "x = bytearray(1 << 34)\n",  # 16 GiB at once
    "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n",  # 1 MiB at a time
])
def test_a_memory_bomb_gets_memory(code):
    result = verdict(code + CORRECT_ADD, memory_mb=256)
    assert result.kind == "memory", result
    assert result.wall_s < 6


@pytest.mark.parametrize("code", [
    "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n",
    "import os\nwhile True:\n    os.write(2, b'y' * (1 << 20))\n",  # straight to the stderr fd
    "import os\nwhile True:\n    os.write(3, b'z' * (1 << 20))\n",  # the status pipe
])
def test_printing_gigabytes_is_cut_off(code):
    result = verdict(code + CORRECT_ADD)
    assert result.kind == "output_limit", result
    assert result.wall_s < 6


def test_a_fork_bomb_is_refused_and_the_next_row_is_unaffected():
    bomb = "import os\nwhile True:\n    os.fork()\n"
    result = verdict(bomb + CORRECT_ADD, max_processes=16, timeout_s=1.0)
    assert result.kind in ("sandbox_refused", "timeout", "memory"), result
    assert verdict(CORRECT_ADD).kind == "pass"


def test_open_files_are_capped_at_max_open_files():
    code = ("import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError as exc:\n    print(len(fds), exc.errno)\n")
    record = raw(code, max_open_files=40)
    count, errno_ = map(int, record.out.split())
    assert errno_ == 24 and 30 <= count < 40  # EMFILE; fds 0-3 and the interpreter's own are open already


def test_a_file_larger_than_max_file_mb_cannot_be_written():
    record = raw("try:\n    open('big', 'wb').write(b'x' * (3 << 20))\nexcept OSError as exc:\n    print(exc.errno)\n",
                 max_file_mb=1)
    assert record.out.strip() in (b"27", b"28") or record.exit == -signal.SIGXFSZ  # EFBIG, ENOSPC or SIGXFSZ


# ---------------------------------------------------------------------------------------------
# One budget for all of a row's processes
# ---------------------------------------------------------------------------------------------

SEVEN_HOGS = """
import os, time
def hog():
    r, w = os.pipe()
    children = []
    for _ in range(7):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            block = bytearray(256 << 20)
            block[::4096] = b'x' * len(block[::4096])  # touch every page: resident, not just reserved
            os.write(w, b'1')
            time.sleep(30)
            os._exit(0)
        children.append(pid)
    os.close(w)
    time.sleep(3)
    os.set_blocking(r, False)
    try:
        return len(os.read(r, 64))
    except BlockingIOError:
        return 0
"""


def test_seven_256_mib_processes_do_not_fit_a_512_mib_row():
    tests = "assert hog() == 7\n"  # 7 would mean 1.75 GiB resident at once in a row of memory_mb 512
    if "row_memory_limit" in ISOLATION.active:
        result = verdict(SEVEN_HOGS, tests, memory_mb=512, max_processes=32, timeout_s=15.0, cpu_time_s=10)
        assert result.kind in ("memory", "wrong_answer"), result
        if result.kind == "wrong_answer":
            assert int(result.message.rsplit(" ", 1)[1]) <= 2, result.message
        if result.peak_memory_bytes is not None:  # (cgroup v2 has memory.peak from Linux 5.19)
            assert result.peak_memory_bytes <= 512 << 20
    else:  # the documented fallback: each process is still capped by RLIMIT_AS
        assert "memory cgroup" in ISOLATION.missing["row_memory_limit"]
        assert verdict("x = bytearray(600 << 20)\n" + CORRECT_ADD, memory_mb=512).kind == "memory"


THREADS = """
import threading
def add(a, b):
    box = []
    threads = [threading.Thread(target=lambda: box.append(1)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return a + b if len(box) == 16 else None
"""
SURVIVOR = """
import ctypes, os, time
libc = ctypes.CDLL(None)
def add(a, b):
    os.setsid()  # out of the process group
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0: no signal when the parent dies
    for _ in range(31):
        try:
            if os.fork() == 0:
                libc.prctl(1, 0, 0, 0, 0)
                libc.prctl(15, b"rlpipe-survivor", 0, 0, 0)  # PR_SET_NAME, so the test can look for it
                time.sleep(60)
                os._exit(0)
        except OSError:
            break
    return a - b
"""


def test_a_setsid_pdeathsig_survivor_with_31_children_is_gone_and_starves_no_later_row():
    """Issue 14: the sandbox's PID 1 used to survive this and exhaust `nobody`'s process limit."""
    for isolation in VARIANTS.values():
        assert verdict(SURVIVOR, isolation=isolation, max_processes=32).kind == "wrong_answer"
        assert processes_named("rlpipe-survivor") == [] and sandbox_processes() == []
        assert verdict(THREADS, isolation=isolation, max_processes=32).kind == "pass"


def test_rows_running_at_once_have_budgets_of_their_own():
    from rlpipe.stages.score import score_rows
    from tests.rewards.code.test_reward import code_table, stage_config

    completions = [SURVIVOR, THREADS] * 4
    frame, metrics = score_rows(code_table(completions, ADD_TESTS), stage_config(workers=2, max_processes=32))
    assert frame["reward"].to_list() == [0.0, 1.0] * 4
    assert metrics["errors"] == 0


# ---------------------------------------------------------------------------------------------
# Nothing shared between rows
# ---------------------------------------------------------------------------------------------

IPC_WRITER = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
def err(result):
    return result if result >= 0 else -ctypes.get_errno()
out = {}
out["shm"] = err(libc.shmget(0x5EED, 4096, 0o1666))
if out["shm"] >= 0:
    ctypes.memmove(libc.shmat(out["shm"], None, 0), b"row A was here", 14)
out["msg"] = err(libc.msgget(0x5EED, 0o1666))
out["sem"] = err(libc.semget(0x5EED, 1, 0o1666))
out["mq"] = err(libc.mq_open(b"/rlpipe-leak", os.O_CREAT | os.O_RDWR, 0o666, None))
libc.sem_open.restype = ctypes.c_void_p
out["posix_sem"] = 0 if libc.sem_open(b"/rlpipe-leak", os.O_CREAT, 0o666, 1) not in (None, 0) else -ctypes.get_errno()
try:
    with open("/dev/shm/rlpipe-leak", "w") as f:
        f.write("row A was here")
    os.chmod("/dev/shm/rlpipe-leak", 0o666)
    out["shm_file"] = 0
except OSError as exc:
    out["shm_file"] = -exc.errno
print(json.dumps(out))
"""
IPC_READER = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
found = {}
found["shm"] = libc.shmget(0x5EED, 0, 0) >= 0
found["msg"] = libc.msgget(0x5EED, 0) >= 0
found["sem"] = libc.semget(0x5EED, 0, 0) >= 0
found["mq"] = libc.mq_open(b"/rlpipe-leak", os.O_RDONLY, 0, None) >= 0
libc.sem_open.restype = ctypes.c_void_p
found["posix_sem"] = libc.sem_open(b"/rlpipe-leak", 0) not in (None, 0)
found["shm_file"] = os.path.exists("/dev/shm/rlpipe-leak")
print(json.dumps(found))
"""


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ipc_objects_do_not_outlive_their_row(name):
    isolation = VARIANTS[name]
    if "ipc_namespace" not in isolation.active and "syscall_filter" not in isolation.active:
        assert "ipc_namespace" in isolation.missing and "syscall_filter" in isolation.missing
        return  # nothing stops System V IPC here: reported, and documented in docs/reliability.md
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    created = json.loads(raw(IPC_WRITER, isolation=isolation).out)
    if "ipc_namespace" in isolation.active:
        assert created == {"shm": created["shm"], "msg": created["msg"], "sem": created["sem"], "mq": created["mq"],
                           "posix_sem": 0, "shm_file": 0} and min(created.values()) >= 0  # all made, in the row
    else:  # the syscall filter refuses the host's System V IPC and message queues (EPERM)
        assert [created[k] for k in ("shm", "msg", "sem", "mq")] == [-1] * 4
    found = json.loads(raw(IPC_READER, isolation=isolation).out)
    if "private_filesystem" in isolation.active or "per_row_uid" in isolation.active:
        assert found == dict.fromkeys(("shm", "msg", "sem", "mq", "posix_sem", "shm_file"), False)
        if os.path.isdir("/dev/shm"):
            assert set(os.listdir("/dev/shm")) == before  # nothing of the row is left on the host
    else:  # documented: running as the scoring user, the host's /dev/shm is shared (and so outlives the row)
        assert found == {"shm": False, "msg": False, "sem": False, "mq": False, "posix_sem": True, "shm_file": True}
        for leftover in ("/dev/shm/rlpipe-leak", "/dev/shm/sem.rlpipe-leak"):
            os.unlink(leftover)
    # host_unaffected: /proc/sysvipc is unchanged


KEYRINGS = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (248, 250), "aarch64": (217, 219)}[__import__("os").uname().machine]
out = {}
for name, ring in (("user", -4), ("session", -3)):
    description = b"rlpipe-leak-" + name.encode()
    out["found_" + name] = libc.syscall(NR[1], 10, ring, b"user", description, 0) >= 0  # KEYCTL_SEARCH, first
    key = libc.syscall(NR[0], b"user", description, b"secret", 6, ring)  # add_key
    out["add_" + name] = key if key >= 0 else -ctypes.get_errno()
print(json.dumps(out))
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64/aarch64")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_keys_of_one_row_are_not_found_by_the_next(name):
    isolation = VARIANTS[name]
    first, second = (json.loads(raw(KEYRINGS, isolation=isolation).out) for _ in range(2))
    assert not second["found_session"]  # the first row's key is not there
    if isolation.users != "self" or "syscall_filter" in isolation.active:
        assert not second["found_user"]  # (as the scoring user with no filter, its user keyring is the host's)
    if "syscall_filter" in isolation.active:
        assert first["add_user"] == first["add_session"] == -1  # EPERM: no keyring at all
    elif first["add_session"] > 0:  # no filter (ours, nor the container's): a fresh session keyring per case
        assert second["add_session"] > 0 and second["add_session"] != first["add_session"]
        if "per_row_uid" in isolation.active:  # and a user keyring of its own per row
            assert first["add_user"] > 0 and second["add_user"] > 0 and second["add_user"] != first["add_user"]


def test_each_case_starts_with_empty_writable_dirs():
    tests = {"inputs": ["1\n", "2\n"], "outputs": ["new\n", "new\n"]}
    code = ("import os\nprint('seen' if os.path.exists('note') else 'new')\nopen('note', 'w').write('x')\n")
    for isolation in VARIANTS.values():
        assert verdict(code, tests, isolation=isolation).kind == "pass"


# ---------------------------------------------------------------------------------------------
# Nothing left when a row returns; the host untouched
# ---------------------------------------------------------------------------------------------

DAEMON = """
import ctypes, os, time
def add(a, b):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0)
            time.sleep(1.0)
            for path in {markers!r}:
                try:
                    open(path, "w").close()
                except OSError:
                    pass
            os._exit(0)
        os._exit(0)
    time.sleep(0.3)
    return a + b
"""


def test_a_daemon_does_not_outlive_the_row(tmp_path):
    for isolation in VARIANTS.values():
        name = f"rlpd-{secrets.token_hex(4)}"
        markers = [str(tmp_path / f"{name}-was-here"), os.path.join(tempfile.gettempdir(), f"{name}-was-here")]
        assert verdict(DAEMON.format(name=name.encode(), markers=markers), isolation=isolation).kind == "pass"
        time.sleep(1.2)  # past the daemon's wake-up
        assert processes_named(name) == []
        assert not any(os.path.exists(m) for m in markers)


def test_a_killed_row_has_no_process_left_when_the_call_returns():
    programs = ["import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n",  # output_limit
                "import os, time\nfor _ in range(4):\n    os.fork()\ntime.sleep(30)\n"]  # timeout, 16 processes
    for i in range(6):
        verdict(programs[i % 2] + CORRECT_ADD, timeout_s=0.3)
        assert sandbox_processes() == [], f"call {i}: a process outlived the call"


def test_killing_the_parent_and_everything_else_fails():
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        code = f"""
import os, signal
assert os.getuid() != 0, "running as root: refusing to send kill(-1)"
for pid in (os.getppid(), 1, {os.getpid()}, {bystander.pid}, -1):
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
{CORRECT_ADD}"""
        for name, isolation in VARIANTS.items():
            if isolation.users == "self":
                continue  # the program would run as this test's user: not an experiment to run
            assert verdict(code, isolation=isolation).kind == "pass", name  # the driver was out of reach
            assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_writing_outside_the_work_dir_fails(tmp_path):
    escaped = tmp_path / "escaped.txt"
    code = f"""
import os
for target in [{str(escaped)!r}, {str(Path(sys.prefix) / 'escaped.txt')!r}]:
    try:
        open(target, "w").write("escaped")
    except OSError:
        pass
open("inside.txt", "w").write("fine")
def add(a, b):
    return a + b if open("inside.txt").read() == "fine" else None
"""
    for isolation in VARIANTS.values():
        if isolation.users == "self":
            continue
        assert verdict(code, isolation=isolation).kind == "pass"
        assert not escaped.exists() and not (Path(sys.prefix) / "escaped.txt").exists()


def test_the_parents_environment_and_files_are_not_visible(monkeypatch, tmp_path):
    secret = "hunter2-" + secrets.token_hex(8)
    monkeypatch.setenv("RLPIPE_TEST_SECRET", secret)
    private = tmp_path / "expected_outputs.json"  # where a dataset's answers could lie
    private.write_text(secret)
    private.chmod(0o600)
    code = f"""
import os
def add(a, b):
    found = [k for k, v in os.environ.items() if {secret!r} in v or k == "HOME"]
    for path in ({str(private)!r}, "/proc/%d/environ" % os.getppid(), "/proc/1/environ", "/proc/{os.getpid()}/environ"):
        try:
            if {secret!r}.encode() in open(path, "rb").read():
                found.append(path)
        except OSError:
            pass
    return a + b if not found else found
"""
    for name, isolation in VARIANTS.items():
        if isolation.users == "self":
            continue
        assert verdict(code, isolation=isolation).kind == "pass", name


def test_the_network_is_refused(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.3)
    port = server.getsockname()[1]
    by_python = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n{CORRECT_ADD}"
    by_ctypes = f"""
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", {port}) + socket.inet_aton("127.0.0.1") + bytes(8)
connected = fd >= 0 and libc.connect(fd, address, len(address)) == 0
def add(a, b):
    return None if connected else a + b
"""
    try:
        for isolation in VARIANTS.values():
            assert verdict(by_python, isolation=isolation).kind == "sandbox_refused"
            if "network_namespace" in isolation.active or "syscall_filter" in isolation.active:
                assert verdict(by_ctypes, isolation=isolation).kind == "pass"
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_what_the_sandbox_returns_holds_no_host_path():
    code = """
import os, sys, threading, traceback
def add(a, b):
    print(__import__("json").__file__, sys.prefix, sys.base_prefix, os.getcwd(), sys.path, file=sys.stderr)
    traceback.print_stack()
    threading.Thread(target=lambda: 1 / 0).start()
    raise RuntimeError(f"{sys.prefix} {os.__file__} {sys.path}")
"""
    result = verdict(code)
    assert result.kind == "runtime_error"
    returned = result.message + result.output_tail + "".join(m for _, m in result.cases)
    repo = str(Path(__file__).resolve().parents[3])
    for path in {sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix), repo, os.getcwd(),
                 os.path.expanduser("~")}:
        assert path not in returned, path
    assert "<python>" in returned


def test_redact_replaces_the_work_dir_and_leaves_other_paths():
    assert redact(f"{tempfile.gettempdir()}/rlpipe-sandbox-abc123/x.txt") == "<work>/x.txt"
    assert redact("/usr/lib/python3/x.py") == "/usr/lib/python3/x.py"


def test_a_segfault_is_a_crash_named_by_its_signal():
    result = verdict("import ctypes\ndef add(a, b):\n    ctypes.string_at(0)\n")
    assert result.kind == "crash" and "SIGSEGV" in result.message, result


@pytest.mark.parametrize("status", [1, 137, 200])
def test_an_exit_code_is_not_mistaken_for_a_signal(status):
    result = verdict(f"import os\ndef add(a, b):\n    os._exit({status})\n")
    assert result.kind == "runtime_error" and result.message.endswith(f"exit status {status}"), result


# ---------------------------------------------------------------------------------------------
# Failures of the sandbox itself: errors of the row, never a score
# ---------------------------------------------------------------------------------------------

def test_a_sandbox_that_cannot_start_raises(monkeypatch):
    monkeypatch.setattr(process, "RUNNER", "/nonexistent/runner.py")
    with pytest.raises(SandboxUnavailable, match="before starting the program"):
        verdict(CORRECT_ADD)


def test_a_case_process_that_cannot_start_raises():
    # more open files than any kernel's nr_open: setrlimit fails in the case's trusted prologue
    with pytest.raises(SandboxUnavailable, match="a test case's process could not start: ValueError"):
        verdict(CORRECT_ADD, max_open_files=(1 << 31) - 1)
    with pytest.raises(SandboxUnavailable, match="cannot prepare"):  # the work dir cannot be given to that uid
        verdict(CORRECT_ADD, isolation=variant(namespaces=False, users="shared", uid=2**32 + 5, gid=2**32 + 5))


def test_cgroups_that_cannot_be_made_raise():
    broken = variant(cgroups=CgroupHost(memory=("/nonexistent/cgroup", "v1")))
    with pytest.raises(SandboxUnavailable, match="cannot create the row's cgroups"):
        verdict(CORRECT_ADD, isolation=broken)


def test_a_driver_that_stops_reporting_raises(monkeypatch):
    monkeypatch.setattr(process, "CASE_GRACE_S", -0.9)  # the deadline passes before a 1 s case can report
    with pytest.raises(SandboxUnavailable, match="stopped reporting"):
        verdict("import time\ndef add(a, b):\n    time.sleep(0.5)\n    return a + b\n", timeout_s=1.0)


FAKE_RUNNER = """
import json, os, sys
plan = json.loads(sys.stdin.buffer.read())
fd, t = int(sys.argv[1]), plan["token"]
record = {"index": 0, "stop": "exit", "exit": 0, "wall_s": 0.0, "cpu_s": 0.0, "oom_kills": 0, "out": "",
          "err": "", "status": "eyJzdGF0dXMiOiAicmV0dXJuZWQiLCAidmFsdWUiOiA5fQ=="}
for word, payload in (("ready", {}), ("setup_error", {"message": "forged"}), ("case", record),
                      ("case", {**record, "index": 1})):
    os.write(fd, f"{t} {word} {json.dumps(payload)}\\n".encode())
"""


def test_after_ready_no_message_can_raise_a_setup_error(monkeypatch, tmp_path):
    """The parent's state machine: a setup_error line after `ready` is ignored (it was the issue's DoS)."""
    fake = tmp_path / "runner.py"
    fake.write_text(FAKE_RUNNER)
    monkeypatch.setattr(process, "RUNNER", str(fake))
    result = verdict(CORRECT_ADD, isolation=variant(cgroups=CgroupHost()), partial_credit=True)
    assert result.kind == "wrong_answer" and result.cases == (("wrong_answer", "returned 9"),) * 2


def test_sandbox_failures_are_row_errors_in_the_score_stage(monkeypatch):
    from rlpipe.stages.score import score_rows
    from tests.rewards.code.test_reward import code_table, stage_config

    monkeypatch.setattr(process, "RUNNER", "/nonexistent/runner.py")
    frame, metrics = score_rows(code_table([CORRECT_ADD] * 3, ADD_TESTS), stage_config(max_error_fraction=1.0))
    assert frame["score_error"].str.starts_with("SandboxUnavailable").to_list() == [True] * 3
    assert frame["reward_code_tests"].to_list() == [None] * 3 and metrics["errors_by_kind"] == {"SandboxUnavailable": 3}


def test_required_protections_that_are_missing_make_every_row_an_error(monkeypatch):
    weak = variant(namespaces=False)
    monkeypatch.setattr(host, "_isolation", weak)
    with pytest.raises(SandboxUnavailable, match="network_namespace"):
        score(CORRECT_ADD, required_protections=["network_namespace"])
    assert score(CORRECT_ADD, required_protections=["kill_all"]) == RewardResult(1.0, "pass")


def test_the_probe_falls_back_when_the_strongest_sandbox_cannot_start(monkeypatch):
    strongest = Isolation(True, "shared", 65534, 65534)
    plain = Isolation(False, "self", None, None)
    monkeypatch.setattr(host, "_isolation", None)
    monkeypatch.setattr(host, "_candidates", lambda: [strongest, plain])
    monkeypatch.setattr(host, "_strengthen", lambda candidate, reasons: candidate)
    real = host._works
    monkeypatch.setattr(host, "_works", lambda iso: "sandbox set-up failed: OSError: unshare: Operation not "
                        "permitted" if iso.namespaces else real(iso))
    chosen = host_isolation()
    assert not chosen.namespaces and chosen.users == "self"
    assert "unshare: Operation not permitted" in chosen.missing["network_namespace"]
    assert "kill_all" in chosen.missing and "separate_uid" in chosen.missing


FILTERED = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": {"unshare": 272, "clone3": 435, "io_uring_setup": 425, "ptrace": 101, "keyctl": 250, "bpf": 321,
                 "socket": 41, "socketpair": 53},
      "aarch64": {"unshare": 97, "clone3": 435, "io_uring_setup": 425, "ptrace": 117, "keyctl": 219, "bpf": 280,
                  "socket": 198, "socketpair": 199}}[os.uname().machine]
def errno_of(result):
    return 0 if result >= 0 else ctypes.get_errno()
pair = (ctypes.c_int * 2)()
print(json.dumps({
    "unshare_user": errno_of(libc.syscall(nr["unshare"], 0x10000000)),
    "clone3": errno_of(libc.syscall(nr["clone3"], None, 0)),
    "io_uring_setup": errno_of(libc.syscall(nr["io_uring_setup"], 1, None)),
    "ptrace_traceme": errno_of(libc.syscall(nr["ptrace"], 0, 0, 0, 0)),
    "keyctl": errno_of(libc.syscall(nr["keyctl"], 0, -3, 0)),
    "bpf": errno_of(libc.syscall(nr["bpf"], 0, None, 0)),
    "socket_inet": errno_of(libc.syscall(nr["socket"], 2, 1, 0)),
    "socketpair_unix": errno_of(libc.syscall(nr["socketpair"], 1, 1, 0, pair)),
}))
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64/aarch64")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_syscall_filter_refuses_what_it_lists(name):
    isolation = VARIANTS[name]
    if "syscall_filter" not in isolation.active:
        assert isolation.missing["syscall_filter"]
        return
    got = json.loads(raw(FILTERED, isolation=isolation).out)
    # EPERM = 1, ENOSYS = 38; an AF_UNIX socketpair (multiprocessing needs it) still works
    assert got == {"unshare_user": 1, "clone3": 38, "io_uring_setup": 38, "ptrace_traceme": 1, "keyctl": 1, "bpf": 1,
                   "socket_inet": 1, "socketpair_unix": 0}


def test_the_filter_program_checks_the_architecture_first():
    from rlpipe.rewards.code import isolate

    program = isolate.seccomp_program("x86_64", host_ipc=False)
    first = [struct_unpack(program[i:i + 8]) for i in range(0, 32, 8)]
    assert first[0] == (isolate.LD_ABS_W, 0, 0, 4)  # load seccomp_data.arch
    assert first[1] == (isolate.JEQ_K, 1, 0, 0xC000003E)  # AUDIT_ARCH_X86_64, else...
    assert first[2] == (isolate.RET_K, 0, 0, isolate.RET_KILL_PROCESS)  # ...kill the process
    with_ipc = isolate.seccomp_program("x86_64", host_ipc=True)
    assert len(with_ipc) - len(program) == 8 * 2 * len(isolate.HOST_IPC)  # two instructions per refused syscall


def struct_unpack(insn: bytes) -> tuple[int, int, int, int]:
    import struct

    return struct.unpack("=HBBI", insn)
