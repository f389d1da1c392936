"""The trusted half, without a sandbox: the data-only encoding, the comparisons, the test formats and the
judge's verdict on hand-made case records (what the sandbox would have returned)."""
from __future__ import annotations

import base64
import doctest
import json
import math
import time
import types

import pytest

from rlpipe.rewards.code import cases, judge, reward, values
from rlpipe.rewards.code.cases import BadTests, Check, parse_tests
from rlpipe.rewards.code.judge import judge_case
from rlpipe.rewards.code.process import CaseRecord


def test_doctests_pass():
    for module in (values, cases, judge, reward):
        result = doctest.testmod(module)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(values).attempted >= 5


# ---------------------------------------------------------------------------------------------
# The encoding
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, True, 0, -7, 10**40, 1.5, "", "é\n\x00", b"\x00\xff", [], [1, [2, [3]]], (), (1, "a"), {1, 2},
    frozenset({(1, 2)}), {}, {"a": 1, 2: [3], (4, 5): None, None: {6}}, float("inf"), float("-inf"),
])
def test_plain_data_round_trips_with_its_exact_types(value):
    back = values.loads(values.dumps(value))
    assert back == value and type(back) is type(value)
    if isinstance(value, (list, tuple, dict)) and value:
        inner = next(iter(value.values())) if isinstance(value, dict) else value[-1]
        assert type(next(iter(back.values())) if isinstance(back, dict) else back[-1]) is type(inner)


def test_nan_round_trips_as_nan():
    assert math.isnan(values.loads(values.dumps(float("nan"))))


class AlwaysEqual:
    def __eq__(self, other):
        return True


class SneakyInt(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [AlwaysEqual(), SneakyInt(5), [1, SneakyInt(2)], {"k": AlwaysEqual()},
                                   (x for x in ()), lambda: 1, 1j, bytearray(b"x"), range(3), Exception("x")])
def test_anything_but_plain_data_is_refused_in_the_sandbox(value):
    with pytest.raises(values.Unsupported):
        values.dumps(value)


