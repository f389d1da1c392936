"""Two machines, one DVC remote: A runs prepare + generate, B pulls and runs the rest (docs/multi-machine.md).

Each machine is a clone in its own temp dir: its own work tree, DVC cache, checkout time and Python
bytecode, sharing only a bare git repo and a local-directory DVC remote.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from rlpipe.config import load_params
from rlpipe.data.io import read_metadata
from tests.e2e.conftest import env, make_project, run
from tests.e2e.test_pipeline import ARTIFACTS, STAGES, ran_stages

pytestmark = pytest.mark.slow


def on(machine: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` on one machine: it imports its own checkout of rlpipe and writes its own __pycache__."""
    e = env()
    e["PYTHONPATH"] = str(machine)
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run(cmd, cwd=machine, env=e, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{machine.name}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def stale(machine: Path) -> list[str]:
    out = on(machine, ["dvc", "status", "--json"]).stdout.strip()
    return sorted(json.loads(out or "{}"))


def outputs(root: Path) -> dict[str, bytes]:
    files = {rel: (root / rel).read_bytes() for rel in ARTIFACTS}
    for ckpt_file in sorted((root / "artifacts/train/checkpoint").iterdir()):
        files[f"artifacts/train/checkpoint/{ckpt_file.name}"] = ckpt_file.read_bytes()
    return files


def two_machines(tmp_path: Path, updates: dict) -> tuple[Path, Path]:
    """Clones A and B of one project (params ``updates``), sharing a bare git repo and a DVC remote dir."""
    origin, remote = tmp_path / "origin.git", tmp_path / "dvc-remote"
    run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], tmp_path)
    seed = make_project(tmp_path / "seed", updates)
    run(["git", "branch", "-M", "main"], seed)
    run(["dvc", "remote", "add", "-d", "shared", str(remote)], seed)
    run(["git", "commit", "-qam", "DVC remote"], seed)
    run(["git", "push", "-q", str(origin), "main"], seed)
    a, b = tmp_path / "machine_a", tmp_path / "machine_b"
    for machine in (a, b):
        run(["git", "clone", "-q", str(origin), str(machine)], tmp_path)
    return a, b


def test_generate_on_one_machine_train_on_another(reproduced, tmp_path):
    # Same params as `reproduced`; refresh_every is read by `rlpipe iterate` only, never by a stage.
    a, b = two_machines(tmp_path, {"reference.refresh_every": 1})
    an_hour_ago = time.time() - 3600  # B's checkout happened at another time: other mtimes, other bytecode
    for f in b.rglob("*.py"):
        os.utime(f, (an_hour_ago, an_hour_ago))

    # Machine A: prepare + generate, then hand the lock file to git and the outputs to the remote.
    assert ran_stages(on(a, ["dvc", "repro", "generate"]).stdout) == ["prepare", "generate"]
    assert list((a / "rlpipe/engines").glob("__pycache__/*.pyc")), "A should have written its own bytecode"
    on(a, ["git", "add", "dvc.lock", "metrics"])
    on(a, ["git", "commit", "-qm", "prepare + generate (machine A)"])
    on(a, ["dvc", "push"])
    on(a, ["git", "push", "-q"])

    # Machine B: pull both, run the rest; prepare and generate are up to date there.
    on(b, ["git", "pull", "-q", "--ff-only"])
    on(b, ["dvc", "pull", "--with-deps", "generate"])  # a plain `dvc pull` fails on the stages not run yet
    assert stale(b) == sorted([*STAGES[2:], "baseline", "check_params"])  # A ran `dvc repro generate` only
    assert ran_stages(on(b, ["dvc", "repro"]).stdout) == STAGES[2:]
    assert stale(b) == []
    on(b, ["git", "add", "dvc.lock", "metrics", "plots"])
    on(b, ["git", "commit", "-qm", "score .. evaluate (machine B)"])
    on(b, ["dvc", "push"])
    on(b, ["git", "push", "-q"])
    expected = outputs(reproduced)
    assert outputs(b) == expected  # byte-identical to one `dvc repro` on one machine

    # Back on A: the lock file B wrote matches A's files; A is up to date without running anything.
    on(a, ["git", "pull", "-q", "--ff-only"])
    on(a, ["dvc", "pull"])
    assert stale(a) == []
    assert outputs(a) == expected

    # B finishes the iteration; A picks up the next policy, the refreshed reference and its counter.
    on(b, ["rlpipe", "iterate"])
    on(b, ["dvc", "push"])
    on(b, ["git", "push", "-q", "origin", "HEAD", "--tags"])
    on(a, ["git", "pull", "-q", "--ff-only", "--tags"])
    on(a, ["dvc", "pull"])
    params = load_params(a / "params.yaml")
    assert (params.iteration, params.policy.path) == (1, "state/policy")
    assert (params.reference.path, params.reference.version) == ("state/reference", 1)
    trained = (b / "artifacts/train/checkpoint/model.safetensors").read_bytes()
    for state in ("state/policy", "state/reference"):
        assert json.loads((a / state / "rlpipe.json").read_text()) == {
            "policy_version": 1, "dtype": "float32", "master_weights": False}
        assert (a / state / "model.safetensors").read_bytes() == trained
    assert "iteration-0" in on(a, ["git", "tag"]).stdout.split()
    assert "prepare" not in stale(a) and "generate" in stale(a)  # iteration 1 starts at generate, on A


def test_ppo_critic_and_adaptive_kl_beta_move_between_machines(tmp_path):
    """B runs a PPO iteration and `rlpipe iterate`; A pulls and continues with B's critic and beta."""
    a, b = two_machines(tmp_path, {"advantage.estimator": "gae", "advantage.kl_in_reward.adaptive": True,
                                   "advantage.kl_in_reward.target": 1.0e-3, "advantage.kl_in_reward.horizon": 100})

    on(b, ["dvc", "repro"])
    on(b, ["rlpipe", "iterate"])
    on(b, ["dvc", "push"])
    on(b, ["git", "push", "-q", "origin", "HEAD", "--tags"])
    chosen = json.loads((b / "artifacts/advantage/kl_controller.json").read_text())
    assert chosen["beta"] == 0.01 and chosen["next_beta"] != 0.01

    on(a, ["git", "pull", "-q", "--ff-only", "--tags"])
    on(a, ["dvc", "pull", "state/policy.dvc", "state/critic.dvc"])
    params = load_params(a / "params.yaml")
    assert params.iteration == 1 and params.critic.path == "state/critic"
    assert params.advantage.kl_in_reward.beta == chosen["next_beta"]
    assert (a / "state/critic/scalar_head.safetensors").read_bytes() == \
        (b / "artifacts/train/critic/scalar_head.safetensors").read_bytes()
    # A's next values stage reads B's trained critic
    on(a, ["dvc", "repro", "--pull", "values"])
    values_meta = json.loads((a / "metrics/values.json").read_text())
    assert values_meta["critic"] is True
    assert read_metadata(a / "artifacts/values/values.parquet")["critic"] == {
        "path": "state/critic", "fresh_head": False, "critic_version": 1}
