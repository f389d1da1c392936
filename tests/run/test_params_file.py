"""rlpipe.run.params_file.set_params: edits values in place, keeping every comment and every other byte of params.yaml."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlpipe.config import load_params
from rlpipe.errors import RlpipeError
from rlpipe.run.params_file import set_params
from tests.shipped import shipped_params

PARAMS = shipped_params()


@pytest.fixture
def params(tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    shutil.copyfile(PARAMS, path)
    return path


def changed_lines(before: str, after: str) -> dict[int, tuple[str, str]]:
    """Line number -> (old, new) for every line that differs; the line count must not change."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    assert len(old) == len(new)
    return {i: (a, b) for i, (a, b) in enumerate(zip(old, new)) if a != b}


def section_line(text: str, dotted: str) -> str:
    """The one line holding `section.key` (or a top-level `key`), found by indentation, whatever its comment says."""
    *section, key = dotted.split(".")
    lines = text.splitlines(keepends=True)
    if not section:
        found = [ln for ln in lines if ln.startswith(f"{key}:")]
    else:
        start = lines.index(f"{section[0]}:\n") if f"{section[0]}:\n" in lines else next(
            i for i, ln in enumerate(lines) if ln.startswith(f"{section[0]}:"))
        body = []
        for ln in lines[start + 1:]:
            if ln[:1] not in (" ", "#", "\n"):
                break
            body.append(ln)
        found = [ln for ln in body if ln.startswith(f"  {key}:")]
    assert len(found) == 1, dotted
    return found[0]


def with_value(line: str, value: str) -> str:
    """`line` with its value replaced and everything after the value (spacing, comment) kept."""
    key, rest = line.split(":", 1)
    old_value = rest.split()[0]
    return f"{key}:{rest.replace(old_value, value, 1)}"


def test_sets_iteration_policy_and_reference_keeping_everything_else(params):
    before = params.read_text()
    lines = before.splitlines(keepends=True)
    updates = {"iteration": 3, "policy.path": "state/policy", "policy.version": 3,
               "policy.latest_path": "state/policy", "reference.version": 2}
    set_params(params, updates)
    after = params.read_text()

    expected = {section_line(before, key): with_value(section_line(before, key), str(value))
                for key, value in updates.items()}
    assert changed_lines(before, after) == {lines.index(old): (old, new) for old, new in expected.items()}
    assert "  path: state/policy   # pi_old" in after  # the value's own width changed, the gap before '#' did not

    comments = [ln for ln in before.splitlines() if ln.lstrip().startswith("#")]
    assert len(comments) >= 3
    assert [ln for ln in after.splitlines() if ln.lstrip().startswith("#")] == comments

    p = load_params(params)
    assert (p.iteration, p.policy.path, p.reference.version) == (3, "state/policy", 2)
    assert p.reference.path == load_params(PARAMS).reference.path
    assert p.paths.model_dir == load_params(PARAMS).paths.model_dir


def test_same_key_name_in_another_section_is_not_touched(params):
    before = params.read_text()
    base = load_params(params)
    shared = base.reference.path
    # policy.path, policy.latest_path, reference.path, critic.path, paths.model_dir hold the same value
    assert before.count(shared) >= 4
    set_params(params, {"reference.path": "state/reference"})
    after = params.read_text()

    old = section_line(before, "reference.path")
    assert changed_lines(before, after) == {
        before.splitlines(keepends=True).index(old): (old, with_value(old, "state/reference"))}
    p = load_params(params)
    assert p.reference.path == "state/reference"
    assert (p.policy.path, p.critic.path, p.paths.model_dir) == (
        base.policy.path, base.critic.path, base.paths.model_dir)


def test_key_of_the_same_name_nested_deeper_is_not_a_section_key(params):
    """`prepare.train` does not exist: `train` lives under prepare.files, and the top-level `train:` is a section."""
    before = params.read_bytes()
    with pytest.raises(RlpipeError, match=r"key 'prepare\.train' not found"):
        set_params(params, {"prepare.train": "x.jsonl"})
    assert params.read_bytes() == before


