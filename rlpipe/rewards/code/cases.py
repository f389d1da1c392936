"""A task's tests -> test cases to run in the sandbox, and what the judge expects of each.

Trusted code, run in the scoring process. The sandbox gets only each case's input (`Case.sandbox`);
the expectation (`Check`) never leaves this process. Formats (docs/reliability.md shows each):

  * stdin/stdout, APPS/TACO/PRIME shape without ``fn_name``: ``{"inputs": [...], "outputs": [...]}``,
    CodeContests shape ``{"input": [...], "output": [...]}``, or a list of
    ``{"input", "output", "testtype": "stdin"}`` (LiveCodeBench, Codeforces, DeepCoder). An input or
    output may be a string or a list of lines.
  * call-based: the same dict with ``"fn_name"`` (each input an argument list; an output wrapped in
    an extra one-element list, as APPS/TACO sometimes store it, also matches unwrapped), or list items
    with ``"testtype": "functional"`` (one JSON argument per input line; the function name from the
    sample's metadata ``fn_name`` or ``func_name``). Values compare as JSON data: a returned tuple
    counts as a list.
  * assert-style, Python source (HumanEval, MBPP; a list of assert strings is joined): each
    ``assert`` whose shape `convert_assert` knows becomes call-based cases judged by Python's rules
    on plain data (a tuple is not a list). Imports, docstrings, ``NAME = <literal>``, ``def test_*():``
    and HumanEval's ``def check(candidate):`` bodies made of such asserts are fine. Anything else
    cannot be judged outside the program: `BadTests` names it, unless ``allow_forgeable`` (then
    the whole source runs inside the program's process, after it, as one more test that a wrong
    program can forge; docs/reliability.md).

Any of these may come as a JSON string, as datasets often store them.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from rlpipe.rewards.code import values

__all__ = ["BadTests", "Check", "Case", "TaskTest", "parse_tests", "convert_assert"]

TRANSFORMS = ("sorted", "set", "frozenset", "list", "tuple", "len", "abs", "round", "bool", "str", "int", "float",
              "sum", "min", "max")
LITERAL_BUILDERS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "sorted": sorted, "dict": dict}
TYPES = {"int", "float", "str", "bool", "list", "tuple", "dict", "set", "frozenset", "bytes", "NoneType"}
COMPARISONS = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge",
               ast.In: "in", ast.NotIn: "not_in", ast.Is: "is", ast.IsNot: "is_not"}
FLIPPED = {"eq": "eq", "ne": "ne", "lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "in": "contains",
           "not_in": "not_contains"}


class BadTests(ValueError):
    """The tests of a row cannot be used (a data error: the row's error, never a score)."""


class Unconvertible(Exception):
    """An assert the judge cannot evaluate outside the program."""


@dataclass(frozen=True)
class Check:
    """What the judge expects of one case's output. Never sent to the sandbox."""

    kind: str  # "stdout" | "value" | "ran" (forgeable in-process tests)
    op: str = "eq"  # for "value": eq ne lt le gt ge in not_in contains not_contains is is_not truthy falsy
    #                  isclose abs_diff type_is isinstance
    expected: object = None
    transforms: tuple = ()  # applied to the returned value first: names of TRANSFORMS, ("round", n), ("index", i)
    params: tuple = ()  # isclose: (rel_tol, abs_tol); abs_diff: (comparison, tolerance); isinstance: type names
    json_values: bool = False  # tuples count as lists, and a one-element list output also matches unwrapped


@dataclass(frozen=True)
class Case:
    sandbox: dict  # what the runner gets: {"mode": "stdin", "stdin"} | {"mode": "call", "fn", "args", "kwargs"} | ...
    check: Check


@dataclass(frozen=True)
class TaskTest:
    """One test as the dataset counts it (one stdin/stdout pair, one assert): passes if all its cases do."""

    name: str  # for messages: "case 3", "line 5: assert add(2, 3) == 5"
    cases: tuple[Case, ...]
    forgeable: bool = False


# ---------------------------------------------------------------------------------------------
# Structured (JSON) formats
# ---------------------------------------------------------------------------------------------

def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"
    raise BadTests(f"{where} must be a string or a list of lines, got {type(value).__name__}")


def _stdin_test(i: int, given, expected) -> TaskTest:
    return TaskTest(f"case {i}", (Case({"mode": "stdin", "stdin": _text(given, f"input {i}")},
                                   Check("stdout", expected=_text(expected, f"output {i}"))),))


def _call_test(i: int, fn: str, args, expected) -> TaskTest:
    if not isinstance(args, list):
        raise BadTests(f"input {i} of a call-based test must be a list of arguments, got {type(args).__name__}")
    try:
        encoded = values.encode(args)
        values.encode(expected)
    except values.Unsupported as exc:
        raise BadTests(f"case {i}: {exc}") from None
    return TaskTest(f"case {i}", (Case({"mode": "call", "fn": fn, "args": encoded, "kwargs": values.encode({})},
                                   Check("value", expected=expected, json_values=True)),))


def _fn_name(fn) -> str:
    if not isinstance(fn, str) or not fn.isidentifier():
        raise BadTests(f"fn_name must be a Python identifier, got {fn!r}")
    return fn


def _from_dict(tests: dict) -> list[TaskTest]:
    if "inputs" in tests and "outputs" in tests:
        given, expected = tests["inputs"], tests["outputs"]
    elif "input" in tests and "output" in tests:
        given, expected = tests["input"], tests["output"]
    else:
        raise BadTests(f"a tests object needs 'inputs' and 'outputs' (or 'input' and 'output'), has {sorted(tests)}")
    if not isinstance(given, list) or not isinstance(expected, list) or len(given) != len(expected):
        raise BadTests("inputs and outputs must be lists of the same length")
    fn = tests.get("fn_name")
    if fn:
        return [_call_test(i, _fn_name(fn), a, e) for i, (a, e) in enumerate(zip(given, expected))]
    return [_stdin_test(i, a, e) for i, (a, e) in enumerate(zip(given, expected))]


def _from_list(tests: list, metadata: dict) -> list[TaskTest]:
    out = []
    for i, item in enumerate(tests):
        if not isinstance(item, dict) or "input" not in item or "output" not in item:
            raise BadTests(f"test {i} must be an object with 'input' and 'output'")
        testtype = item.get("testtype", "stdin")
        if testtype == "stdin":
            out.append(_stdin_test(i, item["input"], item["output"]))
        elif testtype == "functional":
            fn = item.get("fn_name") or metadata.get("fn_name") or metadata.get("func_name")
            if fn is None:
                raise BadTests(f"test {i} is functional, but neither it nor the metadata names the function "
                                 "(fn_name or func_name)")
            try:
                args = [json.loads(line) for line in _text(item["input"], f"input {i}").splitlines() if line.strip()]
                expected = json.loads(_text(item["output"], f"output {i}"))
            except json.JSONDecodeError as exc:
                raise BadTests(f"test {i}: a functional input line or output is not JSON: {exc}") from None
            out.append(_call_test(i, _fn_name(fn), args, expected))
        else:
            raise BadTests(f"test {i}: unknown testtype {testtype!r} (stdin or functional)")
    return out


# ---------------------------------------------------------------------------------------------
# Assert-style Python tests
# ---------------------------------------------------------------------------------------------

def _literal(node: ast.expr, constants: dict):
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float" and not node.keywords
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).strip().lower() in ("inf", "-inf", "+inf", "nan", "infinity", "-infinity")):
        return float(node.args[0].value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LITERAL_BUILDERS
            and not node.keywords and len(node.args) <= 1):  # set((4, 5)), tuple([1, 2]), set() (MBPP)
        try:
            return LITERAL_BUILDERS[node.func.id](*(_literal(a, constants) for a in node.args))
        except TypeError:
            raise Unconvertible(f"`{ast.unparse(node)[:80]}` is not a literal") from None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise Unconvertible(f"`{ast.unparse(node)[:80]}` is not a literal") from None


