"""Every stage is a plain command: one iteration run stage by stage, no DVC, gives the same bytes as `dvc repro`."""
from __future__ import annotations

import re
import shlex
import shutil

import pytest
import yaml

from rlpipe.run.commands import stage_commands
from tests.e2e.conftest import edit_params, run
from tests.e2e.test_pipeline import ALL_STAGES, ARTIFACTS

pytestmark = pytest.mark.slow


def test_commands_are_what_dvc_runs(reproduced):
    ran = re.findall(r"^> (.*)$", (reproduced / "first_repro.log").read_text(), re.M)
    commands = stage_commands(reproduced / "dvc.yaml", reproduced / "params.yaml")
    assert list(commands) == ALL_STAGES
    assert ran == list(commands.values())


def test_one_iteration_without_dvc_is_byte_identical(reproduced, tmp_path):
    """A scheduler's view: a scratch dir with the stage scripts and params, every path absolute and elsewhere."""
    scratch, out = tmp_path / "job", tmp_path / "shared-fs"
    shutil.copytree(reproduced / "stages", scratch / "stages")
    shutil.copy(reproduced / "params.yaml", scratch / "params.yaml")
    paths = yaml.safe_load((scratch / "params.yaml").read_text())["paths"]
    model = str(out / paths["model_dir"])
    edit_params(scratch / "params.yaml", {**{f"paths.{key}": str(out / rel) for key, rel in paths.items()},
                                          "policy.path": model, "policy.latest_path": model, "reference.path": model, "critic.path": model,
                                          "reward_model.init": model})
    for name, cmd in stage_commands(reproduced / "dvc.yaml", scratch / "params.yaml").items():
        assert str(out) in cmd or name == "check_params", name  # the check reads params.yaml alone
        run(shlex.split(cmd), scratch)

    assert not (scratch / ".dvc").exists() and not (out / ".dvc").exists()
    for rel in ARTIFACTS:
        assert (out / rel).read_bytes() == (reproduced / rel).read_bytes(), rel
    for model_dir in ("artifacts/prepare/model", "artifacts/train/checkpoint"):
        names = sorted(p.name for p in (reproduced / model_dir).iterdir())
        assert sorted(p.name for p in (out / model_dir).iterdir()) == names
        for name in names:
            assert (out / model_dir / name).read_bytes() == (reproduced / model_dir / name).read_bytes(), name
