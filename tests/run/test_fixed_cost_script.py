"""benchmarks/fixed_cost.py end to end on the CPU (`--shape check`): the script device sessions start with.

Why a test: GPU time comes in 30-minute loans, and a script that fails at set-up or at its report
wastes one. This runs the real stage commands through `rlpipe run` on a 2-layer model of the
benchmark's own making and checks what the report is built from.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STAGES = ["generate", "score", "reference_logprob", "values", "advantage", "train", "evaluate"]

pytestmark = pytest.mark.slow


def test_the_fixed_cost_benchmark_runs_and_reports_each_stage_and_dvcs_phases(tmp_path):
    work, out = tmp_path / "w", tmp_path / "fc.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/fixed_cost.py"), "--workdir", str(work),
                           "--shape", "check", "--device", "cpu", "--iterations", "1", "--prompts", "4", "--group", "2",
                           "--new-tokens", "4", "--eval-prompts", "2", "--prompt-words", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    [row] = report["iterations"]
    assert row["iteration"] == 0 and list(row["stages"]) == STAGES
    assert row["compute_s"] == round(sum(s.get("compute", 0.0) for s in row["stages"].values()), 2)
    assert abs(row["ratio"] - row["wall_s"] / row["compute_s"]) < 0.01 * row["ratio"]  # wall, compute rounded
    assert row["outside_stages_s"] >= 0
    assert {"commands", "hash", "lock", "cache", "dvc_other"} <= row["dvc_seconds"].keys()
    assert row["dvc_seconds"]["commands"] <= row["run_seconds"]["repro"]

    params = yaml.safe_load((work / "params.yaml").read_text())
    assert params["train"]["max_tokens_per_micro_batch"] == 32768 and params["train"]["device"] == "cpu"
    assert params["generate"]["prompts_per_iteration"] == 4 and params["generate"]["group_size"] == 2

    from safetensors.torch import load_file

    weights = load_file(work / "models/random-check/model.safetensors")
    assert "lm_head.weight" not in weights  # tied to the embeddings, as in Qwen2.5-0.5B/1.5B
    assert all(bool((w == 1).all()) for name, w in weights.items() if name.endswith("norm.weight"))
    up = weights["model.layers.0.mlp.up_proj.weight"].float()
    assert 0.015 < float(up.std()) < 0.025 and abs(float(up.mean())) < 0.005  # initializer_range 0.02
