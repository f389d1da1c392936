"""The code_tests sandbox: a hostile corpus (each case contained, scored with its kind, host unaffected),
a real set of ordinary (completion, tests) rows, and the score stage over both.

A case whose protection depends on the host is skipped, naming the protection, where
`host_isolation()` says it is not active; docs/reliability.md maps every case to its protection.
Every test is also checked by `host_unaffected` (autouse): no sandbox process, work dir or mount
is left behind.
"""
from __future__ import annotations

import doctest
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.rewards import sandbox, sandbox_process, sandbox_runner
from rlpipe.rewards.functions import RewardResult, Sample
from rlpipe.rewards.sandbox import (
    Isolation,
    SandboxLimits,
    SandboxUnavailable,
    code_tests,
    extract_code,
    host_isolation,
    run_code_tests,
)
from rlpipe.scoring import score_rows

LIMITS = SandboxLimits(timeout_s=2.0, cpu_time_s=1, memory_mb=256, max_processes=32, max_file_mb=1, work_dir_mb=8,
                       max_output_bytes=64_000)
OPTIONS = {"tests_key": "tests", "timeout_s": 2.0, "cpu_time_s": 1, "memory_mb": 256, "max_processes": 32,
           "max_file_mb": 1, "work_dir_mb": 8, "max_output_bytes": 64_000, "partial_credit": False,
           "required_protections": []}
ISOLATION = host_isolation()


def needs(*protections: str):
    missing = [p for p in protections if p not in ISOLATION.active]
    return pytest.mark.skipif(bool(missing), reason=f"protection(s) not active on this host: {missing} "
                                                    f"({[ISOLATION.missing.get(p) for p in missing]})")


def run(code: str, tests: str = "assert True", **limits) -> sandbox.SandboxResult:
    return run_code_tests(code, tests, SandboxLimits(**{**vars(LIMITS), **limits}))


def sandbox_processes() -> list[int]:
    """Live processes running the sandbox runner (zombies have an empty cmdline)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"sandbox_runner.py" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def processes_named(comm: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def work_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rlpipe-sandbox-*")}


@pytest.fixture(autouse=True)
def host_unaffected():
    mounts, dirs = Path("/proc/self/mountinfo").read_text(), work_dirs()
    yield
    assert sandbox_processes() == [], "a sandbox process outlived its call"
    assert work_dirs() == dirs, "a sandbox work dir was left behind"
    assert Path("/proc/self/mountinfo").read_text() == mounts, "a sandbox mount leaked into the host"


def test_doctests_pass():
    for module in (sandbox, sandbox_runner):
        result = doctest.testmod(module)
        assert result.attempted >= 1 and result.failed == 0, module.__name__


def test_isolation_report_names_every_protection_once():
    assert set(ISOLATION.active) | set(ISOLATION.missing) == set(sandbox.PROTECTIONS)
    assert not set(ISOLATION.active) & set(ISOLATION.missing)
    out = subprocess.run([sys.executable, "-m", "rlpipe.rewards.sandbox"], capture_output=True, text=True, check=True)
    assert all(name in out.stdout for name in sandbox.PROTECTIONS)


# ---------------------------------------------------------------------------------------------
# Hostile corpus
# ---------------------------------------------------------------------------------------------

def test_infinite_loop_hits_the_cpu_limit():
    result = run("while True:\n    pass\n", timeout_s=10.0, cpu_time_s=1)
    assert result.kind == "timeout" and "CPU" in result.message
    assert result.wall_s < 5


def test_sleeping_past_the_limit_hits_the_wall_clock():
    result = run("import time\ntime.sleep(60)\n", timeout_s=0.5)
    assert result.kind == "timeout" and "wall clock" in result.message
    assert result.wall_s < 3


@needs("process_limit")
def test_fork_bomb_is_refused_by_the_process_limit():
    result = run("import os\nwhile True:\n    os.fork()\n", max_processes=16)
    assert result.kind == "sandbox_refused", result
    assert "Resource temporarily unavailable" in result.message
    # host_unaffected: no process of it remains


@pytest.mark.parametrize("code", [
    "x = bytearray(1 << 34)\n",  # 16 GiB at once
    "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n",  # 1 MiB at a time
])
def test_memory_bomb_gets_memory_error(code):
    result = run(code, memory_mb=256)
    assert result.kind == "memory", result
    assert result.wall_s < 5


@pytest.mark.parametrize("code", [
    "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n",
    "import os\nwhile True:\n    os.write(2, b'y' * (1 << 20))\n",  # straight to the stderr fd
    "print('z' * (1 << 33))\n",  # 8 GiB in one call (fails with MemoryError first at 256 MiB)
])
def test_printing_gigabytes_is_cut_off(code):
    result = run(code)
    assert result.kind in ("output_limit", "memory"), result
    assert result.wall_s < 5
    if "while" in code:
        assert result.kind == "output_limit"


@needs("separate_uid")
def test_writing_outside_the_work_dir_fails(tmp_path):
    escaped = tmp_path / "escaped.txt"  # the test's own dir (root, 0700)
    in_tmp = Path(tempfile.gettempdir()) / f"rlpipe-escape-{secrets.token_hex(4)}"  # world-writable /tmp
    code = f"""
