"""Fixtures shared by the report tests."""
from __future__ import annotations

import pytest

from tests.reports.view_project import make_tagged_project


@pytest.fixture(scope="session")
def tagged_project(tmp_path_factory):
    """The project of tests/reports/view_project.py (two tags, a changed workspace), built once: read only."""
    return make_tagged_project(tmp_path_factory.mktemp("tagged") / "p")
