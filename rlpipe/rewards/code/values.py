"""The data-only encoding of call arguments and return values, and the comparisons the judge makes.

Standard library only: the sandbox's runner imports this file by path (it never imports rlpipe).

Why an encoding of our own: a function's return value crosses from the untrusted process to the
judge, and the judge must never hold an object the program made (an ``__eq__`` that is always
true, an ``int`` subclass, a ``__reduce__``). So the sandbox writes the value as JSON, and the
judge rebuilds plain built-in data from it, refusing anything else. JSON alone loses what Python
asserts compare (a tuple is not a list, ``{1, 2}`` is a set, dict keys need not be strings), so
those travel tagged, as a one-key object::

    None, bool, int, str, finite float     themselves
    list                                   a JSON array
    tuple / set / frozenset                {"tuple": [...]}, {"set": [...]}, {"frozenset": [...]}
    dict                                   {"dict": [[key, value], ...]}
    bytes                                  {"bytes": "<hex>"}
    nan, inf, -inf                         {"float": "nan"}, {"float": "inf"}, {"float": "-inf"}

Only these exact types encode (``type(x) is int``, not ``isinstance``); anything else is
`Unsupported` in the sandbox and a wrong answer in the judge.
"""
from __future__ import annotations

import json
import math
import re

__all__ = ["Unsupported", "MAX_DEPTH", "encode", "dumps", "decode", "loads", "values_equal", "numbers_equal", "stdout_lines",
           "stdout_equal", "checked_set", "preview"]

MAX_DEPTH = 100  # nesting of containers; deeper is refused on both sides
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "float")


class Unsupported(ValueError):
    """A value outside the data-only encoding (its type, its depth or a non-finite JSON number)."""


