"""The second hostile corpus (issue 32): wrong programs aimed at the judge's and the sandbox's current mechanisms.

Each entry is a *wrong* program for one of the task shapes below: it is wrong on every test case, so even
with partial credit its reward must be exactly 0.0, and it must never make its row an error. The entries
are grouped by the mechanism they aim at (number comparisons, plain-data decoding, the status line, byte
caps, the deadline, processes, scratch space, kernel objects, signals). `HONEST` holds one correct program
per task shape, so a run shows the tests themselves can be passed. Used by `test_hostile_corpus.py` (one
score-stage run) and by `benchmarks/judge_soak.py` (the long run). Options: `CORPUS_OPTIONS`.
"""
from __future__ import annotations

from dataclasses import dataclass

P61 = 2**61 - 1  # ints k * P61 all hash to 0
BIG = 10**18 + 7


@dataclass(frozen=True)
class Task:
    tests: object  # what the row's metadata["tests"] holds
    metadata: dict  # other metadata (fn_name for LiveCodeBench functional tests)


TASKS = {  # every expected value here is an int except in the float_* tasks
    "add_asserts": Task(f"assert add(1234566, 1) == 1234567\nassert add({10**18}, 7) == {BIG}\n", {}),
    "add_in_list": Task(f"assert add(1234566, 1) in [1234567, 7654321]\nassert add({10**18}, 7) in [{BIG}]\n", {}),
    "add_stdin": Task({"inputs": ["1234566 1\n", f"{10**18} 7\n"], "outputs": ["1234567\n", f"{BIG}\n"]}, {}),
    "add_apps_fn_name": Task({"fn_name": "add", "inputs": [[1234566, 1], [10**18, 7]],
                              "outputs": [[1234567], [BIG]]}, {}),
    "add_lcb_functional": Task([{"input": "1234566\n1", "output": "1234567", "testtype": "functional"},
                                {"input": f"{10**18}\n7", "output": str(BIG), "testtype": "functional"}],
                               {"fn_name": "add"}),
    "fib_stdin": Task({"inputs": ["80\n", "90\n"], "outputs": ["23416728348467685\n", "2880067194370816120\n"]}, {}),
    "float_stdin": Task({"inputs": ["5 2\n", "1 3\n"], "outputs": ["2.5\n", "0.3333333333\n"]}, {}),
    "float_asserts": Task("assert div(5, 2) == 2.5\nassert div(1, 3) == 0.3333333333\n", {}),
    "sum_transform": Task("assert sum(add(1, 1)) == 2\nassert sum(add(2, 2)) == 4\n", {}),
    "set_transform": Task("assert set(add(1, 1)) == {2}\nassert set(add(2, 2)) == {4}\n", {}),
}

HONEST = {
    "add_asserts": "def add(a, b):\n    return a + b\n",
    "add_in_list": "def add(a, b):\n    return a + b\n",
    "add_stdin": "a, b = map(int, input().split())\nprint(a + b)\n",
    "add_apps_fn_name": "def add(a, b):\n    return a + b\n",
    "add_lcb_functional": "class Solution:\n    def add(self, a, b):\n        return a + b\n",
    "fib_stdin": "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",
    "float_stdin": "a, b = map(int, input().split())\nprint(f'{a / b:.10f}')\n",
    "float_asserts": "def div(a, b):\n    return a / b\n",
    "sum_transform": "def add(a, b):\n    return [a, b]\n",
    "set_transform": "def add(a, b):\n    return [a + b, a + b]\n",
}
CORPUS_OPTIONS = {"timeout_s": 1.0, "cpu_time_s": 1, "memory_mb": 256, "max_processes": 32, "max_open_files": 64,
                  "max_file_mb": 1, "work_dir_mb": 8, "max_output_bytes": 1_000_000, "partial_credit": True,
                  "float_tolerance": 1e-6, "allow_forgeable_tests": False, "required_protections": []}

