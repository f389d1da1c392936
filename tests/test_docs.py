"""Docs that cannot rot: the schema page, the README's stage table and set-up commands match the code."""
import re
from pathlib import Path

import yaml

from rlpipe.schema import markdown_table

REPO = Path(__file__).resolve().parents[1]


def test_schema_page_is_generated_from_the_schema_module():
    assert (REPO / "docs/schema.md").read_text() == markdown_table(), "run `rlpipe schema > docs/schema.md`"


def readme_stage_rows() -> dict[str, list[str]]:
    rows = {}
    text = (REPO / "README.md").read_text()
    section = text.split("## The stages", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = re.match(r"^\| `(\w+)` \|.*\| ([^|]*) \|$", line)
        if m and "`" in m.group(2):
            rows[m.group(1)] = sorted(re.findall(r"`([\w.]+)`", m.group(2)))
    return rows


def test_readme_stage_table_lists_exactly_the_params_each_stage_declares():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    rows = readme_stage_rows()
    assert sorted(rows) == sorted(stages)
    for name, stage in stages.items():
        assert rows[name] == sorted(stage["params"]), name


def test_readme_setup_commands_exist():
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("repro", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert "make test" in (REPO / ".ci/run").read_text()


def test_every_params_section_is_documented_in_params_yaml_comments_or_readme():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    readme = (REPO / "README.md").read_text()
    for section in params:
        assert f"`{section}" in readme or f"{section}." in readme, section