for target in [{str(escaped)!r}, {str(in_tmp)!r}]:
    try:
        with open(target, "w") as f:
            f.write("escaped")
    except OSError:
        pass
with open("inside.txt", "w") as f:  # the working directory is writable
    f.write("fine")
"""
    result = run(code, "assert open('inside.txt').read() == 'fine'")
    assert result.kind == "pass", result
    assert not escaped.exists()
    if "private_filesystem" in ISOLATION.active:  # else nobody may write /tmp: see docs/reliability.md
        assert not in_tmp.exists()
    in_tmp.unlink(missing_ok=True)


@needs("separate_uid")
def test_deleting_reachable_files_fails():
    victims = Path(tempfile.mkdtemp(prefix="rlpipe-victim-"))
    try:
        victims.chmod(0o755)  # readable by everyone, as most of a host's files are
        (victims / "precious.txt").write_text("keep me")
        (victims / "precious.txt").chmod(0o644)
        prefix_probe = Path(sys.prefix) / f"rlpipe-sandbox-probe-{secrets.token_hex(4)}"
        code = f"""
import os, shutil
for attempt in (lambda: os.remove({str(victims / 'precious.txt')!r}),
                lambda: shutil.rmtree({str(victims)!r}),
                lambda: open({str(prefix_probe)!r}, "w").close()):  # the interpreter's own directory
    try:
        attempt()
    except OSError:
        pass
"""
        assert run(code).kind == "pass"
        assert (victims / "precious.txt").read_text() == "keep me"
        assert not prefix_probe.exists()
    finally:
        prefix_probe.unlink(missing_ok=True)
        (victims / "precious.txt").unlink(missing_ok=True)
        victims.rmdir()


def test_the_parents_environment_is_not_visible(monkeypatch):
    secret = "hunter2-" + secrets.token_hex(8)
    monkeypatch.setenv("RLPIPE_TEST_SECRET", secret)  # in this process's environment: the sandbox must not inherit it
    # /proc/PID/environ shows a process's initial environment only, so a bystander is started with the secret
    bystander = subprocess.Popen(["sleep", "30"])
    paths = []
    if "pid_namespace" in ISOLATION.active or "separate_uid" in ISOLATION.active:
        paths = [f"/proc/{bystander.pid}/environ", f"/proc/{os.getpid()}/environ", "/proc/1/environ"]
    code = f"""
import os
def leaked():
    found = [k for k in os.environ if k in ("RLPIPE_TEST_SECRET", "HOME")]
    found += [k for k, v in os.environ.items() if {secret!r} in v]
    for path in {paths!r} + ["/proc/%d/environ" % os.getppid()]:
        try:
            if {secret.encode()!r} in open(path, "rb").read():
                found.append(path)
        except OSError:
            pass
    return found
