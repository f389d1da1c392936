"""The streamed advantage stage (an iteration read a chunk of rows at a time) writes the values, and reports
the metrics, of the in-memory stage, bit for bit, for every estimator: chunks of a few rows, a long tail,
multi-turn masks, rows left out (infra errors, unscorable rewards)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rlpipe.config import load_params
from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import ADVANTAGES, ROLLOUTS, SCORES
from rlpipe.stages.advantage import Sources, compute_advantages, read_row_level, read_rows, reward_weights, stream_advantages
from tests.shipped import shipped_params

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("data_path_benchmark", ROOT / "benchmarks" / "data_path.py")
data_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_path)

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "grpo_passk", "reinforce_plus_plus", "gae", "reinforce_plus_plus_baseline",
              "gdpo", "grpo_normalize_then_sum"]


@pytest.fixture(scope="module")
def iteration(tmp_path_factory):
    """256 rows, long-tailed and multi-turn; two infra errors and two NaN rewards (unscorable)."""
    root = tmp_path_factory.mktemp("stream")
    data_path.build(root, rows=256, lengths="tail", multi_turn=True, seed=3)
    roll = read_artifact(root / "rollouts.parquet", ROLLOUTS).frame
    infra = roll["prompt_id"].is_in([2]) & roll["sample_idx"].is_in([1, 5])
    write_artifact(roll.with_columns(pl.when(infra).then(pl.lit("infra_error")).otherwise(pl.col("finish_reason"))
                                     .alias("finish_reason")), root / "rollouts.parquet", ROLLOUTS,
                   metadata={"policy_version": 0})
    scores = read_artifact(root / "scores.parquet", SCORES).frame
    rng = np.random.default_rng(5)  # a second reward component, for the multi-reward estimators
    scores = scores.with_columns(pl.Series("reward_digit_match", rng.random(scores.height).round(2)))
    write_artifact(scores, root / "scores.parquet", SCORES)
    nan = scores["prompt_id"].is_in([4]) & scores["sample_idx"].is_in([0, 3])
    write_artifact(scores.with_columns(pl.when(nan).then(float("nan")).otherwise(pl.col("reward")).alias("reward")),
                   root / "scores-nan.parquet", SCORES)  # unscorable rows: sequence estimators only (config)
    return root


TOKEN_LEVEL = ("reinforce_plus_plus", "gae")


def params_for(tmp_path: Path, estimator: str, **advantage):
    import yaml

    data = yaml.safe_load(shipped_params().read_text())
    data["advantage"].update(estimator=estimator, **advantage)
    if estimator not in TOKEN_LEVEL:
        data["advantage"]["nan_rewards"] = "zero_advantage"
        data["score"]["fallback_reward"] = float("nan")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_params(path)


def same_bits(a: pl.DataFrame, b: pl.DataFrame) -> None:
    """Equal frames whose floats also agree bit for bit (-0.0 is not 0.0 here)."""
    from rlpipe.data.lists import flat_values

    assert a.equals(b)
    for column in ("token_advantages", "returns"):
        assert flat_values(a[column], np.float32).tobytes() == flat_values(b[column], np.float32).tobytes(), column
    for column in ("advantage", "group_reward_mean", "group_reward_std"):
        assert a[column].to_numpy().tobytes() == b[column].to_numpy().tobytes(), column


@pytest.mark.parametrize("chunk_tokens", [3000, 10**9])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_the_streamed_stage_writes_what_the_in_memory_stage_writes(iteration, tmp_path, estimator, chunk_tokens):
    p = params_for(tmp_path, estimator)
    scores = "scores.parquet" if estimator in TOKEN_LEVEL else "scores-nan.parquet"
    files = dict(rollouts=str(iteration / "rollouts.parquet"), scores=str(iteration / scores))
    weights = reward_weights(p)
    _, rows = read_rows(p, **files, ref_logprobs=str(iteration / "ref_logprobs.parquet"),
                        values=str(iteration / "values.parquet"), weights=weights)
    whole, metrics, kl_state = compute_advantages(rows, p.advantage, weights)
    _, row_level = read_row_level(p, **files, weights=weights)
    out = tmp_path / "streamed.parquet"
    sources = Sources(files["rollouts"], str(iteration / "ref_logprobs.parquet"), str(iteration / "values.parquet"))
    streamed_metrics, streamed_kl = stream_advantages(row_level, p.advantage, weights, sources, str(out),
                                                      {"policy_version": 0}, chunk_size=chunk_tokens)
    streamed = read_artifact(out, ADVANTAGES).frame
    expected = read_artifact(write_artifact(whole, tmp_path / "whole.parquet", ADVANTAGES), ADVANTAGES).frame
    same_bits(streamed, expected)
    assert streamed_metrics == metrics and streamed_kl == kl_state


@pytest.mark.parametrize("stream_above", ["0", str(10**12)])
@pytest.mark.parametrize(("estimator", "option"), [("gae", "--values"), ("reinforce_plus_plus", "--ref-logprobs")])
def test_both_stage_paths_name_a_missing_token_input(iteration, tmp_path, estimator, option, stream_above):
    """The streamed path (every iteration above 0 tokens streams) refuses as the in-memory one does."""
    import os
    import subprocess
    import sys

    params_for(tmp_path, estimator)
    inputs = {"--ref-logprobs": str(iteration / "ref_logprobs.parquet"), "--values": str(iteration / "values.parquet")}
    del inputs[option]
    cmd = [sys.executable, str(ROOT / "stages" / "advantage.py"), "--params", str(tmp_path / "params.yaml"),
           "--rollouts", str(iteration / "rollouts.parquet"), "--scores", str(iteration / "scores.parquet"),
           *[x for pair in inputs.items() for x in pair], "--out", str(tmp_path / "adv.parquet"),
           "--kl-controller", str(tmp_path / "kl.json"), "--metrics", str(tmp_path / "m.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "RLPIPE_STREAM_ABOVE_TOKENS": stream_above})
    assert proc.returncode != 0
    assert f"advantage.estimator '{estimator}' needs {option}" in proc.stderr
    assert not (tmp_path / "adv.parquet").exists()


def test_token_estimators_stream_from_a_smaller_size_than_the_others(iteration, monkeypatch):
    """REINFORCE++ and GAE hold several float64 token arrays in memory, so they stream from
    TOKEN_STREAM_ABOVE_TOKENS on; the sequence estimators from STREAM_ABOVE_TOKENS; the variable overrides both."""
    from rlpipe.stages import advantage

    rollouts = str(iteration / "rollouts.parquet")
    tokens = int(read_artifact(rollouts, ROLLOUTS, columns=["completion_length"]).frame["completion_length"].sum())
    monkeypatch.delenv(advantage.STREAM_ENV, raising=False)
    monkeypatch.setattr(advantage, "TOKEN_STREAM_ABOVE_TOKENS", tokens - 1)
    monkeypatch.setattr(advantage, "STREAM_ABOVE_TOKENS", tokens)
    assert [advantage.streams(rollouts, e) for e in ("reinforce_plus_plus", "gae", "grpo", "rloo")] == \
        [True, True, False, False]
    monkeypatch.setenv(advantage.STREAM_ENV, str(tokens))
    assert not advantage.streams(rollouts, "gae")
