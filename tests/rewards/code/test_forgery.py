"""Forged passes: every attack of issue 14, and a corpus of our own written as an RL policy would search.

The rule under test: no wrong solution scores above the correct-answer threshold (1.0), whatever it
does from inside. Each attacker below is a *wrong* solution (``add`` returns ``a - b``, or a constant)
plus the tampering. The tests use two cases whose expected values differ (5 and 0), so that no
constant answer passes both. Where an attacker could only have passed by knowing an expected value,
a second test shows the expected value is nowhere in the sandbox to be found.
"""
from __future__ import annotations

import json

import pytest

from rlpipe.rewards.code import BadTests
from rlpipe.rewards.functions import RewardResult
from rlpipe.stages.score import score_rows
from tests.rewards.code.helpers import ADD_IO, ADD_TESTS, raw, score
from tests.rewards.code.test_reward import code_table, stage_config

WRONG = "\ndef add(a, b):\n    return a - b\n"
WRONG_IO = "\na, b = map(int, input().split())\nprint(a - b)\n"
ZERO = RewardResult(0.0, "wrong_answer")

# ---------------------------------------------------------------------------------------------
# The forgeries (they all scored 1 before)
# ---------------------------------------------------------------------------------------------

REBIND_MAIN = """
import sys, __main__
__main__.attempt = lambda *a, **k: None
frame = sys._getframe()
while frame is not None:  # every function of the runner, in every frame up the stack
    for name, value in list(frame.f_globals.items()):
        if callable(value) and not isinstance(value, type) and name not in ("add",):
            frame.f_globals[name] = lambda *a, **k: None
    frame = frame.f_back
"""
REPLACE_THROUGH_FRAMES = """
import sys
frame = sys._getframe()
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for name, value in list(scope.items()):
            if name in ("_exec", "exec", "_compile"):
                scope[name] = lambda *a, **k: None
            if isinstance(value, list):
                value.clear()  # the test list, the case list, any list
            if isinstance(value, dict) and "cases" in value:
                value["cases"] = []
    frame = frame.f_back
"""
GC_PLAN_VERDICT = """
import gc, json, os
token = next(o["token"] for o in gc.get_objects() if isinstance(o, dict) and isinstance(o.get("token"), str))
print("found the token", token)
record = {"index": 0, "stop": "exit", "exit": 0, "wall_s": 0, "cpu_s": 0, "oom_kills": 0, "out": "NQo=",
          "err": "", "status": "eyJzdGF0dXMiOiAib2sifQ=="}
lines = [f'{token} verdict {{"kind": "pass", "passed": 2, "total": 2, "message": ""}}',
         f"{token} case {json.dumps(record)}", f"{token} case {json.dumps({**record, 'index': 1})}",
         f"{token} done {{}}"]
for fd in range(1024):
    for line in lines:
        try:
            os.write(fd, (line + "\\n").encode())
        except OSError:
            pass
"""
REPORT_CLOSURE = """
import gc, inspect
calls = 0
candidates = [o for o in gc.get_objects() if type(o).__name__ == "Reporter"]
for info in inspect.stack():
    for scope in (info.frame.f_locals, info.frame.f_globals):
        candidates += [v for k, v in scope.items() if k in ("report", "reporter", "send")]
for obj in candidates:
    send = getattr(obj, "send", obj)
    for word, payload in (("case", {"index": 0, "stop": "exit", "exit": 0}), ("done", {})):
        try:
            send(word, payload)
            calls += 1
        except Exception as exc:
            print("refused:", type(exc).__name__)
print("reporter calls that went through:", calls, "of", len(candidates))
"""
REPLACE_DUMPS = """
import sys
frame = sys._getframe()
while frame is not None:
    g = frame.f_globals
    if "_dumps" in g:
        g["_dumps"] = lambda *a, **k: '{"status": "returned", "value": {"kind": "pass"}}'
    if "values" in g and hasattr(g["values"], "encode"):
        g["values"].encode = lambda value, depth=0: {"kind": "pass", "passed": 2, "total": 2}
    frame = frame.f_back
"""
SETUP_ERROR_LINE = """
import gc, os
token = next(o["token"] for o in gc.get_objects() if isinstance(o, dict) and isinstance(o.get("token"), str))
line = f'{token} setup_error {{"message": "the host is broken"}}\\n'.encode()
for fd in range(1024):
    for data in (line, b"E the host is broken"):  # also what the case prologue writes on its gate
        try:
            os.write(fd, data)
        except OSError:
            pass
"""


