"""Overlapped iterations end to end (docs/overlap.md): `rlpipe run --max-staleness 1` samples iteration k+1 while
k trains; every iteration stays a committed DVC iteration; a rerun and a resumed crash give the same bytes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import env, metrics_at, run
from tests.e2e.test_long_runs import git

pytestmark = pytest.mark.slow

RESULTS = ("artifacts/generate/rollouts.parquet", "artifacts/reference_logprob/ref_logprobs.parquet",
           "artifacts/train/checkpoint/model.safetensors", "artifacts/evaluate/eval_rollouts.parquet",
           "state/policy/model.safetensors", "state/sampler/model.safetensors", "history/iterations.jsonl",
           "params.yaml")


@pytest.fixture(scope="module")
def overlapped(reproduced, tmp_path_factory) -> tuple[Path, str]:
    """Iterations 0-2 with S = 1, continuing the reproduced iteration 0 (read-only), and the run's output."""
    root = tmp_path_factory.mktemp("overlapped") / "project"
    shutil.copytree(reproduced, root, symlinks=True)
    out = run(["rlpipe", "run", "--until", "3", "--max-staleness", "1"], root).stdout
    return root, out


def test_the_next_iteration_is_sampled_ahead_and_restored_from_the_run_cache(overlapped):
    root, out = overlapped
    assert out.count("sampling iteration 1 ahead (policy version 0)") == 1
    assert out.count("sampling iteration 2 ahead (policy version 1)") == 1
    for stage in ("generate", "score", "reference_logprob", "values"):
        assert out.count(f"Stage '{stage}' is cached - skipping run") == 2, stage  # iterations 1 and 2
        assert f"Running stage '{stage}'" not in out  # iteration 0 was reproduced already: nothing sampled twice
    assert "sampling iteration 3 ahead" not in out  # not beyond the target


def test_each_iteration_records_its_sampler_and_staleness_and_restores(overlapped):
    root, _ = overlapped
    for k, (version, staleness) in enumerate([(0, 0), (0, 1), (1, 1)]):
        train = metrics_at(root, f"iteration-{k}", "train")
        assert (train["sampler_policy_version"], train["staleness"], train["policy_version_out"]) == (version, staleness,
                                                                                                    k + 1)
        assert train["is_weight_min"] <= 1.0 <= train["is_weight_max"]
    work = Path(str(root) + "_restore")
    shutil.copytree(root, work, symlinks=True)
    for k in range(3):
        run(["git", "checkout", "-q", f"iteration-{k}"], work)
        run(["dvc", "checkout"], work)
        assert "Data and pipelines are up to date" in run(["dvc", "status"], work).stdout, k
        rollouts_version = metrics_at(work, f"iteration-{k}", "generate")["policy_version"]
        assert rollouts_version == [0, 0, 1][k]


def test_a_run_killed_while_sampling_ahead_resumes_to_the_same_bytes(overlapped, reproduced, tmp_path):
    """Killed mid-prefetch and resumed, the run ends byte-identical to the uninterrupted one: the schedule,
    not the timing, decides what every iteration samples with."""
    root, _ = overlapped
    work = tmp_path / "killed"
    shutil.copytree(reproduced, work, symlinks=True)
    log = work / ".rlpipe/ahead/prefetch.log"
    with open(tmp_path / "run.log", "w") as out:
        proc = subprocess.Popen(["rlpipe", "run", "--until", "3", "--max-staleness", "1"], cwd=work, env=env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (log.is_file() and "Running stage 'score'" in log.read_text()):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()
            time.sleep(0.05)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGKILL)  # the loop, both dvc processes, the stages: a lost machine
        proc.wait()
        psutil.wait_procs(tree, timeout=30)
    resumed = run(["rlpipe", "run", "--until", "3"], work).stdout
    assert "iteration 2:" in resumed
    for rel in RESULTS:
        assert (work / rel).read_bytes() == (root / rel).read_bytes(), rel


def test_evaluate_uses_an_engine_on_the_training_gpus_when_generation_has_its_own(overlapped, reproduced, tmp_path):
    """worker.generate_devices / train_devices set apart: evaluate is served by the train engine (asleep
    between requests), not queued behind the next iteration's sampling; the results are the same."""
    from rlpipe.worker import lifecycle
    from tests.e2e.conftest import edit_params

    fixture_root, _ = overlapped
    root = tmp_path / "split"
    shutil.copytree(reproduced, root, symlinks=True)
    edit_params(root / "params.yaml", {"worker.engine_server": True, "worker.generate_devices": "0",
                                       "worker.train_devices": "1"})
    run(["git", "commit", "-qam", "generation and training on their own devices"], root)
    run(["rlpipe", "run", "--until", "2", "--max-staleness", "1"], root)
    log = (root / ".rlpipe/worker/train-engine.log").read_text()
    assert "engine ready at @rlpipe-train-engine-" in log
    assert "stopped on request after serving 1 request(s)" in log  # iteration 1's evaluate (0's ran before)
    assert lifecycle.status("train-engine", root) is None and lifecycle.status("engine", root) is None
    for k in (0, 1):
        ours = metrics_at(root, f"iteration-{k}", "evaluate")
        theirs = metrics_at(fixture_root, f"iteration-{k}", "evaluate")
        assert ours["accuracy"] == theirs["accuracy"], k
    assert ours["engine_server"] is True  # iteration 1's evaluate, served while iteration 2 was sampled ahead