class _Context:
    def __init__(self, constants: dict, defined: set[str], rename: dict[str, str]):
        self.constants, self.defined, self.rename = constants, defined, rename

    def call(self, node: ast.expr) -> tuple[dict, tuple] | None:
        """(sandbox case, transforms) if `node` is (a transform of) a call of the program's function, else None."""
        transforms: list = []
        while True:
            if isinstance(node, ast.Subscript):
                transforms.insert(0, ("index", _literal(node.slice, self.constants)))
                node = node.value
                continue
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                return None
            name = node.func.id
            if name in TRANSFORMS and name not in self.rename:
                if name == "round" and len(node.args) == 2 and not node.keywords:
                    transforms.insert(0, ("round", _literal(node.args[1], self.constants)))
                elif len(node.args) != 1 or node.keywords:
                    raise Unconvertible(f"`{ast.unparse(node)[:80]}`: {name}() with other arguments")
                else:
                    transforms.insert(0, name)
                node = node.args[0]
                continue
            if name in self.defined or name in ("type", "isinstance", "isclose"):
                return None
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise Unconvertible(f"`{ast.unparse(node)[:80]}`: * or ** arguments")
            args = [_literal(a, self.constants) for a in node.args]
            kwargs = {k.arg: _literal(k.value, self.constants) for k in node.keywords}
            try:
                sandbox = {"mode": "call", "fn": self.rename.get(name, name), "args": values.encode(args),
                           "kwargs": values.encode(kwargs)}
            except values.Unsupported as exc:
                raise Unconvertible(f"`{ast.unparse(node)[:80]}`: {exc}") from None
            return sandbox, tuple(transforms)


