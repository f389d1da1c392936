"""A small copy of the project in a temp dir, for end-to-end `dvc repro` runs.

The embedded default is shrunk (fewer prompts, a shorter warm start) so that one iteration takes
seconds; the code paths are the same as the real default's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from tests.shipped import shipped_params

REPO = Path(__file__).resolve().parents[2]

SMALL = {
    "prepare.tiny.num_train": 200,
    "prepare.tiny.num_eval": 24,
    "prepare.tiny.warmstart_steps": 40,
    "prepare.tiny.warmstart_batch_size": 32,
    "prepare.tiny.num_preference_pairs": 200,
    "generate.prompts_per_iteration": 16,
    "generate.group_size": 4,
    "train.minibatch_size": 32,
    "train.micro_batch_size": 16,
}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    keep_dirs = ("rlpipe/", "stages/", ".dvc/")
    keep_files = {"params.yaml", "dvc.yaml", ".dvcignore", ".gitignore", "pyproject.toml"}
    return [f for f in out.splitlines() if f.startswith(keep_dirs) or f in keep_files]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DVC_NO_ANALYTICS="1",
             GIT_AUTHOR_NAME="rlpipe test", GIT_AUTHOR_EMAIL="test@rlpipe.invalid",
             GIT_COMMITTER_NAME="rlpipe test", GIT_COMMITTER_EMAIL="test@rlpipe.invalid")
    return e


@contextmanager
def warm_server(kind: str, root: Path, args: list[str]) -> Iterator[Path]:
    """A warm server of the project ("stage" or "engine", rlpipe/worker) for a block, as `rlpipe run` starts
    them: with the stage server each stage DVC starts forks from it instead of importing torch afresh
    (2-3 s less per stage on 2 cores)."""
    from rlpipe.worker import lifecycle

    old = os.environ.copy()
    os.environ.update(env())  # the server must share the stages' import-time environment, or it declines them
    try:
        lifecycle.start(kind, root, args)
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        yield root
    finally:
        lifecycle.stop(kind, root)


def run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def metrics_at(root: Path, rev: str, stage: str) -> dict:
    """A stage's full metrics file at a revision (a DVC output, rlpipe/stages/headline.py), as `rlpipe diff` reads it."""
    from rlpipe.reports.sources import stage_metrics_at

    metrics, problems = stage_metrics_at(Path(root), rev, "metrics")
    assert not problems, problems
    return metrics[stage]


def edit_params(path: Path, updates: dict[str, object]) -> None:
    data = yaml.safe_load(path.read_text())
    for dotted, value in updates.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def make_project(dest: Path, updates: dict[str, object] | None = None, *, shrink: bool = True) -> Path:
    """Copy the project's files into ``dest`` as a fresh git repo with DVC (params shrunk unless ``shrink=False``)."""
    for rel in tracked_files():
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    shutil.copy2(shipped_params(), dest / "params.yaml")  # as shipped, whatever this checkout ran to
    edit_params(dest / "params.yaml", {**(SMALL if shrink else {}), **(updates or {})})
    run(["git", "init", "-q"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "project"], dest)
    return dest


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory) -> Path:
    """A project after one full `dvc repro` (shared, read-only: copy it before changing anything)."""
    root = make_project(tmp_path_factory.mktemp("project"))
    proc = run(["dvc", "repro"], root)
    (root / "first_repro.log").write_text(proc.stdout + proc.stderr)
    return root


@pytest.fixture()
def project_copy(reproduced, tmp_path) -> Path:
    """A private copy of the reproduced project (git history, DVC cache and artifacts included)."""
    dest = tmp_path / "copy"
    shutil.copytree(reproduced, dest, symlinks=True)
    return dest


def restores(clone: Path, origin: Path, tag: str) -> bool:
    """A fresh clone at ``tag`` pulls every output its dvc.lock names from the remote, and DVC finds it complete."""
    run(["git", "clone", "-q", str(origin), str(clone)], clone.parent)
    run(["git", "checkout", "-q", tag], clone)
    run(["dvc", "pull", "-q"], clone)
    status = run(["dvc", "status"], clone).stdout
    assert "up to date" in status, f"{tag}: {status}"
    return True


def assert_same_samples(single_path: Path, other_path: Path) -> None:
    """Two rollout tables of the same prompts sampled with different process layouts: the same samples, bytes
    and all, and the same footer; the log-probs to float32 rounding (batches are composed differently)."""
    import numpy as np

    from rlpipe.data.io import read_artifact
    from rlpipe.data.schema import ROLLOUTS

    single, other = read_artifact(single_path, ROLLOUTS), read_artifact(other_path, ROLLOUTS)
    assert other.metadata == single.metadata
    assert other.frame.drop("sampler_logprobs").equals(single.frame.drop("sampler_logprobs"))
    np.testing.assert_allclose(other.frame["sampler_logprobs"].explode().to_numpy(),
                               single.frame["sampler_logprobs"].explode().to_numpy(), rtol=0, atol=1e-5)