def test_nesting_deeper_than_the_limit_is_refused_both_ways():
    deep = []
    for _ in range(values.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(values.Unsupported):
        values.dumps(deep)
    with pytest.raises(values.Unsupported):
        values.loads("[" * 5000 + "]" * 5000)


@pytest.mark.parametrize("text", [
    '{"kind": "pass"}', '{"tuple": [1], "set": [2]}', '{"float": "5"}', '{"bytes": 5}', '{"dict": [[1]]}',
    '{"set": [[1, 2]]}', "NaN", "[Infinity]", '{"dict": [[[1], 2]]}', "not json", "1" * 5000,
])
def test_the_judge_refuses_what_is_not_an_encoded_value(text):
    with pytest.raises(values.Unsupported):
        values.loads(text)


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------

def test_values_compare_with_pythons_rules_and_the_two_options():
    eq = values.values_equal
    assert eq(1, 1.0) and eq(True, 1) and not eq((1, 2), [1, 2]) and not eq([1], [1, 2])
    assert eq((1, 2), [1, 2], lists_for_tuples=True) and eq([(1, 2)], [[1, 2]], lists_for_tuples=True)
    # 0.1 + 0.2 vs 0.3 differ by 5.6e-17: equal within 1e-9, not exactly
    assert not eq(0.1 + 0.2, 0.3) and eq(0.1 + 0.2, 0.3, tolerance=1e-9)
    assert eq({"a": [1.0000001]}, {"a": [1.0]}, tolerance=1e-6) and not eq({"a": [1.01]}, {"a": [1.0]}, tolerance=1e-6)
    assert not eq({"a": [1.0000001]}, {"a": [1]}, tolerance=1e-6)  # an int expectation is exact
    assert not eq(float("nan"), float("nan"))
    assert not eq({1: 2}, {1: 2, 3: 4}) and eq({1, 2}, {2, 1})


@pytest.mark.parametrize(("actual", "expected", "tolerance", "equal"), [
    ("3\n", "3", 0, True), ("3 \r\n\n\n", "3\n", 0, True), ("1  2\n", "1 2\n", 0, True),
    ("1 2", "1\n2", 0, False), ("\n3", "3", 0, False), ("", "0", 0, False), ("3\n4", "3", 0, False),
    ("0.3333333", "0.333333333", 1e-6, True), ("0.33", "0.333333333", 1e-6, False), ("1e3", "1000.0", 1e-9, True),
    ("1e3", "1000", 1e-9, False), ("1234568", "1234567", 1e-6, False), ("1234567.0000001", "1234567", 1e-6, False),
    ("3", "3.0000001", 1e-6, True), ("3", "3.00001", 1e-6, False),
    ("nan", "nan", 1e-6, True), ("inf", "1e308", 1e-6, False), ("YES", "yes", 0, False),
])
def test_stdout_is_compared_line_by_line_token_by_token(actual, expected, tolerance, equal):
    assert values.stdout_equal(actual, expected, tolerance=tolerance) is equal


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------

def only_case(tests, **kw) -> cases.Case:
    parsed = parse_tests(tests, metadata=kw.pop("metadata", {}), allow_forgeable=kw.pop("allow_forgeable", False))
    assert len(parsed) == 1 and len(parsed[0].cases) == 1
    return parsed[0].cases[0]


def test_stdin_formats_apps_codecontests_and_livecodebench_give_the_same_cases():
    apps = parse_tests({"inputs": ["1 2\n", ["3 4", "5"]], "outputs": ["3\n", ["7", "5"]]}, metadata={},
                       allow_forgeable=False)
    contests = parse_tests(json.dumps({"input": ["1 2\n", ["3 4", "5"]], "output": ["3\n", ["7", "5"]]}),
                           metadata={}, allow_forgeable=False)
    lcb = parse_tests([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
                       {"input": "3 4\n5\n", "output": "7\n5\n"}], metadata={}, allow_forgeable=False)
    for parsed in (apps, contests, lcb):
        assert [t.cases[0].sandbox for t in parsed] == [{"mode": "stdin", "stdin": "1 2\n"},
                                                         {"mode": "stdin", "stdin": "3 4\n5\n"}]
        assert [t.cases[0].check.expected for t in parsed] == ["3\n", "7\n5\n"]
        assert all("expected" not in json.dumps(t.cases[0].sandbox) for t in parsed)


def test_call_based_apps_and_livecodebench_functional():
    apps = parse_tests({"inputs": [[[1, 2], 3]], "outputs": [[5]], "fn_name": "f"}, metadata={}, allow_forgeable=False)
    case = apps[0].cases[0]
    assert case.sandbox == {"mode": "call", "fn": "f", "args": [[1, 2], 3], "kwargs": {"dict": []}}
    assert case.check == Check("value", expected=[5], json_values=True)
    lcb = parse_tests([{"input": "[1, 2]\n3", "output": "5", "testtype": "functional"}],
                      metadata={"func_name": "g"}, allow_forgeable=False)
    assert lcb[0].cases[0].sandbox == {"mode": "call", "fn": "g", "args": [[1, 2], 3], "kwargs": {"dict": []}}
    assert lcb[0].cases[0].check.expected == 5


ASSERTS = [  # (assert, op, expected, transforms, params)
    ("assert f(2) == 4", "eq", 4, (), ()),
    ("assert 4 == f(2)", "eq", 4, (), ()),
    ("assert f(2, k=(1, 2)) != None, 'msg'", "ne", None, (), ()),
    ("assert f('a') in ['x', 'y']", "in", ["x", "y"], (), ()),
    ("assert 3 in f([1, 3])", "contains", 3, (), ()),
    ("assert f(1) is None", "is", None, (), ()),
    ("assert f(1) < 0.5", "lt", 0.5, (), ()),
    ("assert f(1)", "truthy", None, (), ()),
    ("assert not f(1)", "falsy", None, (), ()),
    ("assert sorted(f(1)) == [1, 2]", "eq", [1, 2], ("sorted",), ()),
    ("assert set(f(1)) == set((4, 5))", "eq", {4, 5}, ("set",), ()),
    ("assert round(f(1), 2) == 0.33", "eq", 0.33, (("round", 2),), ()),
    ("assert len(f(1)[0]) == 3", "eq", 3, (("index", 0), "len"), ()),
    ("assert math.isclose(f(2), 1.5, rel_tol=1e-6)", "isclose", 1.5, (), (1e-6, 0.0)),
    ("assert abs(f(2) - 1.5) < 1e-6", "abs_diff", 1.5, (), ("lt", 1e-6)),
    ("assert abs(1.5 - f(2)) <= 1e-6", "abs_diff", 1.5, (), ("le", 1e-6)),
    ("assert type(f(2)) is int", "type_is", None, (), ("int",)),
    ("assert isinstance(f(2), (list, tuple))", "isinstance", None, (), ("list", "tuple")),
    ("assert f(float('inf')) == -1", "eq", -1, (), ()),
]


@pytest.mark.parametrize(("source", "op", "expected", "transforms", "params"), ASSERTS)
def test_assert_shapes_become_checks_judged_outside(source, op, expected, transforms, params):
    case = only_case(source)
    assert case.check == Check("value", op, expected, transforms, params)
    assert case.sandbox["fn"] == "f" and set(case.sandbox) == {"mode", "fn", "args", "kwargs"}  # no expectation


def test_an_and_of_checks_is_one_test_of_several_cases():
    parsed = parse_tests("assert type(f(2)) is int and f(2) == 5", metadata={}, allow_forgeable=False)
    assert len(parsed) == 1 and [c.check.op for c in parsed[0].cases] == ["type_is", "eq"]


def test_humaneval_check_mbpp_lists_test_functions_and_constants():
    humaneval = ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
                 "    assert True, 'debug'\n    assert candidate(2) == 3\n\ncheck(inc)\n")
    parsed = parse_tests(humaneval, metadata={"entry_point": "inc"}, allow_forgeable=False)
    assert [(t.cases[0].sandbox["fn"], t.cases[0].check.expected) for t in parsed] == [("inc", 2), ("inc", 3)]
    mbpp = parse_tests(["assert f(1) == 1", "assert f(2) == 4"], metadata={}, allow_forgeable=False)
    assert len(mbpp) == 2
    old_style = parse_tests("import math\nN = 3\ndef test_a():\n    assert f(N) == 9\nassert f(2) == 4\n",
                            metadata={}, allow_forgeable=False)
    assert [t.cases[0].sandbox["args"] for t in old_style] == [[3], [2]]


