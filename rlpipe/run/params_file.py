"""params.yaml edited in place: values set by dotted key, every comment and every other byte kept.

Why not yaml.dump: params.yaml is documentation too; a round trip through a YAML writer would drop
every comment. Used by `rlpipe iterate` (the next iteration's policy), `rlpipe run` (overlap settings)
and `rlpipe init` (a new project's settings).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from rlpipe.data.io import atomic_path
from rlpipe.errors import RlpipeError


def set_params(path: str | Path, updates: dict[str, Any]) -> None:
    """Set scalar values by dotted key (``iteration``, ``policy.path``) in place, keeping comments and layout."""
    p = Path(path)
    lines = p.read_text().splitlines(keepends=True)
    for dotted, value in updates.items():
        parts = dotted.split(".")
        lines = _set_line(lines, parts, value, dotted, p)
    text = "".join(lines)
    data = yaml.safe_load(text)
    for dotted, value in updates.items():
        node = data
        for part in dotted.split("."):
            node = node[part]
        if node != value:
            raise RlpipeError(f"{p}: failed to set {dotted} (read back {node!r})")
    with atomic_path(p) as tmp:
        tmp.write_text(text)


def _render(value: Any) -> str:
    if isinstance(value, str):  # bare only where YAML 1.1 and 1.2 (DVC's) read it back as this string
        bare = (re.fullmatch(r"[A-Za-z0-9_./-]+", value) and yaml.safe_load(value) == value
                and not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value))  # `1e3`: a float to DVC
        return value if bare else json.dumps(value)
    if isinstance(value, (list, dict)):  # on the key's own line: flow style ([a, b], {k: v})
        return yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
    return yaml.safe_dump(value).split("\n")[0]


def _content(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _set_line(lines: list[str], parts: list[str], value: Any, dotted: str, path: Path) -> list[str]:
    """Replace the value of ``a.b.c``: descend one mapping block per part, then rewrite the key's line.

    A block's children are its content lines at the block's smallest indent; the block ends at the
    first content line indented no deeper than its header.
    """
    lo, hi = 0, len(lines)
    for level, part in enumerate(parts):
        children = [i for i in range(lo, hi) if _content(lines[i])]
        child_indent = min((_indent(lines[i]) for i in children), default=0)
        pattern = re.compile(rf"^(\s*){re.escape(part)}:([ \t]*[^#\n]*?)([ \t]*#.*)?$")
        match = next(((i, m) for i in children if _indent(lines[i]) == child_indent
                      and (m := pattern.match(lines[i].rstrip("\n")))), None)
        if match is None:
            what = "key" if level == len(parts) - 1 else "section"
            raise RlpipeError(f"{path}: {what} '{'.'.join(parts[:level + 1])}' not found (setting {dotted})")
        i, m = match
        if level == len(parts) - 1:
            if not m.group(2).strip():
                raise RlpipeError(f"{path}: {dotted} is a section, not a value")
            lines[i] = f"{m.group(1)}{part}: {_render(value)}{m.group(3) or ''}\n"
            return lines
        lo = i + 1
        hi = next((j for j in range(lo, hi) if _content(lines[j]) and _indent(lines[j]) <= child_indent), hi)
    return lines
