"""Row filters typed by people (`rlpipe inspect --where`): parsed safely, never with eval().

Two spellings are accepted:

* SQL, parsed by polars (``pl.sql_expr``): ``reward < 0 AND truncated``,
  ``completion_text LIKE '%=%'``, ``prompt_id IN (3, 17)``;
* a polars expression in Python syntax (any text containing ``pl.``):
  ``pl.col("reward") < 0``, ``pl.col("completion_text").str.contains("1")``.
  It is walked node by node (``ast``): only ``pl.col`` / ``pl.lit`` / ``pl.len``, methods of
  expressions and their namespaces, literals, comparisons and arithmetic/boolean operators are
  allowed. No names other than ``pl``, no lambdas, no private attributes, no ``map_*``.

Any mistake becomes an ``ExpressionError`` naming the expression and what is wrong with it.
"""
from __future__ import annotations

import ast
import operator
import re
from typing import Any

import polars as pl

from rlpipe.errors import RlpipeError


class ExpressionError(RlpipeError):
    """A --where / --sort argument that cannot be parsed or evaluated."""


_PL_FUNCTIONS = {"col": pl.col, "lit": pl.lit, "len": pl.len, "all_horizontal": pl.all_horizontal,
                 "any_horizontal": pl.any_horizontal}
# Methods that run arbitrary Python on the data: pointless in a filter and the one way out of the sandbox.
_FORBIDDEN = {"map_elements", "map_batches", "map_groups", "pipe", "apply", "map", "register_plugin",
              "deserialize", "meta"}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne}
_UNARY = {ast.Invert: operator.invert, ast.USub: operator.neg, ast.UAdd: operator.pos}
_PL = object()  # stands for the name `pl` while walking the tree


def _is_polars_object(value: Any) -> bool:
    """An expression, one of its namespaces (.str, .list, ...) or a bound method of either."""
    owner = getattr(value, "__self__", value)
    return isinstance(owner, pl.Expr) or type(owner).__module__.startswith("polars.expr")


def _eval(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, text)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(e, text) for e in node.elts]
    if isinstance(node, ast.Name):
        if node.id == "pl":
            return _PL
        raise ExpressionError(f"unknown name {node.id!r} in {text!r}: write columns as pl.col(\"name\")")
    if isinstance(node, ast.Attribute):
        base = _eval(node.value, text)
        name = node.attr
        if name.startswith("_") or name in _FORBIDDEN:
            raise ExpressionError(f"attribute {name!r} is not allowed in {text!r}")
        if base is _PL:
            if name not in _PL_FUNCTIONS:
                raise ExpressionError(f"pl.{name} is not allowed in {text!r}; use one of "
                                      f"{sorted('pl.' + f for f in _PL_FUNCTIONS)}")
            return _PL_FUNCTIONS[name]
        if not _is_polars_object(base):
            raise ExpressionError(f"attribute {name!r} of a non-expression in {text!r}")
        try:
            return getattr(base, name)
        except AttributeError:
            raise ExpressionError(f"polars expressions have no attribute {name!r} (in {text!r})") from None
    if isinstance(node, ast.Call):
        func = _eval(node.func, text)
        is_pl_function = any(func is f for f in _PL_FUNCTIONS.values())
        if not (is_pl_function or (callable(func) and not isinstance(func, pl.Expr) and _is_polars_object(func))):
            raise ExpressionError(f"only polars functions and expression methods can be called in {text!r}")
        args = [_eval(a, text) for a in node.args]
        kwargs = {k.arg: _eval(k.value, text) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise ExpressionError(f"**kwargs are not allowed in {text!r}")
        return func(*args, **kwargs)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, text), _eval(node.right, text))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, text))
    if isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
        left, result = _eval(node.left, text), None
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, text)
            part = _CMPOPS[type(op)](left, right)
            result = part if result is None else result & part
            left = right
        return result
    if isinstance(node, ast.BoolOp):
        raise ExpressionError(f"use & and | (with parentheses) instead of 'and'/'or' in {text!r}")
    raise ExpressionError(f"{type(node).__name__} is not allowed in {text!r}")


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def parse_expression(text: str) -> pl.Expr:
    """A polars expression from SQL (``reward < 0``) or restricted Python polars syntax (``pl.col(...)``)."""
    text = text.strip()
    if not text:
        raise ExpressionError("empty expression")
    if re.search(r"\bpl\.", text):
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise ExpressionError(f"cannot parse {text!r}: {e.msg}") from None
        try:
            expr = _eval(tree, text)
        except ExpressionError:
            raise
        except Exception as e:  # noqa: BLE001 - a wrong argument to a polars method, reported as such
            raise ExpressionError(f"cannot build {text!r}: {type(e).__name__}: {_first_line(e)}") from None
        if not isinstance(expr, pl.Expr):
            raise ExpressionError(f"{text!r} is not a polars expression")
        return expr
    try:
        return pl.sql_expr(text)
    except Exception as e:  # noqa: BLE001 - polars raises several types for malformed SQL
        raise ExpressionError(f"cannot parse {text!r} as a SQL expression: {_first_line(e)}") from None


def filter_frame(frame: pl.DataFrame, text: str) -> pl.DataFrame:
    """Rows of ``frame`` where the expression is true; errors name the expression and the columns."""
    expr = parse_expression(text)
    try:
        return frame.filter(expr)
    except pl.exceptions.ColumnNotFoundError as e:
        message = _first_line(e).split("; valid columns")[0]
        raise ExpressionError(f"--where {text!r}: {message}; columns: {frame.columns}") from None
    except Exception as e:  # noqa: BLE001 - a type error inside polars, reported as one line
        raise ExpressionError(f"--where {text!r}: {type(e).__name__}: {_first_line(e)}") from None


def sort_frame(frame: pl.DataFrame, column: str, *, descending: bool) -> pl.DataFrame:
    """``frame`` sorted by one scalar column (ties keep key order)."""
    if column not in frame.columns:
        raise ExpressionError(f"--sort {column!r}: no such column; columns: {frame.columns}")
    if isinstance(frame.schema[column], (pl.List, pl.Array, pl.Struct)):
        raise ExpressionError(f"--sort {column!r}: a per-token list column cannot be sorted on; "
                              "sort on a scalar column (e.g. reward, advantage, completion_length, kl_ref_mean)")
    return frame.sort(column, descending=descending, nulls_last=True, maintain_order=True)