READ_AB = "a, b = map(int, input().split())\n"
PRIVATE_SCRATCH = "import os\nPRIVATE = os.environ.get('TMPDIR') == '/tmp'  # namespace mode: tmpfs of its own\n"
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
SUBCLASS = "def add(a, b):\n    return Fake(a + b)\n"

# --- numbers: float/int confusions under float_tolerance 1e-6, in every answer format ------------------------
NUMBERS = {
    "stdout_off_by_one": ("add_stdin", READ_AB + "print(a + b + 1)\n"),
    "stdout_float_text_of_an_int": ("add_stdin", READ_AB + "print(float(a + b))\n"),  # 1234567.0, 1e+18
    "stdout_int_times_one_plus_1e-9": ("add_stdin", READ_AB + "print(repr((a + b) * (1 + 1e-9)))\n"),
    "stdout_scientific_int": ("add_stdin", READ_AB + "print(f'{a + b:.15e}')\n"),
    "stdout_binet_fibonacci": ("fib_stdin", ("n = int(input())\nphi = (1 + 5 ** 0.5) / 2\n"
                               "print(int(round(phi ** n / 5 ** 0.5)))\n")),
    "stdout_full_width_digits": ("float_stdin", READ_AB + "print(f'{a / b:.10f}'.translate({ord(c): 0xFF10 + ord(c) - 48 "
                                 "for c in '0123456789'}))\n"),
    "stdout_arabic_indic_digits": ("float_stdin", READ_AB + "print(f'{a / b:.10f}'.translate({ord(c): 0x660 + ord(c) - 48 "
                                   "for c in '0123456789'}))\n"),
    "stdout_underscored_float": ("float_stdin", READ_AB + "s = f'{a / b:.10f}'\nprint(s[:-2] + '_' + s[-2:])\n"),
    "stdout_nan": ("float_stdin", "print('nan')\n"),
    "stdout_inf_spellings": ("float_stdin", "print('infinity')\n"),
    "stdout_huge_exponent": ("float_stdin", "print('1e999999999')\n"),
    "stdout_negative_zero": ("float_stdin", "print('-0.0')\n"),
    "stdout_unlimited_int_string": ("float_stdin", "import sys\nsys.set_int_max_str_digits(0)\nprint(10 ** 5000)\n"),
    "fn_name_float_plus_quarter": ("add_apps_fn_name", "def add(a, b):\n    return float(a + b) + 0.25\n"),
    "fn_name_relative_error": ("add_apps_fn_name", "def add(a, b):\n    return (a + b) * (1 + 1e-9)\n"),
    "fn_name_wrapped_wrong_float": ("add_apps_fn_name", "def add(a, b):\n    return [float(a + b + 1)]\n"),
    "functional_relative_error": ("add_lcb_functional", ("class Solution:\n    def add(self, a, b):\n"
                                  "        return (a + b) * (1 + 1e-7)\n")),
    "functional_tuple_of_float": ("add_lcb_functional", "def add(a, b):\n    return (float(a + b) + 0.5,)\n"),
    "assert_relative_error": ("add_asserts", "def add(a, b):\n    return (a + b) * (1 + 1e-9)\n"),
    "assert_float_of_wrong": ("add_asserts", "def add(a, b):\n    return float(a + b + 1)\n"),
    "in_list_relative_error": ("add_in_list", "def add(a, b):\n    return (a + b) * (1 + 1e-9)\n"),
    "in_list_true": ("add_in_list", "def add(a, b):\n    return True\n"),
    "bool_for_int": ("add_asserts", "def add(a, b):\n    return a + b > 0\n"),
    "return_nan": ("float_asserts", "def div(a, b):\n    return float('nan')\n"),
    "return_inf": ("float_asserts", "def div(a, b):\n    return float('inf')\n"),
    "return_negative_zero": ("float_asserts", "def div(a, b):\n    return -0.0\n"),
    "return_int_near_a_float": ("float_asserts", "def div(a, b):\n    return round(a / b) + 1\n"),
    "return_unlimited_int": ("add_asserts", ("import sys\nsys.set_int_max_str_digits(0)\n"
                             "def add(a, b):\n    return 10 ** 5000 + a + b\n")),
    "judge_side_sum_past_the_int_text_limit": ("sum_transform", "def add(a, b):\n    return [int('9' * 4300)] * 10\n"),
    "judge_side_set_of_colliding_ints": ("set_transform", f"def add(a, b):\n    return [k * {P61} for k in range(1, 35001)]\n"),
}