"""
    try:
        result = run(code, "assert leaked() == [], leaked()")
    finally:
        bystander.kill()
        bystander.wait()
    assert result.kind == "pass", result


@needs("separate_uid")
def test_killing_the_parent_and_everything_else_fails():
    bystander = subprocess.Popen(["sleep", "30"])  # a host process of the scoring user
    try:
        code = f"""
import os, signal
assert os.getuid() != 0, "running as root: refusing to send kill(-1)"
for pid in (os.getppid(), {os.getpid()}, {bystander.pid}, -1):  # parent, the test, a bystander, all
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""
        result = run(code)
        assert result.kind == "pass", result  # kill(-1) spares the caller, so the program goes on
        assert bystander.poll() is None, "the sandbox killed a host process"
    finally:
        bystander.kill()
        bystander.wait()
    # this test process is still running


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.3)
    yield server
    server.close()


def assert_no_connection(server: socket.socket) -> None:
    with pytest.raises(TimeoutError):
        conn, _ = server.accept()
        conn.close()


def test_connecting_to_localhost_is_refused_by_the_socket_hook(listener):
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n")
    assert result.kind == "sandbox_refused" and "socket" in result.message, result
    assert_no_connection(listener)


@needs("network_namespace")
def test_connecting_with_raw_syscalls_finds_no_network(listener):
    port = listener.getsockname()[1]
    code = f"""
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)  # below the audit hook
address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", {port}) + socket.inet_aton("127.0.0.1") + bytes(8)
result, err = libc.connect(fd, address, len(address)), ctypes.get_errno()
"""
    result = run(code, "import errno\nassert result == -1 and err == errno.ENETUNREACH, (result, err)")
    assert result.kind == "pass", result
    assert_no_connection(listener)


@needs("pid_namespace")
def test_a_daemon_does_not_outlive_the_call(tmp_path):
    name = f"rlpd-{secrets.token_hex(4)}"  # its /proc comm name, so the test can look for it
    markers = [tmp_path / "daemon-was-here", Path(tempfile.gettempdir()) / f"{name}-was-here"]
    code = f"""
import ctypes, os, time
if os.fork() == 0:
    os.setsid()  # leaves the process group: killing the group does not reach it
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)  # PR_SET_NAME
        time.sleep(1.0)
        for path in {[str(m) for m in markers]!r}:
            try:
                open(path, "w").close()
            except OSError:
                pass
        os._exit(0)
    os._exit(0)
time.sleep(0.3)  # the daemon is named and asleep by now
"""
    assert run(code).kind == "pass"
    time.sleep(1.5)  # past the daemon's wake-up
    assert processes_named(name) == []
    assert not any(m.exists() for m in markers)


def test_a_killed_program_has_no_process_left_when_the_call_returns():
    """Killing is asynchronous: the call must wait until the sandbox's processes are gone (it once did not)."""
    programs = ["import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n",  # output_limit
                "import os, time\nfor _ in range(4):\n    os.fork()\ntime.sleep(30)\n"]  # timeout, 16 processes
    for i in range(8):
        run(programs[i % 2], timeout_s=0.2)
        assert sandbox_processes() == [], f"call {i}: a process outlived the call"


def test_exiting_early_or_forging_a_verdict_does_not_pass():
    assert run("import os\nos._exit(0)\n").kind == "crash"
    assert run("import sys\nsys.exit(0)\n").kind == "runtime_error"
    forged = "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'x verdict {\"kind\": \"pass\"}\\n')\n" \
             "    except OSError:\n        pass\nos._exit(0)\n"
    assert run(forged).kind == "crash"
    # replacing the builtins the runner uses: it bound them at start and compiled the tests first
    for patch in ("builtins.exec = lambda *a, **k: None", "builtins.compile = lambda *a, **k: None"):
        assert run(f"import builtins\n{patch}\ndef f():\n    return 1\n", "assert f() == 2").kind == "wrong_answer"


# ---------------------------------------------------------------------------------------------
# Ordinary rows: a real set of (completion, tests)
# ---------------------------------------------------------------------------------------------