@pytest.mark.parametrize("attack", [REBIND_MAIN, REPLACE_THROUGH_FRAMES, GC_PLAN_VERDICT, REPORT_CLOSURE, REPLACE_DUMPS,
                                    SETUP_ERROR_LINE],
                         ids=["rebind_main", "replace_through_frames", "gc_plan_verdict", "report_closure",
                              "replace_dumps", "setup_error_line"])
def test_tampering_with_the_runner_from_inside_does_not_pass(attack):
    for tests, wrong in ((ADD_TESTS, WRONG), (ADD_IO, WRONG_IO)):
        for partial_credit in (False, True):
            result = score(attack + wrong, tests, partial_credit=partial_credit)  # a row error would raise here
            assert result.value < 1.0 and result.detail in ("wrong_answer", "runtime_error", "crash"), result


def test_the_attackers_really_reached_the_token_and_the_reporter():
    """The attacks above ran with what they looked for in hand: the token, and the reporter object."""
    assert b"found the token" in raw(GC_PLAN_VERDICT).out
    out = raw(REPORT_CLOSURE).out.decode()
    assert "refused: OSError" in out and "calls that went through: 0 of" in out and "of 0" not in out


def test_a_setup_error_line_does_not_make_the_row_an_error_in_the_stage():
    """Issue 14: one such row in ten made the stage exit 2 (max_error_fraction 0.05)."""
    completions = ["def add(a, b):\n    return a + b\n"] * 9 + [SETUP_ERROR_LINE + WRONG]
    frame, metrics = score_rows(code_table(completions, ADD_TESTS), stage_config(workers=2, max_error_fraction=0.05))
    assert metrics["errors"] == 0 and frame["reward"].to_list() == [1.0] * 9 + [0.0]


def test_a_module_level_type_does_not_fool_a_type_check():
    tests = "assert type(add(2, 3)) is int and add(2, 3) == 5\nassert type(add(-1, 1)) is int and add(-1, 1) == 0\n"
    forged = "def type(x):\n    return int\ndef add(a, b):\n    return float(a + b)\n"
    assert score(forged, tests) == ZERO
    assert score("def add(a, b):\n    return a + b\n", tests) == RewardResult(1.0, "pass")


FIND_LITERAL = """
import gc, sys
def biggest_int(objects):
    best = 0
    for obj in objects:
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else [obj]
        for item in items:
            if type(item) is int and item > best:
                best = item
    return best
def secret(*args):
    frames, frame = [], sys._getframe()
    while frame is not None:
        frames += [frame.f_code.co_consts, frame.f_locals, frame.f_globals]
        frame = frame.f_back
    return max(biggest_int(frames), biggest_int(gc.get_objects()))
"""
SCAN_MEMORY = """
import ctypes
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/mem becomes ours to read
def secret(*args):
    head, tail = b"98765", b"4" + b"321"  # never the whole needle in one piece, so this code holds none
    found = False
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if "r" not in perms:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, ValueError, OverflowError):
                continue
            at = data.find(head)
            while at >= 0 and not found:
                found = data[at + 5:at + 9] == tail
                at = data.find(head, at + 1)
    return int(head + tail) if found else 0
"""


def test_the_expected_literal_is_nowhere_in_the_sandbox():
    """co_consts, frames, gc and the process's own memory: the expected value never enters the sandbox."""
    big = 10**50 + 7  # larger than any other int in a Python process (the largest seen: 2**128 - 1)
    assert score(FIND_LITERAL, f"assert secret() == {big}\n") == ZERO
    assert score(SCAN_MEMORY, "assert secret() == 987654321\n", timeout_s=10.0, cpu_time_s=5) == ZERO
    # the same searches find the value when it is in the sandbox (here: as an argument). The memory scan looks
    # for the digits as text, so they go in as a string: an int argument is held in binary, and whether the plan's
    # JSON text of it survives in freed memory depends on the layout (a longer runner docstring moved it away)
    assert score(FIND_LITERAL, f"assert secret({big}) == {big}\n").value == 1.0
    assert score(SCAN_MEMORY, "assert secret('987654321') == 987654321\n", timeout_s=10.0, cpu_time_s=5).value == 1.0