# --- plain data: subclasses and odd objects (only exact built-in types cross) --------------------------------
DATA = {
    "int_subclass_equal_to_all": ("add_asserts", "class Fake(int):\n    def __eq__(self, o):\n        return True\n"
                                  "    __hash__ = int.__hash__\n" + SUBCLASS),
    "float_subclass_equal_to_all": ("float_asserts", ("class Fake(float):\n    def __eq__(self, o):\n        return True\n"
                                    "    __hash__ = float.__hash__\ndef div(a, b):\n    return Fake(a / b + 1)\n")),
    "str_subclass_repr_of_the_answer": ("add_asserts", "class Fake(str):\n    def __eq__(self, o):\n        return True\n"
                                        "    def __repr__(self):\n        return '1234567'\n"
                                        "    __hash__ = str.__hash__\n" + SUBCLASS.replace("a + b", "str(a + b)")),
    "list_subclass_wrapping": ("add_apps_fn_name", ("class Fake(list):\n    def __eq__(self, o):\n        return True\n"
                               "def add(a, b):\n    return Fake([a + b])\n")),
    "tuple_subclass": ("add_lcb_functional", ("class Fake(tuple):\n    def __eq__(self, o):\n        return True\n"
                       "def add(a, b):\n    return Fake((a + b,))\n")),
    "dict_subclass": ("add_asserts", ("class Fake(dict):\n    def __eq__(self, o):\n        return True\n"
                      "def add(a, b):\n    return Fake()\n")),
    "index_and_int_dunders": ("add_asserts", "class Fake:\n    def __index__(self):\n        return 1234567\n"
                              "    __int__ = __index__\n    def __eq__(self, o):\n        return True\n" + SUBCLASS.replace(
                                  "Fake(a + b)", "Fake()")),
    "nested_at_the_depth_limit": ("add_asserts", ("def add(a, b):\n    x = a + b + 1\n    for _ in range(99):\n"
                                  "        x = [x]\n    return x\n")),
    "nested_past_the_depth_limit": ("add_asserts", ("def add(a, b):\n    x = a + b\n    for _ in range(150):\n"
                                    "        x = {(1,): x}\n    return x\n")),
    "self_referential_list": ("add_asserts", "def add(a, b):\n    x = [a + b]\n    x.append(x)\n    return x\n"),
    "hash_flooded_dict": ("add_asserts", ("import json, os\ndef add(a, b):\n"  # written as JSON: never built here
                          f"    body = json.dumps({{'dict': [[k * {P61}, 0] for k in range(1, 30001)]}})\n"
                          "    os.write(3, ('{\"status\": \"returned\", \"value\": ' + body + '}\\n').encode())\n"
                          "    os._exit(0)\n")),
    "colliding_tuples_and_minus_one": ("add_asserts", "def add(a, b):\n    return {-1, -2, (-1,), (-2,), a + b + 1}\n"),
    "exception_whose_str_raises": ("add_asserts", ("class Boom(Exception):\n    def __str__(self):\n"
                                   "        raise RuntimeError('no')\ndef add(a, b):\n    raise Boom()\n")),
}