def test_setting_the_current_value_leaves_the_file_byte_identical(params):
    before = params.read_bytes()
    set_params(params, {"iteration": 0, "policy.path": "artifacts/prepare/model", "train.tis_cap": "auto"})
    assert params.read_bytes() == before


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        ({"iterations": 1}, "key 'iterations' not found"),
        ({"train.lrr": 1.0}, "key 'train.lrr' not found"),
        ({"trainer.lr": 1.0}, "section 'trainer' not found"),
        ({"advantage.kl_in_reward.betaa": 3}, "key 'advantage.kl_in_reward.betaa' not found"),
        ({"advantage.kl_in_reward": 3}, "advantage.kl_in_reward is a section, not a value"),
    ],
)
def test_missing_key_raises_and_writes_nothing(params, updates, message):
    before = params.read_bytes()
    with pytest.raises(RlpipeError) as exc:
        set_params(params, updates)
    assert str(exc.value).startswith(f"{params}: ")
    assert message in str(exc.value)
    assert params.read_bytes() == before


def test_one_bad_key_among_several_writes_nothing(params):
    before = params.read_bytes()
    with pytest.raises(RlpipeError, match=r"key 'train\.lrr' not found"):
        set_params(params, {"iteration": 5, "train.lrr": 1.0})
    assert params.read_bytes() == before
    assert sorted(p.name for p in params.parent.iterdir()) == ["params.yaml"]


@pytest.mark.parametrize("value", ["123", "off", "yes", "null", "1e3", "true"])
def test_a_string_yaml_would_read_as_another_type_is_quoted(params, value):
    """'123' written bare would read back as the int 123, 'off' as False: such strings are quoted."""
    set_params(params, {"critic.path": value})
    assert f'path: "{value}"' in section_line(params.read_text(), "critic.path")
    assert load_params(params).critic.path == value


@pytest.mark.parametrize(
    ("dotted", "value", "rendered"),
    [
        ("critic.path", "models/my critic", '"models/my critic"'),
        ("train.tis_cap", 3.0, "3.0"),
        ("train.kl_beta", 0.04, "0.04"),
        ("advantage.drop_truncated", True, "true"),
        ("prepare.max_prompt_tokens", 128, "128"),
    ],
)
def test_values_are_rendered_as_yaml_that_reads_back_equal(params, dotted, value, rendered):
    set_params(params, {dotted: value})
    section, key = dotted.split(".")
    p = load_params(params)
    assert getattr(getattr(p, section), key) == value
    assert any(ln.startswith(f"  {key}: {rendered}") for ln in params.read_text().splitlines())


def test_section_with_comments_and_blank_lines_inside(tmp_path):
    path = tmp_path / "p.yaml"
    text = (
        "# header\n"
        "a: 1  # top\n"
        "sec:\n"
        "  # first comment\n"
        "  x: 1\n"
        "# a column-0 comment inside the section\n"
        "\n"
        "  y: 2 # trailing\n"
        "other:\n"
        "  y: 3\n"
    )
    path.write_text(text)
    set_params(path, {"sec.y": 5, "a": 2})
    assert path.read_text() == text.replace("  y: 2 # trailing", "  y: 5 # trailing").replace("a: 1  #", "a: 2  #")


def test_a_nested_key_is_set_and_only_it(params):
    """The adaptive KL controller's beta lives three levels down; `beta` elsewhere must not match."""
    before = params.read_text()
    set_params(params, {"advantage.kl_in_reward.beta": 0.0105, "prepare.tiny.num_layers": 3})
    after = params.read_text()
    assert len(changed_lines(before, after)) == 2
    p = load_params(params)
    assert p.advantage.kl_in_reward.beta == 0.0105
    assert p.prepare.tiny.num_layers == 3
    assert "    beta: 0.0105                # with adaptive: true" in after


def test_a_string_yaml_would_read_as_something_else_is_quoted_and_survives_dvc_rewriting(params):
    from dvc.utils.serialize import modify_yaml  # what `dvc exp run -S` rewrites params.yaml with

    set_params(params, {"prepare.files.chat_template": "off"})
    assert 'chat_template: "off"' in params.read_text()
    assert load_params(params).prepare.files.chat_template == "off"
    with modify_yaml(params) as data:  # `dvc exp run -S train.lr=1e-3`: YAML 1.2, the quotes go
        data["train"]["lr"] = 1e-3
    assert "chat_template: off" in params.read_text()
    loaded = load_params(params)
    assert loaded.prepare.files.chat_template == "off" and loaded.train.lr == 1e-3
