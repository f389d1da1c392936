"""`rlpipe inspect`'s statistics read the token columns a batch of rows at a time (`streamed_view`) and print
the numbers the whole joined frame gives, bit for bit: ragged long-tailed lengths, multi-turn masks, tables of
several row groups, a train token-stats table (sampler mismatch, entropy, log-ratio), sequence and token-level
advantages, batches that cut prompt groups."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from rlpipe.data.io import read_artifact, write_artifact_parts
from rlpipe.data.lists import list_column
from rlpipe.data.schema import ROLLOUTS, TOKEN_FLOATS, TRAIN_TOKEN_STATS
from rlpipe.reports import inspect as inspect_module
from rlpipe.reports.inspect import (
    color_column,
    inspect_data,
    joined_frame,
    load,
    streamed_view,
    summarize,
)
from rlpipe.reports.look_here import look_here

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("data_path_benchmark", ROOT / "benchmarks" / "data_path.py")
data_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data_path)


def token_stats_table(data: Path, out: Path) -> Path:
    """The train stage's token statistics for the rollouts, in parts (several row groups), NaN-free floats."""
    roll = read_artifact(data / "rollouts.parquet", ROLLOUTS, columns=["completion_length", "sampler_logprobs"]).frame
    lengths = roll["completion_length"].to_numpy()
    rng = np.random.default_rng(11)
    sampler = roll["sampler_logprobs"].explode().to_numpy()
    n = sampler.size
    old = (sampler + rng.normal(0, 1e-3, n)).astype(np.float32)
    new = (old + rng.normal(0, 0.05, n)).astype(np.float32)
    frame = roll.select("prompt_id", "sample_idx").with_columns(
        list_column("old_logprobs", old, lengths, TOKEN_FLOATS),
        list_column("entropy", rng.uniform(0, 3, n).astype(np.float32), lengths, TOKEN_FLOATS),
        list_column("new_logprobs", new, lengths, TOKEN_FLOATS))
    path = out / "token_stats.parquet"
    write_artifact_parts([frame[:200], frame[200:400], frame[400:]], path, TRAIN_TOKEN_STATS,
                         metadata={"policy_version": 0})
    return path


@pytest.fixture(scope="module")
def projects(tmp_path_factory):
    """One project per estimator over a 512-row long-tailed multi-turn set (9 row groups)."""
    data = tmp_path_factory.mktemp("inspect-stream")
    data_path.build(data, rows=512, lengths="tail", multi_turn=True, seed=5, part_tokens=40_000)
    assert pq.ParquetFile(data / "rollouts.parquet").num_row_groups > 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = {}
    for estimator in ("grpo", "reinforce_plus_plus"):
        run = data / f"out-{estimator}"
        run.mkdir()
        subprocess.run(data_path.step_command(f"advantage:{estimator}", data, ROOT, run), env=env, check=True,
                       capture_output=True)
        project = data_path.inspect_project(data, run)
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["paths"]["advantages"] = str(run / f"advantages-{estimator}.parquet")
        params["paths"]["token_stats"] = str(token_stats_table(data, run))
        params["advantage"]["estimator"] = estimator
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        out[estimator] = project
    return out


def whole_frame_summary(project: Path) -> tuple[dict, dict]:
    """The statistics as `rlpipe inspect` took them before streaming: every table read and joined whole."""
    loaded = load(project)
    full, warnings = joined_frame(loaded)
    summary = summarize(loaded, full, total_rows=full.height, warnings=[*loaded.notes, *warnings])
    return summary, look_here(full, command=f"rlpipe inspect {project}")


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
@pytest.mark.parametrize("batch_tokens", [1 << 22, 20_000])  # one batch; batches of ~34 rows, cutting groups
def test_streamed_statistics_are_the_whole_frames(projects, estimator, batch_tokens, monkeypatch):
    monkeypatch.setattr(inspect_module, "STREAM_BATCH_TOKENS", batch_tokens)
    project = projects[estimator]
    want, want_look = whole_frame_summary(project)
    view = streamed_view(project, eval_view=False)
    assert view is not None
    loaded, frame, warnings, tokens, columns = view
    got = summarize(loaded, frame, total_rows=frame.height, warnings=warnings, tokens=tokens)
    assert json.dumps(got, default=str) == json.dumps(want, default=str)  # the same keys in the same order
    assert look_here(frame, command=f"rlpipe inspect {project}") == want_look
    # what the statistics cover, so that the comparison is not of two empty summaries
    assert {"kl_ref", "logprob_mismatch", "entropy_mean", "train_log_ratio_mean"} <= set(got)
    rollouts = project.parent.parent / "rollouts.parquet"
    assert got["kl_ref"]["tokens"] < sum(read_artifact(rollouts, ROLLOUTS, columns=["completion_length"]).frame[
        "completion_length"])  # the observation tokens of the multi-turn rows are left out
    assert ("token_advantage" in got) == (estimator == "reinforce_plus_plus")
    assert len(want_look["sampler_mismatch"]["rows"]) == 5 and want_look["sampler_mismatch"]["rows"][0]["excerpt"]
    assert set(load(project).artifacts) == set(loaded.artifacts)
    # every column --color-by may name, the token ones too (token_advantages even where grpo's are not read)
    whole = joined_frame(load(project))[0]
    assert set(columns.columns) == set(whole.columns)
    assert color_column(columns, "token_advantages") == "token_advantages"


def test_inspect_json_takes_the_streamed_path_with_the_same_output(projects, monkeypatch):
    project = projects["reinforce_plus_plus"]
    streamed = inspect_data(project)
    monkeypatch.setattr(inspect_module, "streamed_view", lambda *a, **k: None)
    assert inspect_data(project) == streamed
    # and the CLI prints it
    out = subprocess.run([sys.executable, "-m", "rlpipe.cli", "inspect", str(project), "--json"], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert json.loads(out)["summary"]["kl_ref"] == streamed["summary"]["kl_ref"]


def test_tables_that_do_not_line_up_take_the_whole_frame_path(projects, tmp_path):
    """A token-stats table one token short in a row: the whole-frame path leaves it out with its warning."""
    project = projects["grpo"]
    params = yaml.safe_load((project / "params.yaml").read_text())
    stats = read_artifact(params["paths"]["token_stats"], TRAIN_TOKEN_STATS).frame
    short = stats.with_columns(pl.when(pl.int_range(pl.len()) == 300).then(pl.col(c).list.head(1))
                               .otherwise(pl.col(c)).alias(c) for c in ("old_logprobs", "entropy", "new_logprobs"))
    broken = tmp_path / "token_stats.parquet"
    write_artifact_parts([short], broken, TRAIN_TOKEN_STATS, metadata={"policy_version": 0})
    params["paths"]["token_stats"] = str(broken)
    copy = tmp_path / "project"
    copy.mkdir()
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert streamed_view(copy, eval_view=False) is None
    summary = inspect_data(copy)["summary"]
    assert any(w.startswith("token_stats not joined") for w in summary["warnings"])