def convert_assert(test: ast.expr, ctx: _Context) -> list[tuple[dict, Check]]:
    """(sandbox case, check) pairs for an assert's condition; raises Unconvertible for any other shape."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [pair for value in test.values for pair in convert_assert(value, ctx)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (found := ctx.call(test.operand)):
        return [(found[0], Check("value", "falsy", transforms=found[1]))]
    if found := ctx.call(test):
        return [(found[0], Check("value", "truthy", transforms=found[1]))]
    if isinstance(test, ast.Call) and isinstance(test.func, (ast.Name, ast.Attribute)):
        fname = test.func.id if isinstance(test.func, ast.Name) else test.func.attr
        if fname == "isclose" and len(test.args) == 2 and (found := ctx.call(test.args[0])):
            options = {k.arg: _literal(k.value, ctx.constants) for k in test.keywords}
            if set(options) - {"rel_tol", "abs_tol"}:
                raise Unconvertible(f"isclose() options {sorted(options)}")
            return [(found[0], Check("value", "isclose", _literal(test.args[1], ctx.constants), found[1],
                                     (options.get("rel_tol", 1e-9), options.get("abs_tol", 0.0))))]
        if fname == "isinstance" and len(test.args) == 2 and (found := ctx.call(test.args[0])):
            return [(found[0], Check("value", "isinstance", None, found[1], _type_names(test.args[1])))]
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, left, right = COMPARISONS.get(type(test.ops[0])), test.left, test.comparators[0]
        if op is None:
            raise Unconvertible("an unsupported comparison")
        # type(CALL) is T, type(CALL) == T
        if (op in ("is", "eq") and isinstance(left, ast.Call) and isinstance(left.func, ast.Name)
                and left.func.id == "type" and len(left.args) == 1 and (found := ctx.call(left.args[0]))):
            return [(found[0], Check("value", "type_is", None, found[1], _type_names(right)))]
        # abs(CALL - LIT) < TOL
        if (op in ("lt", "le") and isinstance(left, ast.Call) and isinstance(left.func, ast.Name)
                and left.func.id == "abs" and len(left.args) == 1 and isinstance(left.args[0], ast.BinOp)
                and isinstance(left.args[0].op, ast.Sub)):
            a, b = left.args[0].left, left.args[0].right
            found, lit = (ctx.call(a), b) if ctx.call(a) else (ctx.call(b), a)
            if found:
                return [(found[0], Check("value", "abs_diff", _literal(lit, ctx.constants), found[1],
                                         (op, _literal(right, ctx.constants))))]
        if found := ctx.call(left):
            expected = _literal(right, ctx.constants)
        elif (found := ctx.call(right)) and op in FLIPPED:
            expected, op = _literal(left, ctx.constants), FLIPPED[op]
        else:
            raise Unconvertible("neither side is a call of the program's function with literal arguments")
        if op in ("is", "is_not") and expected not in (None, True, False):
            raise Unconvertible("`is` against something other than None, True or False")
        try:
            values.encode(expected)
        except values.Unsupported as exc:
            raise Unconvertible(f"the expected value: {exc}") from None
        return [(found[0], Check("value", op, expected, found[1]))]
    raise Unconvertible("not an assert of the shapes the judge evaluates outside the program")


def _type_names(node: ast.expr) -> tuple[str, ...]:
    nodes = node.elts if isinstance(node, ast.Tuple) else [node]
    names = tuple(n.id if isinstance(n, ast.Name) else "" for n in nodes)
    if not all(name in TYPES for name in names):
        raise Unconvertible(f"`{ast.unparse(node)[:60]}` is not a built-in data type")
    return names


def _ignorable(stmt: ast.stmt, constants: dict) -> bool:
    """Statements that test nothing and need nothing of the program: imports, docstrings, constants."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass)):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant) and stmt.test.value:
        return True  # `assert True, "..."` (HumanEval)
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        try:
            constants[stmt.targets[0].id] = _literal(stmt.value, constants)
            return True
        except Unconvertible:
            return False
    return False


