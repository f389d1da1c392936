"""`rlpipe init` without running the pipeline: the files it writes, what it refuses, the sources it reads.

Independent of the live params.yaml: a project's params come from rlpipe's template with every
key `rlpipe init` owns overwritten, which is what these tests check.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from rlpipe.config import UNSET_OPTION, load_params
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.project.init import MODEL_DIR, init_project
from rlpipe.project.pipeline import MODEL_KEYS
from rlpipe.tiny.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[2]

REWARDS = '''
def brevity(sample, *, target_tokens, floor=0.0):
    return max(floor, 1.0 - sample.completion_tokens / target_tokens)


def trl_match(prompts, completions, answer, *, bonus=1.0, **kwargs):
    return [bonus * (c == a) for c, a in zip(completions, answer)]
'''


@pytest.fixture()
def inputs(tmp_path):
    model = tmp_path / "in" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # init copies the directory; it loads only the tokenizer from it
    build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ").save_pretrained(model)
    rows = [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(5)]
    pl.DataFrame(rows).write_ndjson(tmp_path / "in" / "train.jsonl")
    pl.DataFrame(rows[:2]).write_parquet(tmp_path / "in" / "eval.parquet")
    (tmp_path / "in" / "myrewards.py").write_text(REWARDS)
    return tmp_path / "in"


def make(inputs, dest, **kwargs):
    defaults = dict(model=inputs / "model", train=inputs / "train.jsonl", eval_=inputs / "eval.parquet",
                    prompt_column="question", answer_column="solution", git=False, reward_source=inputs)
    return init_project(dest, **{**defaults, **kwargs})


def test_params_point_every_model_path_at_the_copied_model(inputs, tmp_path):
    report = make(inputs, tmp_path / "p", settings={"generate.group_size": 2}, device="cuda")
    params = load_params(tmp_path / "p" / "params.yaml")
    raw = yaml.safe_load((tmp_path / "p" / "params.yaml").read_text())
    for key in MODEL_KEYS:
        section, *rest = key.split(".")
        node = raw[section]
        for part in rest:
            node = node[part]
        assert node == MODEL_DIR, key
    assert (params.iteration, params.policy.version, params.policy.max_staleness, params.reference.version) == (0,) * 4
    assert params.prepare.source == "files" and params.prepare.files.prompt_column == "question"
    assert (params.prepare.files.train, params.prepare.files.eval) == ("data/train.jsonl", "data/eval.parquet")
    assert params.generate.group_size == 2 and params.train.device == "cuda" and params.generate.dtype == "bfloat16"
    assert [r.name for r in params.score.rewards] == ["exact_answer", "digit_match"]  # no --reward: the built-ins
    assert (tmp_path / "p" / MODEL_DIR / "config.json").is_file() and (report.num_train, report.num_eval) == (5, 2)
    assert "# pi_old" in (tmp_path / "p" / "params.yaml").read_text()  # the template's comments kept


def test_dvc_yaml_depends_on_the_users_files_not_the_tiny_model(inputs, tmp_path):
    make(inputs, tmp_path / "p", rewards=["myrewards:brevity"])
    stages = yaml.safe_load((tmp_path / "p" / "dvc.yaml").read_text())["stages"]
    assert "${paths.model_dir}" not in stages["prepare"]["outs"]
    assert {"${prepare.files.train}", "${prepare.files.eval}"} <= set(stages["prepare"]["deps"])
    assert all(not str(d).startswith("rlpipe/") for s in stages.values() for d in s["deps"])
    assert "myrewards.py" in stages["score"]["deps"] and "myrewards.py" in stages["evaluate"]["deps"]
    assert (tmp_path / "p" / "myrewards.py").read_text() == REWARDS
    assert (tmp_path / "p" / "stages" / "score.py").is_file()


def test_reward_options_to_fill_in_are_listed_and_refused_by_name(inputs, tmp_path):
    report = make(inputs, tmp_path / "p", rewards=["myrewards:brevity", "myrewards:trl_match"])
    assert report.unset_options == ["myrewards:brevity: target_tokens"]
    rewards = yaml.safe_load((tmp_path / "p" / "params.yaml").read_text())["score"]["rewards"]
    assert rewards[0]["options"] == {"target_tokens": UNSET_OPTION, "floor": 0.0}
    assert rewards[1]["options"] == {"bonus": 1.0}  # TRL-style: answer is a column of the file, not an option
    with pytest.raises(ConfigError, match=r"score.rewards\[0\] \(myrewards:brevity\).options.target_tokens"):
        load_params(tmp_path / "p" / "params.yaml")
    path = tmp_path / "p" / "params.yaml"
    path.write_text(path.read_text().replace(UNSET_OPTION, "200"))
    params = load_params(path)
    assert params.score.accuracy_reward == "myrewards:brevity"


@pytest.mark.parametrize("problem, match", [
    (dict(prompt_column="prompt"), "no column 'prompt'"),
    (dict(rewards=["nowhere:fn"]), "cannot import module 'nowhere'"),
    (dict(rewards=["myrewards:missing"]), "has no attribute 'missing'"),
    (dict(device="tpu"), "--device"),
])
def test_refusals_name_the_problem_and_leave_nothing_behind(inputs, tmp_path, problem, match):
    with pytest.raises(ConfigError, match=match):
        make(inputs, tmp_path / "p", **problem)
    assert not (tmp_path / "p").exists()


def test_prompt_file_errors_name_the_file_the_user_gave(inputs, tmp_path):
    """Not the project's copy of it (data/train.jsonl), which the refusal has removed again."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(inputs / 'train.jsonl'))}: no column 'prompt'"):
        make(inputs, tmp_path / "p", prompt_column="prompt")
    (inputs / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(inputs / 'empty.jsonl'))}: the file is empty"):
        make(inputs, tmp_path / "p", train=inputs / "empty.jsonl")
    pl.DataFrame(schema={"question": pl.String, "solution": pl.String}).write_parquet(inputs / "none.parquet")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(inputs / 'none.parquet'))}: no rows"):
        make(inputs, tmp_path / "p", eval_=inputs / "none.parquet")
    assert not (tmp_path / "p").exists()


