"""Faults: NaN rewards and poisoned batches, a train stage killed and resumed, kill -9 of every stage.

Each stage runs as a subprocess of its dvc.yaml command in a copy of the reproduced (shrunk) project,
so a SIGKILL hits the real process at a real point: importing, reading, computing or writing.
"""
from __future__ import annotations

import json
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.run.commands import stage_commands
from tests.e2e.conftest import edit_params, env
from tests.e2e.test_stage_errors import REPO, invoke, nothing_written, stage_args, ws  # noqa: F401 - ws: fixture

pytestmark = pytest.mark.slow

OUTPUT_OPTIONS = ("--out", "--checkpoint", "--token-stats", "--model-dir", "--train-prompts", "--eval-prompts",
                  "--preferences", "--critic-checkpoint", "--kl-controller")
SIDE_OUTPUTS = ("--metrics", "--steps")  # metrics/plots: not cached by DVC, timings inside, so not byte-compared


def with_column(src: Path, dest: Path, name: str, values) -> Path:
    """A copy of an artifact with one column replaced, its rlpipe footer kept."""
    table = pq.read_table(src)
    i = table.schema.get_field_index(name)
    table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
    pq.write_table(table, dest)
    return dest


def test_a_nan_reward_fails_the_advantage_stage_naming_the_row(ws):  # noqa: F811
    scores = ws / "artifacts/score/scores.parquet"
    rewards = pq.read_table(scores)["reward"].to_pylist()
    rewards[3] = float("nan")
    bad = with_column(scores, ws / "nan_scores.parquet", "reward", rewards)
    key = pl.read_parquet(bad).row(3, named=True)
    code, out = invoke("advantage", stage_args(ws, "advantage", **{"--scores": str(bad)}))
    assert code == 2, out
    assert "nan_scores.parquet: column 'reward' has 1 non-finite value(s)" in out
    assert f"(prompt_id={key['prompt_id']}, sample_idx={key['sample_idx']}, reward=nan)" in out
    assert nothing_written(ws)


def poisoned_advantages(ws: Path, rows: list[int]) -> Path:
    src = ws / "artifacts/advantage/advantages.parquet"
    tokens = pq.read_table(src)["token_advantages"].to_pylist()
    for i in rows:
        tokens[i] = [float("nan")] * len(tokens[i])
    return with_column(src, ws / "poisoned.parquet", "token_advantages", tokens)


def test_a_poisoned_row_skips_its_steps_and_counts_them(ws):  # noqa: F811
    """One row of NaN advantages poisons one minibatch per epoch: 2 of 4 steps skipped, allowed by max 2."""
    edit_params(ws / "params.yaml", {"train.max_skipped_steps": 2})
    bad = poisoned_advantages(ws, [0])
    code, out = invoke("train", stage_args(ws, "train", **{"--advantages": str(bad)}))
    assert code == 0, out
    m = json.loads((ws / "out/train.json").read_text())
    assert m["skipped_steps"] == 2 and m["optimizer_steps"] == 2
    assert (ws / "out/checkpoint/model.safetensors").is_file()


def test_a_fully_poisoned_batch_fails_train_and_writes_no_checkpoint(ws):  # noqa: F811
    n = pq.read_metadata(ws / "artifacts/advantage/advantages.parquet").num_rows
    bad = poisoned_advantages(ws, list(range(n)))
    code, out = invoke("train", stage_args(ws, "train", **{"--advantages": str(bad)}))
    assert code == 2, out
    assert "optimizer steps had a non-finite loss or gradient norm" in out and "train.max_skipped_steps=2" in out
    assert "no checkpoint was written" in out
    assert nothing_written(ws)


