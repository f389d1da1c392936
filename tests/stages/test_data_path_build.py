"""benchmarks/data_path.py builds its synthetic iterations a part of rows at a time (so a billion-token one fits
in memory): the tables are the same whatever the part size, valid artifacts, and the multi-turn masks hide the
spans the row plan drew."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from rlpipe.data.io import read_artifact
from rlpipe.data.schema import REF_LOGPROBS, ROLLOUTS, SCORES, VALUES

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("data_path_benchmark", ROOT / "benchmarks" / "data_path.py")
data_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_path)

TABLES = {"rollouts": ROLLOUTS, "ref_logprobs": REF_LOGPROBS, "values": VALUES, "scores": SCORES}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    data_path.build(root / "whole", rows=128, lengths="tail", multi_turn=True, seed=7)
    data_path.build(root / "parts", rows=128, lengths="tail", multi_turn=True, seed=7, part_tokens=9000)
    return root


def test_the_tables_do_not_depend_on_the_part_size(built):
    for name, schema in TABLES.items():
        whole = read_artifact(built / "whole" / f"{name}.parquet", schema)
        parts = read_artifact(built / "parts" / f"{name}.parquet", schema)
        assert whole.frame.equals(parts.frame), name
        assert whole.metadata == parts.metadata, name
    # ~600 tokens a row, 16 rows a part: 9,000 tokens hold one group, so 8 parts, each its own row group
    assert pq.ParquetFile(built / "whole" / "rollouts.parquet").num_row_groups == 1
    assert pq.ParquetFile(built / "parts" / "rollouts.parquet").num_row_groups == 128 // 16


def test_parts_are_whole_groups_of_about_the_asked_tokens():
    lengths = np.array([10] * 16 + [30] * 16 + [5] * 16, dtype=np.int32)
    plan = data_path.RowPlan(lengths, np.zeros(48), np.zeros(48, dtype=np.int64), np.zeros(48, dtype=np.int64))
    assert plan.parts(160) == [(0, 16), (16, 32), (32, 48)]  # 160, 480 (one group, over), 80
    assert plan.parts(640) == [(0, 32), (32, 48)]
    assert plan.parts(10**9) == [(0, 48)]


def test_the_policy_masks_hide_each_rows_drawn_span():
    plan = data_path.RowPlan(np.array([5, 4, 6]), np.zeros(3), np.array([1, 0, 2]), np.array([3, 0, 5]))
    mask = data_path.policy_masks(plan, 0, 3)
    assert mask.tolist() == [True, False, False, True, True,  # row 0: [1, 3)
                             True, True, True, True,  # row 1: single-turn
                             True, True, False, False, False, True]  # row 2: [2, 5)
    assert data_path.policy_masks(plan, 1, 3).tolist() == mask[5:].tolist()


def test_the_built_masks_match_the_plan(built):
    roll = pl.read_parquet(built / "parts" / "rollouts.parquet", columns=["completion_length", "policy_mask"])
    hidden = roll["policy_mask"].list.eval(pl.element().not_()).list.sum().to_numpy()
    plan = data_path.RowPlan.draw(128, "tail", True, data_path.random_streams(7)["rows"])
    assert hidden.tolist() == (plan.span_stop - plan.span_start).tolist()
    assert 0 < np.count_nonzero(hidden) < 128
