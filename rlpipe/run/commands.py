"""Each stage's command line as ``dvc repro`` runs it: dvc.yaml's ``cmd`` with ``${...}`` filled in from params.yaml.

Why: every stage is a plain process with explicit paths, so a scheduler that is not DVC (a SLURM
or Kubernetes job) can run it; this prints the exact lines, from the one place that defines them,
instead of a copy in the docs that would go stale.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from rlpipe.errors import ConfigError

_VARIABLE = re.compile(r"\$\{\s*([A-Za-z0-9_.-]+)\s*\}")


def _lookup(params: dict[str, Any], dotted: str, where: str) -> str:
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{where}: ${{{dotted}}} is not a key of the params file")
        node = node[part]
    if isinstance(node, (dict, list)) or node is None:
        raise ConfigError(f"{where}: ${{{dotted}}} is not a single value")
    return str(node)


def stage_commands(dvc_yaml: str | Path = "dvc.yaml", params_file: str | Path = "params.yaml") -> dict[str, str]:
    """Stage name -> its command, in dvc.yaml's order (which is the order they run in)."""
    stages = (yaml.safe_load(Path(dvc_yaml).read_text()) or {}).get("stages") or {}
    params = yaml.safe_load(Path(params_file).read_text()) or {}
    return {name: _VARIABLE.sub(lambda m, name=name: _lookup(params, m.group(1), f"{dvc_yaml}: {name}"),
                                stage["cmd"])
            for name, stage in stages.items()}


def format_command(cmd: str) -> str:
    """One ``--option value`` per line, joined with backslashes: the same command, readable and pastable."""
    lines: list[list[str]] = [[]]
    for word in shlex.split(cmd):
        if word.startswith("--") and lines[-1]:
            lines.append([])
        lines[-1].append(shlex.quote(word))
    return " \\\n    ".join(" ".join(line) for line in lines)


def commands_script(dvc_yaml: str | Path = "dvc.yaml", params_file: str | Path = "params.yaml") -> str:
    """Every stage's command, as a shell script in run order (what ``rlpipe commands`` prints)."""
    parts = [f"# {name}\n{format_command(cmd)}\n" for name, cmd in stage_commands(dvc_yaml, params_file).items()]
    return "\n".join(parts)