def start(words: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *words[1:]], cwd=cwd, env=env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_train_at_its_first_resume_state_and_rerun(ws: Path, params: dict) -> Path:
    """Train once uninterrupted (outputs in ws/full), then again to ws/out, SIGKILLed as soon as its first
    resume state appears, then rerun there; return that resume state's directory (gone after the rerun)."""
    edit_params(ws / "params.yaml", params)
    outs = {"--checkpoint": "checkpoint", "--token-stats": "token_stats.parquet", "--metrics": "train.json",
            "--steps": "train_steps.csv"}
    full_args = stage_args(ws, "train", **{"--resume-root": str(ws / "resume_full")},
                           **{k: str(ws / "full" / v) for k, v in outs.items()})
    subprocess.run([sys.executable, str(REPO / "stages/train.py"), *full_args], cwd=ws, env=env(), check=True,
                   capture_output=True)
    assert not list((ws / "resume_full").glob("train-*"))  # cleared on success

    args = stage_args(ws, "train", **{"--resume-root": str(ws / "resume")})
    proc = start(["python", str(REPO / "stages/train.py"), *args], ws)
    deadline = time.monotonic() + 120
    while not list((ws / "resume").glob("train-*/state.pt")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    kill(proc)
    assert proc.returncode == -signal.SIGKILL, "the stage finished before its first resume state"
    assert not (ws / "out/checkpoint").exists()
    state = next((ws / "resume").glob("train-*/state.pt"))
    state_bytes = state.read_bytes()
    rerun = subprocess.run([sys.executable, str(REPO / "stages/train.py"), *args], cwd=ws, env=env(),
                           capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert not list((ws / "resume").glob("train-*"))
    kept = ws / "killed_state.pt"
    kept.write_bytes(state_bytes)
    return kept


def test_a_killed_train_stage_resumes_and_ends_with_the_same_weights(ws):  # noqa: F811
    """SIGKILL after the first resume state appears; the rerun resumes there and writes the same bytes."""
    kill_train_at_its_first_resume_state_and_rerun(ws, {
        "train.epochs": 4, "train.minibatch_size": 2, "train.micro_batch_size": 2, "train.checkpoint_every_steps": 10})
    m = json.loads((ws / "out/train.json").read_text())
    assert m["resumed_from_step"] > 0 and m["optimizer_steps"] == 4 * 32
    for name in ("checkpoint/model.safetensors", "token_stats.parquet", "train_steps.csv"):
        assert (ws / "out" / name).read_bytes() == (ws / "full" / name).read_bytes(), name


def test_a_resume_state_of_other_params_is_not_used(ws):  # noqa: F811
    from rlpipe.training.resume import resume_key
    inputs = [ws / "artifacts/generate/rollouts.parquet", ws / "artifacts/prepare/model"]
    assert resume_key(inputs, {"lr": 1e-4}) != resume_key(inputs, {"lr": 2e-4})
    assert resume_key(inputs, {"lr": 1e-4}) != resume_key(inputs[:1], {"lr": 1e-4})
    assert resume_key(inputs, {"lr": 1e-4}) == resume_key(list(inputs), {"lr": 1e-4})


def snapshot(path: Path) -> dict[str, bytes] | None:
    """A file's bytes, or a directory's files by relative path; None when absent."""
    if path.is_dir():
        return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}
    return {"": path.read_bytes()} if path.exists() else None


STAGES = ["prepare", "generate", "train_reward_model", "score", "reference_logprob", "values", "advantage", "train",
          "evaluate"]


@pytest.mark.parametrize("stage", STAGES)
def test_kill_9_at_random_points_leaves_no_partial_output(project_copy, stage):
    """Two seeded kill times per stage: every output is absent or complete, and a rerun gives the same bytes."""
    root = project_copy
    words = shlex.split(stage_commands(root / "dvc.yaml", root / "params.yaml")[stage])
    if stage == "train_reward_model":  # by default a placeholder, written at once: kill a real training run
        edit_params(root / "params.yaml", {"reward_model.train": True})
        trained = subprocess.run([sys.executable, *words[1:]], cwd=root, env=env(), capture_output=True, text=True)
        assert trained.returncode == 0, trained.stderr
    options = dict(zip(words[2::2], words[3::2]))
    # --preferences is prepare's output but train_reward_model's input
    outs = [root / v for k, v in options.items()
            if k in OUTPUT_OPTIONS and not (k == "--preferences" and stage != "prepare")]
    side = [root / v for k, v in options.items() if k in SIDE_OUTPUTS]
    expected = {p: snapshot(p) for p in outs}
    rng = random.Random(f"kill-{stage}")
    for kill_after in sorted(rng.uniform(1.0, 7.0) for _ in range(2)):
        for p in outs + side:  # as DVC does before running a stage
            subprocess.run(["rm", "-rf", str(p)], check=True)
        proc = start(words, root)
        time.sleep(kill_after)
        kill(proc)
        for p in outs:
            assert snapshot(p) in (None, expected[p]), f"{stage} killed after {kill_after:.2f} s: partial {p}"
        for p in side:  # written atomically too: absent or whole (the JSON parses)
            assert not p.exists() or p.suffix != ".json" or json.loads(p.read_text())
        visible = [f for p in outs for f in p.parent.iterdir() if not f.name.startswith(".") and f not in outs]
        assert not visible, f"stray files beside the outputs: {visible}"
    rerun = subprocess.run([sys.executable, *words[1:]], cwd=root, env=env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    for p in outs:
        assert snapshot(p) == expected[p], f"{stage}: rerun after kills differs at {p}"