UNITTEST_TESTS = """
import unittest
class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
unittest.main(argv=["x"], exit=False)
"""
PATCH_UNITTEST = """
import sys, unittest
unittest.TestCase.assertEqual = lambda *a, **k: None
sys.modules["unittest"].TestCase.assertTrue = lambda *a, **k: None
"""


def test_unittest_tests_are_refused_and_the_opt_in_says_forgeable():
    with pytest.raises(BadTests, match="cannot be judged outside the program"):
        score(PATCH_UNITTEST + WRONG, UNITTEST_TESTS)
    # the documented opt-in runs them inside, where the patch works: the label says how it passed
    assert score(PATCH_UNITTEST + WRONG, UNITTEST_TESTS, allow_forgeable_tests=True) == RewardResult(
        1.0, "pass_forgeable")


@pytest.mark.parametrize("returned", [
    "class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\nvalue = E()",
    "class E(int):\n    def __eq__(self, other):\n        return True\nvalue = E(5)",
    "class E(dict):\n    def __eq__(self, other):\n        return True\nvalue = E()",
    "class E:\n    __class__ = property(lambda self: int)\n    def __eq__(self, other):\n"
    "        return True\nvalue = E()",
])
def test_an_object_that_equals_everything_is_a_wrong_answer(returned):
    result = score(f"{returned}\ndef add(a, b):\n    return value\n")
    assert result == ZERO


# ---------------------------------------------------------------------------------------------
# Our own corpus: what an RL policy would try
# ---------------------------------------------------------------------------------------------