@pytest.mark.parametrize(("source", "needle"), [
    ("assert f(2) == g(2)", "line 1"),
    ("def helper(x):\n    return x\nassert helper(f(1)) == 1", "line 1"),  # a helper the tests define
    ("for i in range(3):\n    assert f(i) == i", "line 1"),
    ("import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n        self.assertEqual(f(1), 1)\n",
     "line 2"),
    ("def check(candidate):\n    assert candidate(1) == 1\n", "entry_point"),
    ("assert f(1) == 1 == g(1)", "line 1"),
    ("assert f(*[1]) == 1", "* or **"),
    ("x = f(1)\nassert x == 1", "line 1"),
])
def test_tests_that_cannot_be_judged_outside_are_refused_by_name(source, needle):
    with pytest.raises(BadTests, match="cannot be judged outside the program") as info:
        parse_tests(source, metadata={}, allow_forgeable=False)
    assert needle in str(info.value) and "allow_forgeable_tests" in str(info.value)


def test_with_the_opt_in_they_run_inside_as_one_forgeable_test():
    source = "assert f(1) == 1\nfor i in range(3):\n    assert f(i) == i\ndef test_x():\n    assert f(0) == 0\n"
    parsed = parse_tests(source, metadata={}, allow_forgeable=True)
    assert [t.forgeable for t in parsed] == [False, False, True]  # f(1) and test_x's assert are judged outside
    inside = parsed[-1].cases[0]
    # inside goes everything but the asserts judged outside (test_x keeps a `pass`)
    assert inside.sandbox == {"mode": "python", "python": "for i in range(3):\n    assert f(i) == i\n\ndef test_x():\n"
                              "    pass", "test_functions": ["test_x"], "check": None}
    assert inside.check == Check("ran")


@pytest.mark.parametrize(("tests", "metadata", "needle"), [
    ("", {}, "hold no test"), ("import os\n", {}, "hold no test"), ("assert (", {}, "do not parse"),
    (42, {}, "must be a string"), ({"inputs": [1]}, {}, "'inputs' and 'outputs'"),
    ({"inputs": ["1"], "outputs": []}, {}, "same length"), ({"inputs": [1], "outputs": ["1"]}, {}, "string or a list"),
    ({"inputs": ["x"], "outputs": [1], "fn_name": "f"}, {}, "list of arguments"),
    ({"inputs": [[1]], "outputs": [1], "fn_name": "not an identifier"}, {}, "identifier"),
    ([{"input": "1", "output": "1", "testtype": "functional"}], {}, "fn_name or func_name"),
    ([{"input": "1", "output": "1", "testtype": "sql"}], {}, "unknown testtype"),
    ([{"input": "{", "output": "1", "testtype": "functional"}], {"fn_name": "f"}, "not JSON"),
    (["assert f(1) == 1", 3], {}, "object with 'input'"),
])
def test_bad_tests_name_what_is_wrong(tests, metadata, needle):
    with pytest.raises(BadTests, match=None) as info:
        parse_tests(tests, metadata=metadata, allow_forgeable=False)
    assert needle in str(info.value)


