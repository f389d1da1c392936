"""rlpipe.data.exprs: the --where / --sort parser accepts SQL and restricted polars syntax, and nothing else."""
import polars as pl
import pytest

from rlpipe.data.exprs import ExpressionError, filter_frame, parse_expression, sort_frame

FRAME = pl.DataFrame({"reward": [1.0, -1.0, 0.5], "truncated": [True, False, True], "text": ["a1", "b", "c1"],
                      "lp": [[-1.0, -2.0], [-0.5], [-3.0, -1.0]]})


@pytest.mark.parametrize("text,rows", [
    ("reward < 0", [1]), ("truncated", [0, 2]), ("reward > 0 AND truncated", [0, 2]), ("NOT truncated", [1]),
    ("text LIKE '%1'", [0, 2]), ("reward IN (0.5, -1)", [1, 2]),
    ('pl.col("reward") < 0', [1]), ('(pl.col("reward") > 0) & ~pl.col("truncated")', []),
    ('pl.col("text").str.contains("1")', [0, 2]), ('0 < pl.col("reward") <= 1', [0, 2]),
    ('pl.col("lp").list.len() == 2', [0, 2]), ('pl.col("reward").is_between(-2, 0.6)', [1, 2]),
    ('pl.col("lp").list.min() < -2.5', [2]), ('pl.col("reward") * 2 + 1 >= 3', [0]),
])
def test_accepted_expressions(text, rows):
    got = filter_frame(FRAME.with_row_index("i"), text)["i"].to_list()
    assert got == rows


@pytest.mark.parametrize("text,message", [
    ("", "empty expression"),
    ("reward <", "as a SQL expression"),
    ("SELECT 1", "as a SQL expression"),
    ("reward < 0; DROP TABLE t", "as a SQL expression"),
    ('pl.col("reward").map_batches(print) > 0', "'map_batches' is not allowed"),
    ('pl.col("reward").pipe(print)', "'pipe' is not allowed"),
    ("pl.col.__globals__", "'__globals__' is not allowed"),
    ('pl.col("reward") if True else 0', "IfExp is not allowed"),
    ("(lambda: 0)() or pl.col('x')", "use & and |"),
    ("pl.col([x for x in 'ab'])", "ListComp is not allowed"),
    ("open('f') == pl.col('x')", "unknown name 'open'"),
    ('pl.col("reward").nope()', "no attribute 'nope'"),
    ('pl.lit(1)(2) == pl.col("x")', "only polars functions and expression methods can be called"),
    ('pl.col("reward").round(**{"decimals": 1}) > 0', "**kwargs are not allowed"),
    ("pl.col", "is not a polars expression"),
])
def test_rejected_expressions(text, message):
    with pytest.raises(ExpressionError, match=message.replace("(", r"\(").replace("*", r"\*")):
        filter_frame(FRAME, text) if text else parse_expression(text)


def test_evaluation_errors_name_the_expression_and_columns():
    with pytest.raises(ExpressionError, match=r"--where 'nope > 1': unable to find column \"nope\"; columns: "):
        filter_frame(FRAME, "nope > 1")
    with pytest.raises(ExpressionError, match="must be of type `Boolean`"):
        filter_frame(FRAME, "reward + 1")


def test_sort_on_scalar_columns_only():
    assert sort_frame(FRAME, "reward", descending=True)["reward"].to_list() == [1.0, 0.5, -1.0]
    with pytest.raises(ExpressionError, match="no such column"):
        sort_frame(FRAME, "x", descending=False)
    with pytest.raises(ExpressionError, match="cannot be sorted on"):
        sort_frame(FRAME, "lp", descending=False)