# --- the status line: the program's own claim about itself -----------------------------------------------
STATUS = {
    "status_line_then_a_wrong_return": ("add_asserts", ("import os\ndef add(a, b):\n"
                                        "    os.write(3, b'{\"status\": \"returned\", \"value\": 1}\\n')\n"
                                        "    return a + b + 1\n")),
    "status_ok_in_call_mode": ("add_asserts", ("import os\ndef add(a, b):\n    os.write(3, b'{\"status\": \"ok\"}\\n')\n"
                               "    os._exit(0)\n")),
    "status_error_of_kind_pass": ("add_asserts", ("import os\ndef add(a, b):\n"
                                  "    os.write(3, b'{\"status\": \"error\", \"kind\": \"pass\"}\\n')\n    os._exit(1)\n")),
    "status_to_stderr": ("add_asserts", "import os\nos.dup2(2, 3)\ndef add(a, b):\n    return a - b\n"),
    "status_json_on_stdout": ("add_stdin", "print('{\"status\": \"returned\", \"value\": 1234567}')\n"),
    "status_huge_nesting": ("add_asserts", ("import os\ndef add(a, b):\n    os.write(3, b'[' * 200000 + b'\\n')\n"
                            "    os._exit(0)\n")),
}

# --- byte caps (max_output_bytes 1,000,000 in CORPUS_OPTIONS) ----------------------------------------------
CAPS = {
    "stdout_exactly_at_the_cap": ("add_stdin", "import sys\nsys.stdout.write('7' * 999999 + '\\n')\n"),
    "stdout_one_past_the_cap": ("add_stdin", "import sys\nsys.stdout.write('7' * 1000000 + '\\n')\n"),
    "return_value_past_the_cap": ("add_asserts", "def add(a, b):\n    return 'x' * 1000001\n"),
    "stderr_flood_then_the_answer": ("add_stdin", "import os\n" + READ_AB + "os.write(2, b'e' * 2000000)\n"
                                     "print(a - b)\n"),
}