def test_refuses_a_non_empty_directory(inputs, tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        make(inputs, tmp_path / "p")
    assert (tmp_path / "p" / "keep.txt").read_text() == "mine"


def test_csv_prompts(inputs, tmp_path):
    pl.read_ndjson(inputs / "train.jsonl").write_csv(inputs / "train.csv")
    make(inputs, tmp_path / "p", train=inputs / "train.csv")
    assert load_params(tmp_path / "p" / "params.yaml").prepare.files.train == "data/train.csv"


def test_hf_datasets_directory_is_converted_to_parquet(inputs, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = pl.read_ndjson(inputs / "train.jsonl").to_dicts()
    datasets.Dataset.from_list(rows).save_to_disk(str(inputs / "hf_train"))
    make(inputs, tmp_path / "p", train=inputs / "hf_train")
    assert pl.read_parquet(tmp_path / "p" / "data" / "train.parquet").to_dicts() == rows


def test_git_and_dvc_initialised_with_the_inputs_tracked_by_dvc(inputs, tmp_path):
    make(inputs, tmp_path / "p", git=True)
    root = tmp_path / "p"
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    assert {"models/base.dvc", "data/train.jsonl.dvc", "data/eval.parquet.dvc", "dvc.yaml", "params.yaml",
            ".gitignore", ".dvcignore", "stages/train.py", ".dvc/plots/iteration.json",
            ".dvc/plots/quantile_band.json"} <= set(files)  # the chart templates dvc.yaml's plots name
    assert (root / ".dvc/plots/iteration.json").read_bytes() == (REPO / ".dvc/plots/iteration.json").read_bytes()
    assert "dvc_plots/" in (root / ".gitignore").read_text()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    assert status == ""
    assert json.loads((root / MODEL_DIR / "config.json").read_text()) == {}


def test_a_built_in_reward_by_name_lists_its_options(inputs, tmp_path):
    report = make(inputs, tmp_path / "p", rewards=["format_regex", "myrewards:brevity"])
    assert [r.name for r in report.rewards] == ["format_regex", "myrewards:brevity"]
    assert report.rewards[0].options == {"pattern": UNSET_OPTION, "mode": UNSET_OPTION} and not report.rewards[0].files


def test_cli_init_and_version(inputs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    monkeypatch.chdir(inputs)  # where the reward module sits
    result = CliRunner().invoke(app, ["init", str(tmp_path / "p"), "--model", "model", "--train", "train.jsonl",
                                      "--eval", "eval.parquet", "--prompt-column", "question", "--answer-column",
                                      "solution", "--reward", "myrewards:brevity", "--set", "generate.group_size=3",
                                      "--set", "iterate.trackers=[dvclive]"])
    assert result.exit_code == 0, result.output
    assert "myrewards:brevity: target_tokens" in result.output and "dvc repro" in result.output
    assert "plots: `dvc plots show` draws offline" in result.output  # the Vega libraries inline, no CDN
    assert "html_template = ../.rlpipe/dvc-plots/offline-template.html" in (tmp_path / "p" / ".dvc/config.local").read_text()
    raw = yaml.safe_load((tmp_path / "p" / "params.yaml").read_text())
    assert raw["generate"]["group_size"] == 3 and raw["iterate"]["trackers"] == ["dvclive"]
    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("rlpipe ")


def test_the_template_is_found_beside_the_package_or_where_a_wheel_put_it(tmp_path):
    from rlpipe.project.pipeline import template_root

    assert template_root() == REPO  # a checkout / editable install: the source tree
    installed = tmp_path / "share/rlpipe/template"
    (installed / "stages").mkdir(parents=True)
    for name in ("params.yaml", "dvc.yaml"):
        (installed / name).write_text("x")
    assert template_root([tmp_path / "no-source-tree", installed]) == installed
    (installed / "dvc.yaml").unlink()
    with pytest.raises(ConfigError, match="holds all three: reinstall rlpipe"):
        template_root([tmp_path / "no-source-tree", installed])


def test_the_wheel_carries_the_template_of_rlpipe_init(tmp_path):
    """A non-editable install has no source tree: the wheel's data files are what `rlpipe init` copies."""
    import zipfile

    pytest.importorskip("setuptools", reason="builds the wheel with the environment's own setuptools (no download)")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("rlpipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = next(n.split("/data/")[0] for n in names if "/data/share/rlpipe/template/" in n) + "/data/share/rlpipe/template"
    stages = sorted(p.name for p in (REPO / "stages").glob("*.py"))
    charts = sorted(p.name for p in (REPO / ".dvc/plots").glob("*.json"))
    assert charts == ["iteration.json", "quantile_band.json"]  # the chart templates dvc.yaml's plots name
    assert {f"{data}/params.yaml", f"{data}/dvc.yaml", *(f"{data}/stages/{s}" for s in stages),
            *(f"{data}/.dvc/plots/{c}" for c in charts)} <= names
    assert zipfile.ZipFile(wheel).read(f"{data}/params.yaml") == (REPO / "params.yaml").read_bytes()


def test_refresh_stages_brings_an_old_projects_scripts_up_to_date(tmp_path):
    """A project made by an older rlpipe holds stage scripts that import old paths: refresh-stages copies the
    template's over them, reports which changed, and is a no-op the second time."""
    from typer.testing import CliRunner

    from rlpipe.cli import app

    project = tmp_path / "project"
    (project / "stages").mkdir(parents=True)
    (project / "dvc.yaml").write_text("stages: {}\n")
    (project / "stages" / "score.py").write_text("import rlpipe.stage as stage  # an older rlpipe's script\n")
    first = CliRunner().invoke(app, ["refresh-stages", str(project)])
    assert first.exit_code == 0, first.output
    template = sorted((REPO / "stages").glob("*.py"))
    assert {p.name for p in (project / "stages").glob("*.py")} == {p.name for p in template}
    for script in template:
        assert (project / "stages" / script.name).read_bytes() == script.read_bytes(), script.name
    assert "stages/score.py" in first.output and "re-run at the next `dvc repro`" in first.output
    second = CliRunner().invoke(app, ["refresh-stages", str(project)])
    assert second.exit_code == 0 and "already this rlpipe's" in second.output


def test_refresh_stages_refuses_a_directory_that_is_no_project(tmp_path):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    result = CliRunner().invoke(app, ["refresh-stages", str(tmp_path)])
    assert result.exit_code == 2 and f"{tmp_path}: not a project made by `rlpipe init`" in result.output
    assert list(tmp_path.iterdir()) == []
    own = CliRunner().invoke(app, ["refresh-stages", str(REPO)])
    assert own.exit_code == 2 and "rlpipe's own source tree" in own.output


@pytest.mark.parametrize("choice", ["auto", "on", "off"])
def test_every_chat_template_choice_is_written_as_itself(inputs, tmp_path, choice):
    make(inputs, tmp_path / "p", chat_template=choice)  # `off` used to be refused: read back as YAML's False
    assert load_params(tmp_path / "p" / "params.yaml").prepare.files.chat_template == choice


def test_a_prompt_file_smaller_than_an_iteration_sets_prompts_per_iteration(inputs, tmp_path):
    make(inputs, tmp_path / "p")  # 5 prompts: every one, every iteration, without a warning each time
    assert load_params(tmp_path / "p" / "params.yaml").generate.prompts_per_iteration == 5
    make(inputs, tmp_path / "q", settings={"generate.prompts_per_iteration": 64})  # a choice of the user's stands
    assert load_params(tmp_path / "q" / "params.yaml").generate.prompts_per_iteration == 64


def test_a_model_directory_without_a_tokenizer_is_refused_naming_it(inputs, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (inputs / "model" / name).unlink(missing_ok=True)
    (inputs / "model" / "config.json").write_text('{"model_type": "qwen2"}')  # transformers builds an empty one
    with pytest.raises(ArtifactError, match=r"model: holds no usable tokenizer .*tokenizer.save_pretrained"):
        make(inputs, tmp_path / "p")
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------- TRL's conversational format (issue 31 item 1)

CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a: {% endif %}"


def conversational(inputs: Path, name: str, n: int) -> Path:
    """``n`` rows in TRL's conversational format (a system message first) with the solution and level columns."""
    rows = [{"question": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}],
             "solution": str(i), "level": i % 3} for i in range(n)]
    pl.DataFrame(rows).write_parquet(inputs / name)
    return inputs / name


def with_chat_template(inputs: Path) -> Path:
    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 :\n")
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(inputs / "model")
    return inputs / "model"


def test_a_conversational_parquet_file_is_detected_and_reported(inputs, tmp_path):
    with_chat_template(inputs)
    report = make(inputs, tmp_path / "p", train=conversational(inputs, "c_train.parquet", 4),
                  eval_=conversational(inputs, "c_eval.parquet", 2))
    assert report.prompt_format == "conversational" and (report.num_train, report.num_eval) == (4, 2)
    assert make(inputs, tmp_path / "q").prompt_format == "standard"


def test_a_conversational_datasets_directory_is_detected(inputs, tmp_path):
    datasets = pytest.importorskip("datasets")
    with_chat_template(inputs)
    rows = pl.read_parquet(conversational(inputs, "c.parquet", 3)).to_dicts()
    datasets.Dataset.from_list(rows).save_to_disk(str(inputs / "hf_chat"))
    report = make(inputs, tmp_path / "p", train=inputs / "hf_chat", eval_=inputs / "c.parquet")
    assert report.prompt_format == "conversational"
    assert pl.read_parquet(tmp_path / "p" / "data" / "train.parquet")["question"].to_list() == \
        [r["question"] for r in rows]


def test_conversational_prompts_are_refused_without_a_chat_template_naming_file_and_model(inputs, tmp_path):
    train = conversational(inputs, "c_train.parquet", 2)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(train))} holds conversational prompts .* the tokenizer in "
                                          rf"{re.escape(str(inputs / 'model'))} has no chat template"):
        make(inputs, tmp_path / "p", train=train, eval_=conversational(inputs, "c_eval.parquet", 1))
    assert not (tmp_path / "p").exists()