CORPUS = {  # name -> (completion, tests); every one of them is wrong
    "exit_0_at_import": ("import sys\nsys.exit(0)" + WRONG, ADD_TESTS),
    "exit_builtin": ("exit()" + WRONG, ADD_TESTS),
    "os_exit_0_at_import": ("import os\nos._exit(0)" + WRONG, ADD_TESTS),
    "os_exit_0_in_the_call": ("import os\ndef add(a, b):\n    os._exit(0)\n", ADD_TESTS),
    "exit_before_printing": ("import sys\nsys.exit(0)\nprint(5)\n", ADD_IO),
    "print_expected_looking": ("print('5')\nprint('0')\nprint('YES')\nprint('pass')\n", ADD_IO),
    "echo_the_input": ("import sys\nsys.stdout.write(sys.stdin.read())\n", ADD_IO),
    "print_every_candidate": ("print(*range(-10, 11))\n", ADD_IO),
    "read_files_for_answers": ("import glob, os\nfound = []\nfor pattern in ('/**/*.jsonl', '/**/*.parquet', "
                               "'/tmp/*', '/proc/1/cmdline', '/proc/1/environ'):\n    try:\n"
                               "        found += glob.glob(pattern, recursive=True)[:50]\n    except OSError:\n"
                               "        pass\n" + WRONG, ADD_TESTS),
    "signal_the_parent": ("import os, signal\nfor pid in (os.getppid(), 1, -1, 0):\n    for sig in (signal.SIGSTOP, "
                          "signal.SIGTERM, signal.SIGKILL):\n        try:\n            os.kill(pid, sig)\n"
                          "        except OSError:\n            pass\n" + WRONG, ADD_TESTS),
    "huge_output": ("print('5\\n' * 10**8)" + WRONG, ADD_TESTS),
    "huge_return_value": ("def add(a, b):\n    return [5] * 10**7\n", ADD_TESTS),
    "deeply_nested_return": ("def add(a, b):\n    x = []\n    for _ in range(10**5):\n        x = [x]\n    return x\n",
                             ADD_TESTS),
    "fork_bomb": ("import os\ndef add(a, b):\n    while True:\n        os.fork()\n", ADD_TESTS),
    "sleep_past_the_timeout": ("import time\ndef add(a, b):\n    time.sleep(60)\n", ADD_TESTS),
    "daemon_thread_writes_status": ("import os, threading, time\ndef spam():\n    while True:\n"
                                    "        os.write(3, b'{\"status\": \"returned\", \"value\": 5}\\n')\n"
                                    "        time.sleep(0.001)\nthreading.Thread(target=spam, daemon=True).start()\n"
                                    + WRONG, ADD_TESTS),
    "forged_status_then_exit": ("import os\ndef add(a, b):\n    os.write(3, b'{\"status\": \"returned\", "
                                "\"value\": {\"kind\": \"pass\"}}\\n')\n    os._exit(0)\n", ADD_TESTS),
    "close_the_pipes": ("import os\nfor fd in range(1024):\n    try:\n        os.close(fd)\n    except OSError:\n"
                        "        pass\n" + WRONG, ADD_TESTS),
    "return_nan": ("def add(a, b):\n    return float('nan')\n", ADD_TESTS),
    "return_a_generator": ("def add(a, b):\n    return (x for x in [5])\n", ADD_TESTS),
    "return_a_function": ("def add(a, b):\n    return add\n", ADD_TESTS),
    "return_true": ("def add(a, b):\n    return True\n", ADD_TESTS),
    "segfault": ("import ctypes\ndef add(a, b):\n    ctypes.string_at(0)\n", ADD_TESTS),
    "recursion": ("def add(a, b):\n    return add(a, b)\n", ADD_TESTS),
    "memory_bomb": ("def add(a, b):\n    return bytearray(1 << 34)\n", ADD_TESTS),
    "kill_itself": ("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n", ADD_TESTS),
    "patch_builtins": ("import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None"
                       + WRONG, ADD_TESTS),
    "replace_stdout": ("import sys\nclass Out:\n    def write(self, s):\n        return len(s)\n"
                       "    def flush(self):\n        raise SystemExit(0)\nsys.stdout = Out()\nprint(5)\n", ADD_IO),
    "atexit_prints": ("import atexit\natexit.register(lambda: print(5))\n" + WRONG_IO, ADD_IO),
    "children_print_later": ("import os, time\nif os.fork() == 0:\n    time.sleep(0.2)\n    print('5')\n"
                             "    os._exit(0)\n" + WRONG_IO, ADD_IO),
    "syntax_error": ("def add(a, b)\n    return a + b\n", ADD_TESTS),
    "name_error": ("def plus(a, b):\n    return a + b\n", ADD_TESTS),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_no_wrong_solution_reaches_the_threshold(name):
    completion, tests = CORPUS[name]
    for partial_credit in (False, True):
        result = score(completion, tests, partial_credit=partial_credit, timeout_s=1.0, memory_mb=256)
        assert result.value < 1.0, (name, result)


def test_the_whole_corpus_in_one_score_stage_run_scores_no_wrong_row():
    """All of the above at once (2 workers), between correct rows: no error, no wrong row at 1.0."""
    attacks = [REBIND_MAIN + WRONG, REPLACE_THROUGH_FRAMES + WRONG, GC_PLAN_VERDICT + WRONG, REPORT_CLOSURE + WRONG,
               REPLACE_DUMPS + WRONG, SETUP_ERROR_LINE + WRONG] + [c for c, t in CORPUS.values() if t is ADD_TESTS]
    right = "def add(a, b):\n    return a + b\n"
    completions = [right] + attacks + [right]
    frame, metrics = score_rows(code_table(completions, ADD_TESTS),
                                stage_config(workers=2, timeout_s=1.0, memory_mb=256))
    assert metrics["errors"] == 0
    assert frame["reward"].to_list() == [1.0] + [0.0] * len(attacks) + [1.0]
    assert set(metrics["details"]["code_tests"]) <= {"pass", "wrong_answer", "runtime_error", "crash", "timeout",
                                                     "memory", "output_limit", "sandbox_refused", "syntax_error"}
    assert json.dumps(metrics)  # the metrics (and the sandbox report in them) are JSON