TASKS = {
    "fizzbuzz": ("def test_small():\n    assert [fizzbuzz(i) for i in (1, 3, 5, 15)] == ['1', 'Fizz', 'Buzz', 'FizzBuzz']\n"
                 "assert fizzbuzz(30) == 'FizzBuzz'\nassert fizzbuzz(7) == '7'\n"),
    "is_prime": "assert is_prime(2) and is_prime(97)\nassert not is_prime(1)\nassert not is_prime(91)\n",
    "fib": "assert fib(0) == 0\nassert fib(1) == 1\nassert fib(30) == 832040\n",
    "two_sum": "assert sorted(two_sum([2, 7, 11, 15], 9)) == [0, 1]\nassert sorted(two_sum([3, 2, 4], 6)) == [1, 2]\n",
    "word_count": ("from collections import Counter\n"
                   "assert word_count('a b a') == Counter({'a': 2, 'b': 1})\nassert word_count('') == Counter()\n"),
}
RIGHT = {
    "fizzbuzz": "Here is my solution:\n```python\ndef fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
                "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n```\n",
    "is_prime": "```py\ndef is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n```",
    "fib": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "two_sum": "```python\ndef two_sum(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n"
               "        if target - x in seen:\n            return [seen[target - x], i]\n        seen[x] = i\n```",
    "word_count": "```python\nfrom collections import Counter\n\ndef word_count(text):\n    return Counter(text.split())\n\n"
                  "if __name__ == '__main__':\n    print(word_count(input()))  # not run: stdin is empty\n```",
}
WRONG = {  # plausible mistakes
    "fizzbuzz": "```python\ndef fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n"
                "        return 'Buzz'\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    return str(n)\n```",
    "is_prime": "def is_prime(n):\n    return all(n % d for d in range(2, n))\n",  # 1 is not prime
    "fib": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2) - 1\n",
    "two_sum": "def two_sum(nums, target):\n    return [0, 1]\n",
    "word_count": "def word_count(text):\n    return dict.fromkeys(text.split(), 1)\n",
}
BROKEN = {  # syntax errors
    "fizzbuzz": "```python\ndef fizzbuzz(n)\n    return str(n)\n```",
    "is_prime": "def is_prime(n):\nreturn n > 1\n",
    "fib": "def fib(n):\n    return (n\n",
}
def sample(completion: str, task: str) -> Sample:
    return Sample("Write the function.", completion, None, {"tests": TASKS[task]}, len(completion), False)


@pytest.mark.parametrize("task", sorted(RIGHT))
def test_correct_solutions_pass(task):
    assert code_tests(sample(RIGHT[task], task), **OPTIONS) == RewardResult(1.0, "pass")


@pytest.mark.parametrize("task", sorted(WRONG))
def test_wrong_solutions_fail_with_wrong_answer(task):
    assert code_tests(sample(WRONG[task], task), **OPTIONS) == RewardResult(0.0, "wrong_answer")


@pytest.mark.parametrize("task", sorted(BROKEN))
def test_syntax_errors_are_syntax_error(task):
    assert code_tests(sample(BROKEN[task], task), **OPTIONS) == RewardResult(0.0, "syntax_error")


def test_partial_credit_is_the_share_of_tests_passed():
    # WRONG is_prime: 2 and 97 prime (pass), 1 "prime" (fail), 91 not prime (pass): 2 of 3
    result = code_tests(sample(WRONG["is_prime"], "is_prime"), **{**OPTIONS, "partial_credit": True})
    assert result == RewardResult(2 / 3, "wrong_answer")
    # a timeout scores 0 even with partial credit: the run did not finish
    slow = "def is_prime(n):\n    while True:\n        pass\n"
    assert code_tests(sample(slow, "is_prime"), **{**OPTIONS, "partial_credit": True}) == RewardResult(0.0, "timeout")


