"""The embedded multi-turn task (the calculator) end to end: `dvc repro`, the masks in every artifact, bad
settings refused before any work, and a generate stage killed (-9) mid-generation that resumes to the same bytes."""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rlpipe.data.io import read_artifact
from rlpipe.data.schema import ADVANTAGES, EVAL_ROLLOUTS, REF_LOGPROBS, ROLLOUTS, TRAIN_TOKEN_STATS
from rlpipe.run.commands import stage_commands
from tests.e2e.conftest import edit_params, env, make_project, run
from tests.e2e.test_stage_errors import generate_args, invoke, nothing_written, ws  # noqa: F401

pytestmark = pytest.mark.slow

# The calculator task: five-digit sums the tiny model cannot do itself, one `add` tool, up to 3 turns
# (docs/multi-turn.md; benchmarks/multi_turn_curve.py runs its learning curve with these settings).
CALCULATOR = {
    "prepare.tiny.task": "calculator",
    "prepare.tiny.num_digits": 5,
    "prepare.tiny.max_position_embeddings": 64,
    "generate.environment.name": "calculator",
    "generate.environment.max_turns": 3,
    "generate.environment.max_total_tokens": 40,
    "generate.max_new_tokens": 20,
    "evaluate.max_new_tokens": 20,
}
# shrunk for the test: a warm start long enough to call the tool in some samples
SHRUNK = {"prepare.tiny.warmstart_steps": 250, "prepare.tiny.tool_use_rate": 0.5,
          "generate.environment.prompts_per_chunk": 4}


@pytest.fixture(scope="module")
def calculator(tmp_path_factory) -> Path:
    root = make_project(tmp_path_factory.mktemp("calculator"), {**CALCULATOR, **SHRUNK})
    run(["dvc", "repro"], root)
    return root


def artifact(root: Path, rel: str, schema):
    return read_artifact(root / rel, schema).frame


def test_dvc_repro_runs_the_multi_turn_task_with_masks_in_every_artifact(calculator):
    root = calculator
    roll = artifact(root, "artifacts/generate/rollouts.parquet", ROLLOUTS)
    multi = roll.filter(pl.col("num_turns") > 1)
    assert multi.height > 0 and (roll["tool_calls"].list.len() > 0).sum() == multi.height
    assert set(roll["finish_reason"].to_list()) <= {"done", "max_turns", "max_tokens", "tool_error"}
    assert set(roll["tokenizer_hash"].to_list()) != {""}
    obs = [np.flatnonzero(~np.asarray(m)) for m in roll["policy_mask"].to_list()]
    assert sum(len(o) for o in obs) > 0
    adv = artifact(root, "artifacts/advantage/advantages.parquet", ADVANTAGES)
    ref = artifact(root, "artifacts/reference_logprob/ref_logprobs.parquet", REF_LOGPROBS)
    stats = artifact(root, "artifacts/train/token_stats.parquet", TRAIN_TOKEN_STATS)
    for i, o in enumerate(obs):
        # every artifact has a value for every token; advantages are 0 and sampler log-probs absent at observations
        assert np.all(np.asarray(adv["token_advantages"][i].to_list())[o] == 0.0)
        assert np.all(np.asarray(roll["sampler_logprobs"][i].to_list())[o] == 0.0)
        assert len(ref["ref_logprobs"][i]) == len(stats["old_logprobs"][i]) == roll["completion_length"][i]
    g = json.loads((root / "metrics/generate.json").read_text())
    assert g["observation_tokens"] == sum(len(o) for o in obs) and 0 < g["tool_use_rate"] <= 1
    assert g["resumed_chunks"] == 0 and not list((root / ".rlpipe/resume").glob("generate-*"))
    t = json.loads((root / "metrics/train.json").read_text())
    assert t["optimizer_steps"] > 0 and t["sampler_mismatch_max_abs"] < 1e-4  # policy tokens only
    e = json.loads((root / "metrics/evaluate.json").read_text())
    assert {"tool_use_rate", "turns_mean", "finish_reasons"} <= set(e)
    ev = artifact(root, "artifacts/evaluate/eval_rollouts.parquet", EVAL_ROLLOUTS)
    assert ev["num_turns"].max() >= 1 and ev["policy_mask"].list.len().to_list() == ev["completion_length"].to_list()
    # the eval view's turns and tool calls (issue 34 item 4): kept as generate keeps them
    assert ev["turn_starts"].list.len().to_list() == ev["num_turns"].to_list()
    assert ev["tool_calls"].list.len().to_list() == ev["num_tool_calls"].to_list()
    assert e["tool_use_rate"] == float((ev["tool_calls"].list.len() > 0).mean())
    assert "up to date" in run(["dvc", "status"], root).stdout or not json.loads(
        run(["dvc", "status", "--json"], root).stdout)


def test_a_generate_stage_killed_mid_generation_resumes_from_its_chunks_to_the_same_bytes(calculator, tmp_path):
    root = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(calculator), str(root)], check=True)
    edit_params(root / "params.yaml", {"generate.environment.prompts_per_chunk": 1,
                                       "generate.environment.chunks_in_flight": 1})
    words = shlex.split(stage_commands(root / "dvc.yaml", root / "params.yaml")["generate"])
    full = [*words[1:], "--resume-root", str(tmp_path / "full_resume")]
    out, metrics = words.index("--out") + 1, words.index("--metrics") + 1
    subprocess.run([sys.executable, *[str(tmp_path / "full.parquet") if i == out - 1 else w
                                      for i, w in enumerate(full)]], cwd=root, env=env(), check=True,
                   capture_output=True)
    expected = (tmp_path / "full.parquet").read_bytes()
    target = root / words[out]
    target.unlink()
    resume = root / ".rlpipe/resume"
    proc = subprocess.Popen([sys.executable, *words[1:]], cwd=root, env=env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(resume.glob("generate-*/chunk-*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "generate finished before its first chunk was kept"
    assert not target.exists()
    kept = len(list(resume.glob("generate-*/chunk-*.parquet")))
    rerun = subprocess.run([sys.executable, *words[1:]], cwd=root, env=env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert target.read_bytes() == expected
    m = json.loads((root / words[metrics]).read_text())
    assert 1 <= m["resumed_chunks"] == kept < 16  # 16 prompts, one chunk each
    assert not list(resume.glob("generate-*"))  # cleared once the table is written


@pytest.mark.parametrize(("updates", "message"), [
    ({"generate.environment.name": "calculator"},
     "chat template refused for multi-turn rollouts: the tokenizer has no chat template"),
    ({"generate.environment.name": "no_such.module:Env"}, "cannot import module 'no_such.module'"),
    ({"generate.environment.name": "calculator", "generate.environment.options": {"max_errors": 1}},
     "generate.environment.options: calculator: got an unexpected keyword argument 'max_errors'"),
])
def test_bad_environment_settings_fail_generate_before_any_sample(ws, updates, message):  # noqa: F811
    edit_params(ws / "params.yaml", {"generate.environment.max_total_tokens": 20, **updates})  # fits the context
    code, out = invoke("generate", generate_args(ws))
    assert code == 2 and message in out, out
    assert nothing_written(ws)