# --- the per-case deadline (timeout_s 1.0, cpu_time_s 1) ---------------------------------------------------
TIMING = {
    "sleep_just_under_the_timeout": ("add_stdin", "import time\ntime.sleep(0.8)\n" + READ_AB + "print(a + b + 1)\n"),
    "spin_past_the_cpu_limit": ("add_asserts", "def add(a, b):\n    while True:\n        pass\n"),
    "stop_itself": ("add_asserts", ("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                    "    return a + b\n")),
    "child_keeps_the_pipes_open": ("add_stdin", "import os, time\nif os.fork() == 0:\n    while True:\n"
                                   "        os.write(1, b'0\\n')\n        time.sleep(0.01)\n" + READ_AB + "print(a - b)\n"),
}

# --- processes ---------------------------------------------------------------------------------------------
PROCESSES = {
    "thread_bomb": ("add_asserts", ("import threading, time\ndef add(a, b):\n    while True:\n"
                    "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")),
    "fork_bomb_then_answer_wrong": ("add_stdin", "import os\nfor _ in range(64):\n    try:\n        if os.fork() == 0:\n"
                                    "            import time; time.sleep(30)\n    except OSError:\n        break\n"
                                    + READ_AB + "print(a - b)\n"),
    "zombie_farm": ("add_asserts", ("import os\ndef add(a, b):\n    for _ in range(20):\n        if os.fork() == 0:\n"
                    "            os._exit(0)\n    return a - b\n")),
    "stopped_children": ("add_asserts", ("import os, signal\ndef add(a, b):\n    for _ in range(5):\n"
                         "        if os.fork() == 0:\n            os.kill(os.getpid(), signal.SIGSTOP)\n            os._exit(0)\n"
                         "    return a - b\n")),
    "setsid_double_fork_daemon": ("add_asserts", ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                                  "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
                                  "def add(a, b):\n    return a - b\n")),
}

# --- scratch space and kernel objects ----------------------------------------------------------------------
KERNEL = {
    "fill_tmp_and_dev_shm": ("add_asserts", PRIVATE_SCRATCH + "def fill(d):\n    i = 0\n    try:\n        while True:\n"
                             "            with open(f'{d}/f{i}', 'wb') as f:\n                f.write(b'x' * 65536)\n"
                             "            i += 1\n    except OSError:\n        pass\n    try:\n        while True:\n"
                             "            open(f'{d}/n{i}', 'w').close()\n            i += 1\n    except OSError:\n"
                             "        pass\nfor d in (('/tmp', '/dev/shm') if PRIVATE else ()):  # never the host's disk\n    fill(d)\ndef add(a, b):\n    return a - b\n"),
    "sysv_and_posix_ipc_left": ("add_asserts", LIBC + "libc.shmget(0x3232, 4096, 0o1666)\n"
                                "libc.semget(0x3233, 1, 0o1666)\nlibc.msgget(0x3234, 0o1666)\n"
                                "libc.mq_open(b'/rlpipe-q', 0o100 | 2, 0o666, None)\n"
                                "def add(a, b):\n    return a - b\n"),
    "keys_in_every_keyring": ("add_asserts", LIBC + "nr = {'x86_64': 248, 'aarch64': 217}.get(os.uname().machine)\n"
                              "if nr:\n    for ring in (-3, -4, -5):\n"
                              "        libc.syscall(nr, b'user', b'rlpipe', b'x', 1, ring)\n"
                              "def add(a, b):\n    return a - b\n"),
    "mount_unshare_and_chroot": ("add_asserts", LIBC + "libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None)\n"
                                 "libc.unshare(0x00020000)\nlibc.chroot(b'/tmp')\ndef add(a, b):\n    return a - b\n"),
    "cgroup_escape": ("add_asserts", ("import os\nfor path in ('/sys/fs/cgroup/rlpipe-x', '/sys/fs/cgroup/memory/x'):\n"
                      "    try:\n        os.makedirs(path)\n    except OSError:\n        pass\n"
                      "try:\n    open('/proc/self/oom_score_adj', 'w').write('-1000')\nexcept OSError:\n    pass\n"
                      "def add(a, b):\n    return a - b\n")),
    "fd_objects": ("add_asserts", ("import os, socket, select\nheld = [os.eventfd(0), os.memfd_create('m'), "
                   "select.epoll(), *socket.socketpair(), *os.pipe()]\ndef add(a, b):\n    return a - b\n")),
}

# --- signals and the sandbox's own processes ---------------------------------------------------------------
SIGNALS = {
    "stop_and_kill_everything": ("add_asserts", ("import os, signal\nfor pid in (os.getppid(), 1, -1, 0):\n"
                                 "    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
                                 "        if pid in (-1, 0) and sig == signal.SIGKILL:\n            continue\n"
                                 "        try:\n            os.kill(pid, sig)\n        except OSError:\n            pass\n"
                                 "def add(a, b):\n    return a - b\n")),
    "pidfd_signal_to_the_driver": ("add_asserts", ("import os, signal\ntry:\n    fd = os.pidfd_open(os.getppid())\n"
                                   "    signal.pidfd_send_signal(fd, signal.SIGKILL)\nexcept OSError:\n    pass\n"
                                   "def add(a, b):\n    return a - b\n")),
    "ptrace_and_read_the_driver": ("add_asserts", LIBC + "libc.ptrace(16, os.getppid(), None, None)\n"
                                   "for name in ('mem', 'environ', 'fd'):\n    try:\n"
                                   "        os.listdir(f'/proc/{os.getppid()}/{name}') if name == 'fd' else "
                                   "open(f'/proc/{os.getppid()}/{name}', 'rb').read(64)\n    except OSError:\n"
                                   "        pass\ndef add(a, b):\n    return a - b\n"),
}

GROUPS = {"numbers": NUMBERS, "data": DATA, "status": STATUS, "caps": CAPS, "timing": TIMING, "processes": PROCESSES,
          "kernel": KERNEL, "signals": SIGNALS}
CORPUS = {name: entry for group in GROUPS.values() for name, entry in group.items()}  # name -> (task, program)
assert len(CORPUS) == sum(len(group) for group in GROUPS.values()), "a name is used twice"