def encode(value, depth: int = 0):
    """Plain data -> JSON-ready structure (see the module docstring); raises Unsupported.

    >>> encode({(1, 2): [None, 1.5, {3}]})
    {'dict': [[{'tuple': [1, 2]}, [None, 1.5, {'set': [3]}]]]}
    """
    if depth > MAX_DEPTH:
        raise Unsupported(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"float": "nan" if value != value else ("inf" if value > 0 else "-inf")}
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind is tuple:
        return {"tuple": [encode(item, depth + 1) for item in value]}
    if kind is set or kind is frozenset:
        return {kind.__name__: [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    raise Unsupported(f"a value of type {kind.__name__} (only None, bool, int, float, str, bytes, list, tuple, "
                      "dict, set and frozenset are compared)")


def dumps(value) -> str:
    """The encoded value as one line of JSON."""
    try:
        return json.dumps(encode(value), separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError) as exc:  # ValueError: an int past sys.get_int_max_str_digits()
        if isinstance(exc, Unsupported):
            raise
        raise Unsupported(f"cannot encode: {type(exc).__name__}: {str(exc)[:200]}") from None


def _refuse_constant(name: str):
    raise Unsupported(f"bare JSON constant {name}")


def loads(text: str | bytes):
    """JSON text from the other side -> plain data; raises Unsupported for anything off the encoding.

    >>> loads('{"dict":[[{"tuple":[1,2]},[null,1.5,{"set":[3]}]]]}')
    {(1, 2): [None, 1.5, {3}]}
    >>> try:
    ...     loads('{"kind": "pass"}')
    ... except Unsupported as exc:
    ...     print(exc)
    an object that is not a tagged value: ['kind']
    """
    try:
        raw = json.loads(text, parse_constant=_refuse_constant)
    except Unsupported:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise Unsupported(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    return decode(raw)


MAX_SHARED_HASH = 32  # distinct keys of one set or dict that may share a hash value


def _refuse_hash_flooding(keys: list, tag: str) -> None:
    """Refuse keys of which many distinct ones share one hash, in O(n), before a set or dict is built of them.

    Why: building a set of n distinct values with one hash takes O(n^2) comparisons in the scoring
    process, outside every sandbox limit: 41,000 integers k * (2**61 - 1) (all hash to 0) cost ~7 s of
    the judge's CPU per test case. Honest values almost never share a hash; equal values may (they
    collapse), so only distinct values are counted.
    """
    if len(keys) <= MAX_SHARED_HASH:
        return
    by_hash: dict[int, list] = {}
    for key in keys:  # hash(): TypeError for an unhashable key, the caller's Unsupported
        by_hash.setdefault(hash(key), []).append(key)
    for same_hash in by_hash.values():
        if len(same_hash) <= MAX_SHARED_HASH:
            continue
        distinct: list = []  # equal values are fine: each key is compared with at most MAX_SHARED_HASH kept ones
        for key in same_hash:
            if not any(key == seen for seen in distinct):
                distinct.append(key)
                if len(distinct) > MAX_SHARED_HASH:
                    raise Unsupported(f"a {tag} of which more than {MAX_SHARED_HASH} distinct values share one "
                                      "hash (hash flooding)")


def checked_set(items, *, frozen: bool = False) -> set | frozenset:
    """``set(items)`` (or frozenset) of untrusted plain data, refusing hash flooding first (`Unsupported`).

    Why: a judge-side ``set(...)`` transform (``assert set(f(x)) == {...}``) builds a set of a returned
    *list*, which `decode` never checked as a set; 41,000 ints that hash alike would cost seconds there.
    """
    items = list(items)
    _refuse_hash_flooding(items, "frozenset" if frozen else "set")  # TypeError for an unhashable one, as set()
    return frozenset(items) if frozen else set(items)


def preview(value, limit: int = 120) -> str:
    """``repr(value)`` cut to `limit` characters, for messages; never raises.

    Why: the repr of untrusted data can fail in the judge (an int past ``sys.get_int_max_str_digits()``,
    made by a ``sum`` transform of returned ints); a message must not turn a wrong answer into a row error.
    """
    try:
        return repr(value)[:limit]
    except (ValueError, RecursionError, MemoryError) as exc:
        return f"<a {type(value).__name__} whose repr failed: {type(exc).__name__}>"


def decode(raw, depth: int = 0):
    """A parsed JSON structure -> plain data (the inverse of `encode`); raises Unsupported."""
    if depth > MAX_DEPTH:
        raise Unsupported(f"nested deeper than {MAX_DEPTH}")
    kind = type(raw)
    if raw is None or kind in (bool, int, str):
        return raw
    if kind is float:
        if not math.isfinite(raw):
            raise Unsupported("a non-finite JSON number")
        return raw
    if kind is list:
        return [decode(item, depth + 1) for item in raw]
    if kind is not dict or len(raw) != 1 or next(iter(raw)) not in _TAGS:
        raise Unsupported(f"an object that is not a tagged value: {sorted(raw)[:5] if kind is dict else kind.__name__}")
    tag, body = next(iter(raw.items()))
    try:
        if tag == "float":
            if body not in ("nan", "inf", "-inf"):
                raise Unsupported(f"float tag {body!r}")
            return float(body)
        if tag == "bytes":
            if type(body) is not str:
                raise Unsupported("bytes tag without a hex string")
            return bytes.fromhex(body)
        if type(body) is not list:
            raise Unsupported(f"{tag} tag without a list")
        if tag == "dict":
            if not all(type(pair) is list and len(pair) == 2 for pair in body):
                raise Unsupported("dict tag without [key, value] pairs")
            pairs = [(decode(k, depth + 1), decode(v, depth + 1)) for k, v in body]
            _refuse_hash_flooding([k for k, _ in pairs], tag)
            return dict(pairs)
        items = [decode(item, depth + 1) for item in body]
        if tag != "tuple":
            _refuse_hash_flooding(items, tag)
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    except TypeError as exc:  # an unhashable key or set element
        raise Unsupported(f"{tag}: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, Unsupported):
            raise
        raise Unsupported(f"{tag}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Comparisons (the judge's side; every operand is plain built-in data)
# ---------------------------------------------------------------------------------------------

def numbers_equal(actual, expected, tolerance: float) -> bool:
    """``actual == expected`` for two numbers (int or float), with ``tolerance`` where the expectation is a float.

    Why the expectation decides: an int expected value is an exact answer (a count, an index, a
    Fibonacci number), and a relative tolerance would accept any 7-digit answer +-1, or a float
    approximation of an 18-digit one; so an int expectation is met only exactly. A float expectation
    is met within ``tolerance``, relative or absolute, by a float; by an int only within the absolute
    distance (an int answer is exact too: it must be that close, whatever its size).

    >>> numbers_equal(1234568, 1234567, 1e-6), numbers_equal(1234567.0, 1234567, 1e-6)
    (False, True)
    >>> numbers_equal(2.0000001, 2.0, 1e-6), numbers_equal(10**17 + 3, 1e17, 1e-6)
    (True, False)
    """
    if actual == expected:
        return True
    if tolerance <= 0 or type(expected) is not float or not math.isfinite(expected):
        return False
    if type(actual) is float:
        return math.isclose(actual, expected, rel_tol=tolerance, abs_tol=tolerance)
    # imported here, not at the top: only the judge needs it, and the sandbox's runner imports this module at
    # every row's start (fractions brings decimal: 2-9 ms of each row's set-up on the 2-core box)
    from fractions import Fraction

    return abs(Fraction(actual) - Fraction(expected)) <= tolerance  # exactly: int - float would round the int


def values_equal(actual, expected, *, tolerance: float = 0.0, lists_for_tuples: bool = False, depth: int = 0) -> bool:
    """Python's ``actual == expected`` on plain data, with two options.

    ``tolerance`` > 0: a float expected value is met within that distance (`numbers_equal`: an int
    expected value only exactly), also inside lists, tuples and dict values (not inside sets or dict
    keys, which hash).
    ``lists_for_tuples``: a tuple counts as a list, as JSON (which has no tuples) wrote the expected
    value (APPS/TACO call-based tests).

    >>> values_equal([1, 2.0000001], [1, 2.0], tolerance=1e-6), values_equal([1, 2.0000001], [1, 2], tolerance=1e-6)
    (True, False)
    >>> values_equal((1, 2), [1, 2])
    False
    >>> values_equal((1, 2), [1, 2], lists_for_tuples=True)
    True
    """
    if depth > MAX_DEPTH:
        return False
    if lists_for_tuples and type(actual) is tuple:
        actual = list(actual)
    numbers = (int, float)
    if type(actual) in numbers and type(expected) in numbers:
        return numbers_equal(actual, expected, tolerance)
    if type(actual) in (list, tuple) and type(actual) is type(expected):
        return len(actual) == len(expected) and all(
            values_equal(a, e, tolerance=tolerance, lists_for_tuples=lists_for_tuples, depth=depth + 1)
            for a, e in zip(actual, expected))
    if type(actual) is dict and type(expected) is dict:
        return actual.keys() == expected.keys() and all(
            values_equal(actual[k], expected[k], tolerance=tolerance, lists_for_tuples=lists_for_tuples,
                         depth=depth + 1) for k in expected)
    try:
        return bool(actual == expected)
    except RecursionError:
        return False


def stdout_lines(text: str) -> list[list[str]]:
    """Output as judged: lines of whitespace-separated tokens, trailing blank lines dropped.

    >>> stdout_lines("1 2  \\n\\n3\\r\\n\\n\\n")
    [['1', '2'], [], ['3']]
    """
    lines = [line.split() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


_INTEGER_TOKEN = re.compile(r"[+-]?[0-9]+")
# What the judge reads as a number under a tolerance: ASCII decimal notation only. Python's float() also takes
# "1_0.5", full-width and Arabic-Indic digits and "infinity"; no judge's checker does, so neither does this one.
_DECIMAL_TOKEN = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _token_equal(actual: str, expected: str, tolerance: float) -> bool:
    """Tokens equal as text; with a tolerance, an expected float token is met by a number within it
    (`numbers_equal`), both written in ASCII decimal notation; an expected integer token only by the same text."""
    if actual == expected:
        return True
    if tolerance <= 0 or _INTEGER_TOKEN.fullmatch(expected):
        return False
    if not (_DECIMAL_TOKEN.fullmatch(actual) and _DECIMAL_TOKEN.fullmatch(expected)):
        return False
    try:
        e = float(expected)
        a = int(actual) if _INTEGER_TOKEN.fullmatch(actual) else float(actual)
    except ValueError:
        return False
    return math.isfinite(a) and numbers_equal(a, e, tolerance)


def stdout_equal(actual: str, expected: str, *, tolerance: float = 0.0) -> bool:
    """Same lines of the same tokens (`stdout_lines`); with a tolerance, numeric tokens within it.

    >>> stdout_equal("3.0000001\\nYES \\n", "3.0\\nYES", tolerance=1e-6), stdout_equal("1 2", "1\\n2")
    (True, False)
    >>> stdout_equal("3.0000001", "3", tolerance=1e-6)  # an integer answer is exact
    False
    """
    got, want = stdout_lines(actual), stdout_lines(expected)
    return len(got) == len(want) and all(
        len(g) == len(w) and all(_token_equal(a, e, tolerance) for a, e in zip(g, w)) for g, w in zip(got, want))