def test_conversational_prompts_are_refused_with_the_chat_template_off(inputs, tmp_path):
    with_chat_template(inputs)
    with pytest.raises(ConfigError, match="prepare.files.chat_template is 'off'; set it to auto or on"):
        make(inputs, tmp_path / "p", train=conversational(inputs, "c.parquet", 2), eval_=inputs / "c.parquet",
             chat_template="off")


def test_files_of_different_formats_are_refused(inputs, tmp_path):
    with_chat_template(inputs)
    with pytest.raises(ConfigError, match=r"c.parquet is conversational, .*eval.parquet is standard"):
        make(inputs, tmp_path / "p", train=conversational(inputs, "c.parquet", 2))


def test_cli_init_says_which_format_it_found(inputs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    with_chat_template(inputs)
    conversational(inputs, "c.parquet", 2)
    monkeypatch.chdir(inputs)
    args = ["--model", "model", "--prompt-column", "question", "--answer-column", "solution"]
    result = CliRunner().invoke(app, ["init", str(tmp_path / "p"), "--train", "c.parquet", "--eval", "c.parquet", *args])
    assert result.exit_code == 0, result.output
    assert "prompts: conversational format (each prompt a list of {role, content} messages" in result.output
    result = CliRunner().invoke(app, ["init", str(tmp_path / "q"), "--train", "train.jsonl", "--eval", "eval.parquet",
                                      *args])
    assert "prompts: standard format (each prompt a string" in result.output
    refused = CliRunner().invoke(app, ["init", str(tmp_path / "r"), "--train", "c.parquet", "--eval", "eval.parquet",
                                       *args])
    assert refused.exit_code != 0 and "c.parquet is conversational" in refused.output


# ---------------------------------------------------------------- a reward's columns in both files (item 5)

LEVEL_REWARD = '''
def by_level(completions, level, **kwargs):
    return [float(x) for x in level]
'''


def test_a_reward_column_the_eval_file_lacks_is_refused_naming_file_and_column(inputs, tmp_path):
    (inputs / "lvl.py").write_text(LEVEL_REWARD)
    pl.read_parquet(inputs / "eval.parquet").drop("level").write_parquet(inputs / "eval_nolevel.parquet")
    try:
        with pytest.raises(ConfigError, match=rf"^reward 'lvl:by_level' needs column\(s\) 'level' \(its "
                                              rf"required parameters\), which {re.escape(str(inputs))}/"
                                              r"eval_nolevel.parquet lacks; its columns are \['question', 'solution'\]"):
            make(inputs, tmp_path / "p", rewards=["lvl:by_level"], eval_=inputs / "eval_nolevel.parquet")
        assert not (tmp_path / "p").exists()
        report = make(inputs, tmp_path / "q", rewards=["lvl:by_level"])  # both files have it: a column, no option
        assert report.rewards[0].options == {}
    finally:
        sys.modules.pop("lvl", None)


def fake_weights(model_dir: Path, parameters: int) -> None:
    """A safetensors file whose header declares ``parameters`` elements (init reads headers only, never weights)."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [parameters // 1000, 1000], "data_offsets": [0, 0]}}).encode()
    (model_dir / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def test_a_real_sized_model_gets_trl_and_verl_settings_and_a_setting_given_wins(inputs, tmp_path):
    fake_weights(inputs / "model", 494_000_000)
    report = make(inputs, tmp_path / "p", settings={"train.micro_batch_size": 2})
    params = load_params(tmp_path / "p" / "params.yaml")
    # 5 train prompts x group 8 = 40 samples an iteration: 4 optimizer steps of 10
    assert (params.train.lr, params.train.epochs, params.train.minibatch_size, params.train.micro_batch_size) == (
        1e-6, 1, 10, 2)
    assert report.sizing.startswith("model: 494.00M parameters (100M-1B parameters): train.lr 1e-06, train.epochs 1")
    assert "train.micro_batch_size" not in report.sizing  # the user's value, not init's choice


def test_a_small_model_keeps_rlpipes_settings_and_is_told_so(inputs, tmp_path):
    fake_weights(inputs / "model", 3_000_000)
    report = make(inputs, tmp_path / "p")
    template = yaml.safe_load((REPO / "params.yaml").read_text())["train"]
    params = load_params(tmp_path / "p" / "params.yaml")
    assert (params.train.lr, params.train.epochs) == (template["lr"], template["epochs"])
    assert report.sizing.startswith("model: 3.00M parameters (under 100M parameters): kept rlpipe's defaults")