def test_test_functions_and_setup_statements():
    tests = "import math\nHELPER = 3\ndef test_a():\n    assert f(HELPER) == 9\nassert f(2) == 4\ndef test_b():\n    assert f(1) == 2\n"
    result = run("def f(x):\n    return x * x\n", tests)
    assert (result.kind, result.passed, result.total) == ("wrong_answer", 2, 3)
    assert "line 7" in result.message  # the failing assert inside test_b
    failing_setup = "import no_such_module\nassert f(2) == 4\n"
    result = run("def f(x):\n    return x * x\n", failing_setup)
    assert (result.kind, result.passed, result.total) == ("runtime_error", 0, 1)


def test_runtime_errors_in_the_solution_are_runtime_error():
    result = run("def f(x):\n    return x / 0\n", "assert f(1) == 1\n")
    assert result.kind == "runtime_error" and "ZeroDivisionError" in result.message


def test_bad_tests_are_a_data_error_not_a_zero():
    with pytest.raises(ValueError, match="metadata\\['tests'\\] must be a string"):
        code_tests(Sample("q", "x = 1", None, {}, 1, False), **OPTIONS)
    with pytest.raises(ValueError, match="do not parse"):
        run("x = 1", "assert (")
    with pytest.raises(ValueError, match="hold no test"):
        run("x = 1", "import os\n")


def test_option_checks():
    with pytest.raises(ValueError, match="unknown protection"):
        code_tests(sample(RIGHT["fib"], "fib"), **{**OPTIONS, "required_protections": ["magic"]})
    with pytest.raises(ValueError, match="cpu_time_s must be an integer"):
        code_tests(sample(RIGHT["fib"], "fib"), **{**OPTIONS, "cpu_time_s": 1.5})
    with pytest.raises(ValueError, match="memory_mb must be a number > 0"):
        code_tests(sample(RIGHT["fib"], "fib"), **{**OPTIONS, "memory_mb": 0})