# ---------------------------------------------------------------------------------------------
# The judge on hand-made records
# ---------------------------------------------------------------------------------------------

def record(*, stop="exit", exit=0, out=b"", status=b"", oom=0, cpu=0.1) -> CaseRecord:
    return CaseRecord(index=0, stop=stop, exit=exit, wall_s=0.1, cpu_s=cpu, oom_kills=oom, out=out, err=b"",
                      status=status)


STDOUT = Check("stdout", expected="5\n")
VALUE = Check("value", expected=5)


def returned(value) -> bytes:
    return json.dumps({"status": "returned", "value": values.encode(value)}).encode()


@pytest.mark.parametrize(("rec", "check", "kind"), [
    (record(out=b"5\n"), STDOUT, "pass"),
    (record(out=b"6\n"), STDOUT, "wrong_answer"),
    (record(out=b"5\n", exit=1), STDOUT, "runtime_error"),  # right output, then a crash: a runtime error
    (record(out=b"5\n", exit=-11), STDOUT, "crash"),
    (record(out=b"5\n", stop="timeout"), STDOUT, "timeout"),
    (record(out=b"5\n", stop="output_limit"), STDOUT, "output_limit"),
    (record(out=b"5\n", oom=1), STDOUT, "memory"),
    (record(exit=-9, cpu=1.0), STDOUT, "timeout"),  # SIGKILL at the CPU limit
    (record(status=returned(5)), VALUE, "pass"),
    (record(status=returned(5.0)), VALUE, "pass"),  # Python: 5.0 == 5
    (record(status=returned(4)), VALUE, "wrong_answer"),
    (record(status=returned(5) + b"\n" + returned(5)), VALUE, "crash"),  # two status lines: not one value
    (record(status=b'{"status": "returned", "value": {"kind": "pass"}}'), VALUE, "wrong_answer"),
    (record(status=b'{"status": "unencodable", "message": "a value of type E"}'), VALUE, "wrong_answer"),
    (record(status=b""), VALUE, "crash"),  # os._exit(0) before returning
    (record(status=b'{"status": "ok"}'), VALUE, "crash"),
    (record(exit=1, status=b'{"status": "error", "kind": "memory", "message": "MemoryError"}'), VALUE, "memory"),
    (record(exit=1, status=b'{"status": "error", "kind": "pass", "message": ""}'), VALUE, "runtime_error"),
    (record(exit=1, status=b'{"status": "error", "kind": "setup_error", "message": ""}'), VALUE, "runtime_error"),
    (record(status=b'{"status": "ok"}'), Check("ran"), "pass_forgeable"),
])
def test_the_judge_reads_records_as_untrusted(rec, check, kind):
    assert judge_case(rec, check, cpu_time_s=1, tolerance=0.0)[0] == kind


FIB_93 = 12200160415121876738  # beyond float's 53 bits: Binet's formula in floats gets it wrong


@pytest.mark.parametrize(("returned_value", "check"), [
    (1234568, Check("value", expected=1234567)),  # a 7-digit answer off by one
    (float(FIB_93), Check("value", expected=FIB_93)),  # Binet's float Fibonacci
    (float(FIB_93 + 1000), Check("value", expected=FIB_93)),
    (123456790.0, Check("value", expected=[123456789], json_values=True)),  # APPS fn_name: the one-element unwrap
    ([987654320], Check("value", expected=[987654321], json_values=True)),  # LiveCodeBench functional
    (1000001, Check("value", "in", [1000000, 2000000])),  # assert f(x) in [...]
    (1000000.5, Check("value", "in", [1000000, 2000000])),
])
def test_a_float_tolerance_never_accepts_a_wrong_integer(returned_value, check):
    assert judge_case(record(status=returned(returned_value)), check, cpu_time_s=1, tolerance=1e-6)[0] == "wrong_answer"
    right = check.expected[0] if isinstance(check.expected, list) else check.expected
    assert judge_case(record(status=returned(right)), check, cpu_time_s=1, tolerance=1e-6)[0] == "pass"


