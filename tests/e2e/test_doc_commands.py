"""The `# doc-test` shell blocks of README.md and docs/*.md, each run in a fresh copy of a reproduced project."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.e2e.conftest import env
from tests.test_docs import doc_test_blocks

pytestmark = pytest.mark.slow


# The `dvc exp run` block of metrics-and-plots.md runs in test_observability.py, which also checks its results.
BLOCKS = [b for b in doc_test_blocks() if "dvc exp run" not in b[2]]


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p.split('/')[-1]}-{i}" for p, i, _ in BLOCKS])
def test_doc_block_runs(reproduced, tmp_path, page, index, code):
    root = tmp_path / "project"
    shutil.copytree(reproduced, root, symlinks=True)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=root, env=env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"{page} block {index} failed ({proc.returncode}):\n{code}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