def test_extract_code_takes_the_last_python_block():
    assert extract_code("```python\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("```python\nc = 3\n") == "c = 3\n"  # unclosed (truncated) block
    assert extract_code("```\nplain fence\n```") == "```\nplain fence\n```"  # not tagged python: the whole text


# ---------------------------------------------------------------------------------------------
# The score stage over ordinary and hostile rows
# ---------------------------------------------------------------------------------------------

HOSTILE_ROWS = [  # (completion, kind), all against the fib tests
    ("while True:\n    pass\n", "timeout"),
    ("import time\ntime.sleep(30)\n", "timeout"),
    ("x = bytearray(1 << 34)\n", "memory"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "output_limit"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", "sandbox_refused"),
    ("import os\nos._exit(0)\n", "crash"),
]


def code_table(completions: list[str], task: str = "fib") -> pl.DataFrame:
    n = len(completions)
    return pl.DataFrame({
        "prompt_id": list(range(n)), "sample_idx": pl.Series([0] * n, dtype=pl.Int32),
        "prompt": ["Write fib(n)."] * n, "completion_text": completions, "answer": [None] * n,
        "metadata": [json.dumps({"tests": TASKS[task]})] * n,
        "completion_length": pl.Series([len(c) for c in completions], dtype=pl.Int32), "truncated": [False] * n,
    })


def stage_config(workers: int, timeout_s: float = 2.0) -> ScoreConfig:
    entry = RewardEntry("code_tests", 1.0, {**OPTIONS, "timeout_s": timeout_s})
    return ScoreConfig(rewards=(entry,), accuracy_reward="code_tests", fallback_reward=0.0, max_error_fraction=0.0,
                       workers=workers, row_timeout_s=None)


def test_score_stage_over_ordinary_rows_is_the_same_for_any_worker_count():
    completions = [RIGHT["fib"], WRONG["fib"], BROKEN["fib"]] * 4
    serial, serial_m = score_rows(code_table(completions), stage_config(workers=1))
    parallel, parallel_m = score_rows(code_table(completions), stage_config(workers=2))
    assert parallel.equals(serial) and parallel_m == serial_m
    assert serial["reward_code_tests"].to_list() == [1.0, 0.0, 0.0] * 4
    assert serial["correct"].to_list() == [True, False, False] * 4
    assert serial_m["details"] == {"code_tests": {"pass": 4, "syntax_error": 4, "wrong_answer": 4}}
    assert serial_m["errors"] == 0


@pytest.mark.slow
def test_score_stage_completes_over_hostile_rows():
    hostile = [c for c, _ in HOSTILE_ROWS]
    if "process_limit" in ISOLATION.active:
        hostile.append("import os\nwhile True:\n    os.fork()\n")
    completions = [RIGHT["fib"]] + hostile + [RIGHT["fib"]]
    frame, m = score_rows(code_table(completions), stage_config(workers=2, timeout_s=1.0))
    expected = {}
    for kind in ["pass", "pass"] + [k for _, k in HOSTILE_ROWS] + ["sandbox_refused"] * (len(hostile) - len(HOSTILE_ROWS)):
        expected[kind] = expected.get(kind, 0) + 1
    assert m["details"] == {"code_tests": dict(sorted(expected.items()))}
    assert m["errors"] == 0 and frame["reward"].to_list() == [1.0] + [0.0] * len(hostile) + [1.0]


# ---------------------------------------------------------------------------------------------
# Host fallbacks
# ---------------------------------------------------------------------------------------------

PLAIN = Isolation(False, None, None, sandbox._ALWAYS)


@pytest.mark.parametrize(("code", "kind"), [
    (RIGHT["fib"], "pass"), (WRONG["fib"], "wrong_answer"), (BROKEN["fib"], "syntax_error"),
    ("import time\ntime.sleep(30)\n", "timeout"), ("x = bytearray(1 << 34)\n", "memory"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "output_limit"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", "sandbox_refused"),
])
def test_plain_mode_scores_the_same_kinds(code, kind):
    """Without namespaces or a separate user (a non-root host): limits, socket hook, output cap still hold."""
    result = run_code_tests(code, TASKS["fib"], SandboxLimits(**{**vars(LIMITS), "timeout_s": 1.0}), PLAIN)
    assert result.kind == kind, result


def test_required_protections_that_are_missing_make_every_row_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "_isolation", Isolation(False, None, None, sandbox._ALWAYS,
                                                         {"network_namespace": "not root"}))
    with pytest.raises(SandboxUnavailable, match="network_namespace \\(not root\\)"):
        code_tests(sample(RIGHT["fib"], "fib"), **{**OPTIONS, "required_protections": ["network_namespace"]})


def test_probe_falls_back_when_the_strongest_sandbox_cannot_start(monkeypatch):
    broken = Isolation(True, 65534, 65534, ("network_namespace",))
    monkeypatch.setattr(sandbox, "_isolation", None)
    monkeypatch.setattr(sandbox, "_candidates", lambda: [broken, PLAIN])
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_run = sandbox.run_code_tests

    def run_or_fail(code, tests, limits, isolation):
        if isolation is broken:
            raise SandboxUnavailable("sandbox set-up failed: OSError: unshare: Operation not permitted")
        return real_run(code, tests, limits, isolation)
    monkeypatch.setattr(sandbox, "run_code_tests", run_or_fail)
    chosen = host_isolation()
    assert chosen.active == PLAIN.active
    assert "unshare: Operation not permitted" in chosen.missing["network_namespace"]


def test_a_sandbox_that_cannot_start_raises_instead_of_scoring_zero(monkeypatch):
    monkeypatch.setattr(sandbox_process, "RUNNER", "/nonexistent/sandbox_runner.py")
    with pytest.raises(SandboxUnavailable, match="before starting the program"):
        run_code_tests("x = 1", "assert True", LIMITS, PLAIN)


def test_a_segfault_is_a_crash_named_by_its_signal():
    result = run("import ctypes\nctypes.string_at(0)\n")  # a real fault: it kills even PID 1 of a namespace
    assert result.kind == "crash" and "SIGSEGV" in result.message, result


@pytest.mark.parametrize("status", [1, 137, 200])
def test_an_exit_code_is_not_mistaken_for_a_signal(status):
    result = run(f"import os\nos._exit({status})\n")
    assert result.kind == "crash" and result.message == f"ended without a verdict (exit status {status})", result