def test_a_float_expectation_is_met_within_the_tolerance_by_floats_and_by_exact_enough_ints():
    close = Check("value", expected=2.5)
    assert judge_case(record(status=returned(2.5000001)), close, cpu_time_s=1, tolerance=1e-6)[0] == "pass"
    big = Check("value", expected=1e17)  # relative 1e-6 of 1e17 is 1e11, but an int answer is held to 1e-6
    assert judge_case(record(status=returned(10**17 + 3)), big, cpu_time_s=1, tolerance=1e-6)[0] == "wrong_answer"
    assert judge_case(record(status=returned(10**17)), big, cpu_time_s=1, tolerance=1e-6)[0] == "pass"
    assert judge_case(record(status=returned(1.0000001e17)), big, cpu_time_s=1, tolerance=1e-6)[0] == "pass"


def test_apps_wrapped_outputs_match_unwrapped_but_assert_checks_are_exact():
    wrapped = Check("value", expected=[5], json_values=True)
    assert judge_case(record(status=returned(5)), wrapped, cpu_time_s=1, tolerance=0)[0] == "pass"
    assert judge_case(record(status=returned([5])), wrapped, cpu_time_s=1, tolerance=0)[0] == "pass"
    assert judge_case(record(status=returned((5,))), wrapped, cpu_time_s=1, tolerance=0)[0] == "pass"
    exact = Check("value", expected=(1, 3))
    assert judge_case(record(status=returned([1, 3])), exact, cpu_time_s=1, tolerance=0)[0] == "wrong_answer"
    assert judge_case(record(status=returned((1, 3))), exact, cpu_time_s=1, tolerance=0)[0] == "pass"


def test_transforms_and_type_checks_run_on_plain_data_here():
    sorted_eq = Check("value", "eq", [1, 2, 3], ("sorted",))
    assert judge_case(record(status=returned([3, 1, 2])), sorted_eq, cpu_time_s=1, tolerance=0)[0] == "pass"
    unsortable = record(status=returned([1, "a"]))  # sorted() raises TypeError: a wrong answer, not a crash
    assert judge_case(unsortable, sorted_eq, cpu_time_s=1, tolerance=0)[0] == "wrong_answer"
    is_int = Check("value", "type_is", params=("int",))
    assert judge_case(record(status=returned(5)), is_int, cpu_time_s=1, tolerance=0)[0] == "pass"
    assert judge_case(record(status=returned(5.0)), is_int, cpu_time_s=1, tolerance=0)[0] == "wrong_answer"
    assert judge_case(record(status=returned(True)), is_int, cpu_time_s=1, tolerance=0)[0] == "wrong_answer"


class _ScriptedWatch:
    """What `process._follow` reads, scripted: each poll delivers the next report line (or waits the timeout)."""

    def __init__(self, script):
        self.script, self.lines, self.exited = list(script), [], False
        self.driver_pidfd, self.runner_output = None, bytearray()

    def poll(self, timeout):
        if self.script:
            self.lines.append(self.script.pop(0))
        else:
            time.sleep(timeout)

    def drain(self):
        pass


def _case_line(index):
    empty = base64.b64encode(b"").decode()
    return ("case", {"index": index, "stop": "exit", "exit": 0, "wall_s": 0.0, "cpu_s": 0.0, "oom_kills": 0,
                     "out": empty, "err": empty, "status": empty})


def test_the_judges_own_time_does_not_count_against_the_next_case(monkeypatch):
    from rlpipe.rewards.code import process

    monkeypatch.setattr(process, "CASE_GRACE_S", 0.0)
    limits = types.SimpleNamespace(timeout_s=0.2)
    judged = []

    def slow_judge(record):  # a judge that takes longer than a case may (a busy box, a big status line)
        time.sleep(0.4)
        judged.append(record.index)
        return True

    watch = _ScriptedWatch([("ready", {}), _case_line(0), _case_line(1)])
    process._follow(watch, None, types.SimpleNamespace(namespaces=False), limits, 2, slow_judge)
    assert judged == [0, 1]


def test_hash_flooded_sets_and_dicts_are_refused_in_linear_time():
    collide = [k * (2**61 - 1) for k in range(1, 41_001)]  # distinct ints that all hash to 0
    for raw in ({"set": collide}, {"frozenset": collide}, {"dict": [[k, 0] for k in collide]}):
        start = time.perf_counter()
        with pytest.raises(values.Unsupported, match="share one hash"):
            values.decode(raw)
        assert time.perf_counter() - start < 1.0  # building it would take seconds of the judge's CPU
    assert values.decode({"set": [5] * 41_000}) == {5}  # equal values share a hash and collapse: fine
    assert len(values.decode({"set": list(range(41_000))})) == 41_000
    some = [g + k * (2**61 - 1) for g in range(100) for k in range(1, values.MAX_SHARED_HASH + 1)]
    assert len(values.decode({"set": some})) == len(some)  # up to MAX_SHARED_HASH per hash is allowed
    returned_set = record(status=json.dumps({"status": "returned", "value": {"set": collide}}).encode())
    assert judge_case(returned_set, Check("value", expected={1, 2}), cpu_time_s=1, tolerance=0)[0] == "wrong_answer"


