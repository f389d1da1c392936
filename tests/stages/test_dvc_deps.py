"""dvc.yaml's code deps against the code each stage runs: its script and everything that imports, read with `ast`.

A dep that is missing means DVC would keep a stage's cached outputs after a change to code that
computes them; so every module a stage script imports, directly or through other rlpipe modules, lazily or
not, must be covered by a listed file or directory. Left out on purpose (dvc.yaml's header says why):
modules that never change an output. Package __init__ files are not followed: they only re-export.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from tests.test_house import ROOT, imports, modules, runtime_nodes

NEVER_CHANGE_OUTPUTS = {"rlpipe/stages/runner.py", "rlpipe/stages/headline.py", "rlpipe/progress.py",
                        "rlpipe/errors.py", "rlpipe/worker/stage_client.py", "rlpipe/worker/wire.py",
                        "rlpipe/cluster/node.py"}
# per stage: modules it runs only to refuse bad input early, never changing its outputs (dvc.yaml's header says why)
CHECKS_ONLY = {"prepare": {"rlpipe/rewards/columns.py", "rlpipe/rewards/trl_style.py", "rlpipe/rewards/base.py"}}
STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def script_imports(script: Path) -> set[str]:
    found = set()
    for node in runtime_nodes(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlpipe"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules() else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules()}
    return found


def code_run_by(script: Path) -> set[str]:
    """Every rlpipe module file reachable from the script's imports (package __init__s not followed)."""
    seen: set[str] = set()
    todo = list(script_imports(script))
    while todo:
        name = todo.pop()
        if name in seen or name not in modules():
            continue
        seen.add(name)
        todo += [target for target, _, _ in imports(name)]
    return {str(modules()[name].relative_to(ROOT)) for name in seen}


def code_deps(stage: dict) -> list[str]:
    return [d for d in stage["deps"] if isinstance(d, str) and d.split("/")[0] in ("rlpipe", "stages")]


def covered(path: str, deps: list[str]) -> bool:
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


@pytest.mark.parametrize("name", sorted(STAGES))
def test_a_stage_depends_on_all_the_code_it_runs(name):
    script = ROOT / re.search(r"stages/\w+\.py", STAGES[name]["cmd"]).group(0)
    deps = code_deps(STAGES[name])
    assert str(script.relative_to(ROOT)) in deps
    runs = code_run_by(script) - NEVER_CHANGE_OUTPUTS - CHECKS_ONLY.get(name, set())
    missing = sorted(p for p in runs if not covered(p, deps))
    assert missing == [], f"dvc.yaml stage {name!r} runs these but does not list them as deps"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_code_dep_exists(name):
    assert [d for d in code_deps(STAGES[name]) if not (ROOT / d).exists()] == []


def test_the_check_sees_lazy_imports_and_misses_a_dropped_dep():
    """The train stage imports rlpipe/models/critic.py inside its logic: dropping it from the deps is caught."""
    script = ROOT / "stages/train.py"
    assert "rlpipe/models/critic.py" in code_run_by(script)
    assert "rlpipe/models/lora/peft_model.py" in code_run_by(script)  # imported inside functions only
    deps = [d for d in code_deps(STAGES["train"]) if d != "rlpipe/models/critic.py"]
    assert not covered("rlpipe/models/critic.py", deps)
