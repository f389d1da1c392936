"""The advantage stage's memory follows the tokens it holds, not rows x the longest completion.

Two iterations with the same number of completion tokens: one long-tailed (1% of the completions at
the 8,192 cap, the rest near 500), one with every completion the same length. Padded to the longest
row, the first costs 13x the second (the stage before 2026-11 peaked 120-600 MiB higher on it); on
flat arrays the two must cost the same, give or take the 32 MiB block `ragged.row_sums` pads. Peak
RSS is measured on the stage's own command line (benchmarks/data_path.py builds and measures).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("data_path_benchmark", ROOT / "benchmarks" / "data_path.py")
data_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_path)

ROWS = 1024


@pytest.fixture(scope="module")
def iterations(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    data_path.build(root / "tail", rows=ROWS, lengths="tail", multi_turn=True, seed=0)
    tokens = json.loads((root / "tail" / "shape.json").read_text())["tokens"]
    data_path.build(root / "uniform", rows=ROWS, lengths=f"uniform:{round(tokens / ROWS)}", multi_turn=True, seed=0)
    return root


def peak_mib(data: Path, step: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "POLARS_MAX_THREADS": "1"}
    command = data_path.step_command(step, data, ROOT, data / "out")
    (data / "out").mkdir(exist_ok=True)
    _, mib, code, tail = data_path.measure(command, env)
    assert code == 0, tail
    return mib


@pytest.mark.parametrize("estimator, allowance_mib", [("grpo", 40), ("reinforce_plus_plus", 60), ("gae", 60)])
def test_a_long_tail_costs_no_more_memory_than_uniform_lengths(iterations, estimator, allowance_mib):
    tail = peak_mib(iterations / "tail", f"advantage:{estimator}")
    uniform = peak_mib(iterations / "uniform", f"advantage:{estimator}")
    assert tail - uniform < allowance_mib, f"long tail {tail:.0f} MiB vs uniform {uniform:.0f} MiB"