def _without(module: ast.Module, judged: set[int]) -> str:
    """The test source the program's process runs in opt-in mode: every statement but the asserts judged outside.

    Why: those asserts hold expected values; inside the process a wrong program could read them (from
    the source, or through `gc`) and pass the tests it runs itself. Removing them changes nothing
    else: an assert judged outside is a call with literal arguments compared with a literal, it binds
    no name. A test function left without a statement keeps a `pass`.
    """
    kept = [stmt for stmt in module.body if id(stmt) not in judged]
    for stmt in kept:
        if isinstance(stmt, ast.FunctionDef) and any(id(inner) in judged for inner in stmt.body):
            stmt.body = [inner for inner in stmt.body if id(inner) not in judged] or [ast.Pass()]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def _from_python(source: str, metadata: dict, allow_forgeable: bool) -> list[TaskTest]:
    try:
        module = ast.parse(source, "<tests>")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise BadTests(f"the tests do not parse: {exc}") from None
    constants: dict = {}
    defined = {n.name for n in module.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    entry_point = metadata.get("entry_point")
    tests: list[TaskTest] = []
    refused: list[tuple[ast.stmt, str]] = []
    judged: set[int] = set()  # id() of the asserts judged outside: never sent into the program's process
    top = _Context(constants, defined, {})

    def add(stmt: ast.stmt, ctx: _Context) -> None:
        name = f"line {stmt.lineno}: {ast.get_source_segment(source, stmt) or ast.unparse(stmt)}"[:200]
        try:
            pairs = convert_assert(stmt.test, ctx)
        except (Unconvertible, RecursionError) as exc:
            refused.append((stmt, str(exc)))
            return
        judged.add(id(stmt))
        tests.append(TaskTest(name, tuple(Case(sandbox, check) for sandbox, check in pairs)))

    for stmt in module.body:
        if _ignorable(stmt, constants):
            continue
        if isinstance(stmt, ast.Assert):
            add(stmt, top)
        elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
              and stmt.value.func.id == "check" and "check" in defined):
            continue  # HumanEval's `check(entry_point)` line: the judge calls it outside
        elif isinstance(stmt, ast.FunctionDef) and (stmt.name.startswith("test_") or stmt.name == "check"):
            params = [a.arg for a in stmt.args.args]
            rename = {}
            if stmt.name == "check":
                if len(params) != 1 or not isinstance(entry_point, str):
                    refused.append((stmt, "check(candidate) needs exactly one parameter and metadata 'entry_point'"))
                    continue
                rename = {params[0]: entry_point}
            elif params:
                refused.append((stmt, f"{stmt.name}() takes arguments"))
                continue
            ctx = _Context(dict(constants), defined - {stmt.name}, rename)
            for inner in stmt.body:
                if _ignorable(inner, ctx.constants):
                    continue
                if isinstance(inner, ast.Assert):
                    add(inner, ctx)
                else:
                    refused.append((inner, f"a statement in {stmt.name}() that is not an assert"))
        else:
            refused.append((stmt, "not an assert"))
    if refused and not allow_forgeable:
        stmt, why = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise BadTests(f"test at line {stmt.lineno} cannot be judged outside the program ({why}): "
                         f"{(ast.get_source_segment(source, stmt) or ast.unparse(stmt))[:160]!r}{more}. Only asserts "
                         "comparing a call with literal arguments to a literal can be (docs/reliability.md lists the "
                         "shapes); allow_forgeable_tests: true runs the rest inside the program's process, where a "
                         "wrong program can forge a pass")
    if refused:
        functions = [s.name for s in module.body if isinstance(s, ast.FunctionDef) and s.name.startswith("test_")]
        has_check = any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in module.body)
        tests.append(TaskTest("the tests run inside the program's process (forgeable)", (Case(
            {"mode": "python", "python": _without(module, judged), "test_functions": functions,
             "check": entry_point if has_check and isinstance(entry_point, str) else None},
            Check("ran")),), forgeable=True))
    return tests


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def parse_tests(raw, *, metadata: dict, allow_forgeable: bool) -> list[TaskTest]:
    """The tests of one row, in any format of the module docstring; raises BadTests."""
    if isinstance(raw, str) and raw.lstrip()[:1] in ("{", "["):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            pass  # Python source that starts with a bracket
    if isinstance(raw, list) and raw and all(isinstance(item, str) for item in raw):
        raw = "\n".join(raw)  # MBPP's test_list
    if isinstance(raw, dict):
        tests = _from_dict(raw)
    elif isinstance(raw, list):
        tests = _from_list(raw, metadata)
    elif isinstance(raw, str):
        tests = _from_python(raw, metadata, allow_forgeable)
    else:
        raise BadTests(f"tests must be a string (Python asserts or JSON), an object or a list, "
                         f"got {type(raw).__name__}")
    if not tests:
        raise BadTests("the tests hold no test")
    return tests