def test_opt_in_sends_only_the_statements_judged_inside_into_the_program():
    source = ("import math\nLIMIT = 10\ndef helper(x):\n    return x + 1\nassert f(1) == 4242\n"
              "def test_a():\n    assert f(2) == 1717\n    y = f(3)\n    assert y > 0\n"
              "def test_b():\n    assert f(4) == 9393\n")
    tests = parse_tests(source, metadata={}, allow_forgeable=True)
    assert [t.forgeable for t in tests] == [False, False, False, True]
    inside = tests[-1].cases[0].sandbox
    # the expected values judged outside never reach the program's process
    assert "4242" not in inside["python"] and "1717" not in inside["python"] and "9393" not in inside["python"]
    assert "y = f(3)" in inside["python"] and "assert y > 0" in inside["python"]
    assert "def helper(x)" in inside["python"] and "LIMIT = 10" in inside["python"]
    assert inside["test_functions"] == ["test_a", "test_b"]
    namespace = {"f": lambda x: x}
    exec(compile(inside["python"], "<inside>", "exec"), namespace)
    namespace["test_a"](), namespace["test_b"]()  # test_b is left as `pass`: runs


# ---------------------------------------------------------------------------------------------
# Holes the second hostile corpus found in the judge (tests/rewards/code/hostile_corpus.py)
# ---------------------------------------------------------------------------------------------

COLLIDING = [k * (2**61 - 1) for k in range(1, 41_001)]  # distinct ints that all hash to 0


@pytest.mark.parametrize("source", ["assert set(f(1)) == {1, 2}\n", "assert frozenset(f(1)) == frozenset({1})\n",
                                    "assert len(set(f(1))) == 3\n"])
def test_a_set_transform_of_a_returned_list_refuses_hash_flooding_in_linear_time(source):
    """`decode` refuses a flooded *set*; a returned *list* that the judge turns into a set was not checked:
    ~9 s of the scoring process's CPU per case, outside every sandbox limit."""
    check = parse_tests(source, metadata={}, allow_forgeable=False)[0].cases[0].check
    start = time.process_time()
    kind, _ = judge_case(record(status=returned(COLLIDING)), check, cpu_time_s=1, tolerance=0)
    assert (kind, time.process_time() - start < 0.5) == ("wrong_answer", True)
    assert judge_case(record(status=returned([2, 1, 2, 1])), parse_tests(
        "assert set(f(1)) == {1, 2}\n", metadata={}, allow_forgeable=False)[0].cases[0].check,
        cpu_time_s=1, tolerance=0)[0] == "pass"


def test_a_value_too_long_to_print_is_a_wrong_answer_and_not_an_error_of_the_row():
    """`sum` of returned ints can pass Python's int-to-text limit (4,300 digits) in the judge: its message
    then raised ValueError, which made the row an error (enough of them stop the stage)."""
    check = parse_tests("assert sum(f(1)) == 5\n", metadata={}, allow_forgeable=False)[0].cases[0].check
    kind, message = judge_case(record(status=returned([int("9" * 4300)] * 10)), check, cpu_time_s=1, tolerance=0)
    assert (kind, message) == ("wrong_answer", "returned <a int whose repr failed: ValueError>")
    assert values.preview([1, "a"] * 100, limit=12) == "[1, 'a', 1, "


@pytest.mark.parametrize(("actual", "equal"), [
    ("2.5000001", True), ("25e-1", True), ("+2.5", True), (".25e1", True),  # ASCII decimal notation
    ("２.５", False), ("٢.٥", False), ("2.5_0000001", False), ("2_5e-1", False),  # what float() also reads
    ("infinity", False), ("nan", False), ("0x1.4p1", False),
])
def test_under_a_tolerance_numbers_are_read_in_ascii_decimal_notation_only(actual, equal):
    """Python's float() reads full-width and Arabic-Indic digits and underscores; no judge's checker does."""
    assert values.stdout_equal(f"{actual}\n", "2.5\n", tolerance=1e-6) is equal
