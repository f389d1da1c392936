"""Compatibility profiles: complete, valid, the rlpipe profile is ALGORITHMS.md, and docs/profiles.md matches."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpipe.algorithms.advantages import WHITEN_FORMS
from rlpipe.algorithms.aggregation import TOKEN_MEAN_SCOPES
from rlpipe.profiles import FINE_POINTS, MATCHING_DEFAULTS, PROFILE_NOTES, PROFILES, profile_settings

REPO = Path(__file__).resolve().parents[1]
COLUMNS = {"rlpipe": "rlpipe", "trl": "TRL", "verl": "verl", "openrlhf": "OpenRLHF"}


def test_fine_points_are_the_dotted_keys():
    assert FINE_POINTS == (
        "advantage.std_mode", "advantage.eps", "advantage.whiten_form", "advantage.whiten_eps",
        "train.kl_log_ratio_clamp", "train.kl_value_clamp",
        "train.dual_clip_c", "train.gspo_form", "train.token_mean_scope",
    )


def test_the_four_profiles_each_set_every_fine_point_exactly():
    assert sorted(PROFILES) == ["openrlhf", "rlpipe", "trl", "verl"]
    for name, settings in PROFILES.items():
        assert tuple(settings) == FINE_POINTS, name  # every key, nothing else, in the fixed order


def test_the_rlpipe_profile_is_the_algorithms_md_choice():
    assert PROFILES["rlpipe"] == {
        "advantage.std_mode": "sample", "advantage.eps": 1e-6, "advantage.whiten_form": "std",
        "advantage.whiten_eps": 1e-6, "train.kl_log_ratio_clamp": 20.0, "train.kl_value_clamp": 10.0, "train.dual_clip_c": None,
        "train.gspo_form": "sequence", "train.token_mean_scope": "minibatch",
    }


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_value_is_one_the_math_accepts(name):
    s = PROFILES[name]
    assert s["advantage.std_mode"] in ("sample", "population")
    assert isinstance(s["advantage.eps"], float) and s["advantage.eps"] > 0
    assert s["advantage.whiten_form"] in WHITEN_FORMS and s["advantage.whiten_eps"] > 0
    for key in ("train.kl_log_ratio_clamp", "train.kl_value_clamp"):
        assert s[key] is None or (isinstance(s[key], float) and s[key] > 0), key
    assert s["train.dual_clip_c"] is None or s["train.dual_clip_c"] > 1
    assert s["train.gspo_form"] in ("sequence", "token")
    assert s["train.token_mean_scope"] in TOKEN_MEAN_SCOPES


def test_notes_cite_a_source_for_every_profile_and_only_name_known_keys():
    assert sorted(PROFILE_NOTES) == sorted(PROFILES)
    for name, notes in PROFILE_NOTES.items():
        assert notes["source"], name
        unknown = set(notes) - {"source", "url"} - set(FINE_POINTS) - set(MATCHING_DEFAULTS[name])
        assert not unknown, (name, unknown)
    for name in ("trl", "verl", "openrlhf"):  # each framework's value says where it was read
        assert re.search(r"[0-9a-f]{7}", PROFILE_NOTES[name]["source"]), name
        assert set(FINE_POINTS) <= set(PROFILE_NOTES[name]), name


def test_matching_defaults_are_documentation_only_keys():
    assert sorted(MATCHING_DEFAULTS) == sorted(PROFILES)
    for name, keys in MATCHING_DEFAULTS.items():
        assert not set(keys) & set(FINE_POINTS), name


def test_profile_settings_returns_a_copy_and_lists_valid_names():
    settings = profile_settings("verl")
    assert settings == PROFILES["verl"]
    settings["advantage.eps"] = 1.0
    assert PROFILES["verl"]["advantage.eps"] == 1e-6
    with pytest.raises(ValueError, match=r"'deepspeed'.*\['openrlhf', 'rlpipe', 'trl', 'verl'\]"):
        profile_settings("deepspeed")


def test_profiles_module_imports_neither_torch_nor_the_config():
    code = "import sys, rlpipe.profiles; print('torch' in sys.modules, 'rlpipe.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["False", "False"]


def _docs_table() -> dict[str, dict[str, str]]:
    """{key: {column: first `code` of the cell}} of the fine-point table of docs/profiles.md."""
    lines = (REPO / "docs/profiles.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| key | rlpipe |"))
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    rows = {}
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        key = cells[0].strip("`")
        rows[key] = {col: re.match(r"`([^`]*)`", cell).group(1) for col, cell in zip(columns, cells[1:])}
    return rows


def test_docs_table_shows_exactly_the_profile_values():
    table = _docs_table()
    assert list(table) == list(FINE_POINTS)
    for key in FINE_POINTS:
        for name, column in COLUMNS.items():
            assert yaml.safe_load(table[key][column]) == PROFILES[name][key], (key, name)
