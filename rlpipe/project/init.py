"""`rlpipe init DIR`: a git + DVC project for a user's model, prompt files and rewards, ready for `dvc repro`.

The project holds everything that defines an iteration, so an iteration restores in a fresh clone
(``git checkout iteration-k && dvc pull``): the pipeline (dvc.yaml, params.yaml, the stage scripts),
the reward modules (in git, at the project root where the score stage imports them), and the model
and prompt files (copied under models/ and data/, tracked by DVC: their ``.dvc`` pointers are in git).
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from rlpipe.config import UNSET_OPTION, load_params
from rlpipe.data.io import atomic_path
from rlpipe.data.conversation import CONVERSATIONAL, same_format
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.project import pipeline, sizing, sources

MODEL_DIR = "models/base"
DATA_DIR = "data"
# The Vega-Lite chart templates dvc.yaml's plots name (`template: iteration`): DVC looks them up in .dvc/plots.
CHART_TEMPLATES = Path(".dvc") / "plots"
GITIGNORE = """\
# written by `rlpipe init`; DVC adds its own outputs to the .gitignore files it keeps
.venv/
__pycache__/
*.pyc
/.rlpipe/
/dvc_plots/
# local logs of the optional trackers (iterate.trackers: tensorboard, mlflow)
/runs/
/mlruns/
"""
DVCIGNORE = """\
# a .pyc records its source's mtime, which differs on every clone: never part of a stage's inputs
__pycache__/
*.pyc
# resume states and warm-server files of rlpipe (never a stage input or output)
.rlpipe/
"""


@dataclass(frozen=True)
class InitReport:
    root: Path
    rewards: tuple[sources.UserReward, ...]
    num_train: int
    num_eval: int
    prompt_format: str  # "standard" or "conversational" (rlpipe.data.conversation)
    sizing: str = ""  # what init chose from the model's parameter count, and why (rlpipe.project.sizing)

    @property
    def unset_options(self) -> list[str]:
        return [f"{r.name}: {k}" for r in self.rewards for k, v in r.options.items() if v == UNSET_OPTION]


def init_project(dest: str | Path, *, model: str | Path, train: str | Path, eval_: str | Path,
                 rewards: Sequence[str] = (), prompt_column: str = "prompt", answer_column: str | None = "answer",
                 chat_template: str = "auto", device: str = "cpu", settings: dict[str, Any] | None = None,
                 git: bool = True, reward_source: str | Path | None = None) -> InitReport:
    """Create the project in ``dest`` (which must not exist or be empty); see the module docstring.

    ``rewards``: ``module:function`` names (a module in ``reward_source``, default the current
    directory, is copied into the project); none: the built-in exact_answer + digit_match on the
    answer column. ``settings``: more params.yaml values by dotted key (``generate.group_size``).
    """
    root = Path(dest)
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root}: exists and is not empty; rlpipe init makes a new project")
    if not rewards and answer_column is None:
        raise ConfigError("without --reward the built-in exact_answer reward scores against the answer column; "
                          "give --answer-column or a --reward")
    if chat_template not in ("auto", "on", "off"):
        raise ConfigError(f"--chat-template {chat_template!r} is not one of auto, on, off")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is not one of cpu, cuda")
    template = pipeline.template_root()
    root.mkdir(parents=True, exist_ok=True)
    try:
        report = _fill(root, template, model=model, train=train, eval_=eval_, rewards=rewards,
                       prompt_column=prompt_column, answer_column=answer_column, chat_template=chat_template,
                       device=device, settings=settings or {}, reward_source=reward_source)
        if git:
            _git_and_dvc(root, [MODEL_DIR, DATA_DIR])
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)  # never leave half a project behind
        raise
    if git:  # after the clean-up window: a missing git identity must not cost the finished project
        _first_commit(root)
    return report


def _fill(root: Path, template: Path, *, model, train, eval_, rewards, prompt_column, answer_column,
          chat_template, device, settings, reward_source) -> InitReport:
    (root / DATA_DIR).mkdir()
    files = {split: sources.import_prompt_file(src, root / DATA_DIR, split)
             for split, src in (("train", train), ("eval", eval_))}
    given = {"train": train, "eval": eval_}
    tables = {split: sources.read_prompt_table(f, prompt_column, answer_column, source=given[split])
              for split, f in files.items()}
    try:
        prompt_format = same_format({given[split]: sources.prompt_file_format(table, prompt_column, given[split])
                                     for split, table in tables.items()})
    except ArtifactError as e:
        raise ConfigError(str(e)) from None
    sources.copy_model(model, root / MODEL_DIR, chat_template=chat_template,
                       prompts=given["train"] if prompt_format == CONVERSATIONAL else None)
    columns_by_file = {str(given[split]): table.columns for split, table in tables.items()}
    user_rewards = tuple(sources.import_reward(name, root, columns=tables["train"].columns, source_dir=reward_source,
                                               columns_by_file=columns_by_file, answer_column=answer_column)
                         for name in rewards)
    reward_files = sorted({f for r in user_rewards for f in r.files})
    defaults = yaml.safe_load((template / "params.yaml").read_text())
    per_iteration = defaults["generate"]["prompts_per_iteration"]
    if "generate.prompts_per_iteration" not in settings and tables["train"].height < per_iteration:
        # every prompt, every iteration: said here once instead of by generate at every iteration
        settings = {**settings, "generate.prompts_per_iteration": tables["train"].height}
    settings, sizing_line = _fitting(root / MODEL_DIR, settings, defaults)
    shutil.copytree(template / "stages", root / "stages", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / "dvc.yaml").write_text(pipeline.project_dvc_yaml((template / "dvc.yaml").read_text(),
                                                             reward_files=reward_files))
    pipeline.project_params((template / "params.yaml").read_text(), model=MODEL_DIR,
                            train=files["train"].relative_to(root).as_posix(),
                            eval_=files["eval"].relative_to(root).as_posix(), prompt_column=prompt_column,
                            answer_column=answer_column, chat_template=chat_template, device=device,
                            rewards=user_rewards, settings=settings, work=root)
    (root / ".gitignore").write_text(GITIGNORE)
    if not _unset(user_rewards):
        load_params(root / "params.yaml")  # the written file passes the strict loader (unless options wait)
    return InitReport(root=root, rewards=user_rewards, num_train=tables["train"].height,
                      num_eval=tables["eval"].height, prompt_format=prompt_format, sizing=sizing_line)


def _fitting(model_dir: Path, settings: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``settings`` with the learning rate and batch settings that fit the model's size under them (a value the
    user set wins), and the line saying what was chosen (`rlpipe.project.sizing`)."""
    num_parameters = sizing.count_parameters(model_dir)
    group = settings.get("generate.group_size", defaults["generate"]["group_size"])
    prompts = settings.get("generate.prompts_per_iteration", defaults["generate"]["prompts_per_iteration"])
    chosen = {} if num_parameters is None else sizing.fitting_settings(
        num_parameters, samples_per_iteration=prompts * group, micro_batch_size=settings.get("train.micro_batch_size"))
    fitting = {k: v for k, v in chosen.items() if k not in settings}
    if "train.minibatch_size" in settings and "train.micro_batch_size" in fitting:  # never above the user's mini-batch
        fitting["train.micro_batch_size"] = min(fitting["train.micro_batch_size"], settings["train.minibatch_size"])
    kept = {"train.lr": defaults["train"]["lr"], "train.epochs": defaults["train"]["epochs"]}
    return {**fitting, **settings}, sizing.describe(num_parameters, fitting, kept)


def refresh_stages(dest: str | Path) -> list[str]:
    """Copy this rlpipe's stage scripts over those of a project that `rlpipe init` made with an older rlpipe.

    Why: a project holds copies of the stage scripts (they are its stages' deps, restored with every
    iteration), and a newer rlpipe's package may no longer have what an old copy imports. Returns the
    scripts that changed (the stages that run them re-run at the next `dvc repro`); git shows the change.
    """
    root = Path(dest)
    if not ((root / "dvc.yaml").is_file() and (root / "stages").is_dir()):
        raise ConfigError(f"{root}: not a project made by `rlpipe init` (it needs dvc.yaml and stages/)")
    template = pipeline.template_root()
    if template.resolve() == root.resolve():
        raise ConfigError(f"{root} is rlpipe's own source tree: its stage scripts are the ones projects copy")
    changed = []
    for script in sorted((template / "stages").glob("*.py")):
        target = root / "stages" / script.name
        if not target.is_file() or target.read_bytes() != script.read_bytes():
            with atomic_path(target) as tmp:
                tmp.write_bytes(script.read_bytes())
            changed.append(f"stages/{script.name}")
    return changed


def _unset(rewards: Sequence[sources.UserReward]) -> bool:
    return any(v == UNSET_OPTION for r in rewards for v in r.options.values())


def _run(cmd: list[str], root: Path) -> None:
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"`{' '.join(cmd)}` failed in {root} (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()}")


def _git_and_dvc(root: Path, tracked: list[str]) -> None:
    """git init, dvc init, `dvc add` the model and the prompt files (each file of data/ on its own)."""
    _run(["git", "init", "-q"], root)
    _run(["dvc", "init", "-q"], root)
    (root / ".dvcignore").write_text(DVCIGNORE)
    _copy_chart_templates(template_dir=pipeline.template_root() / CHART_TEMPLATES, dest=root / CHART_TEMPLATES)
    _run(["dvc", "config", "core.analytics", "false"], root)
    files = [t for t in tracked if t != DATA_DIR] + sorted(f"{DATA_DIR}/{p.name}" for p in (root / DATA_DIR).iterdir())
    _run(["dvc", "add", "-q", *files], root)
    _run(["git", "add", "-A"], root)


def _copy_chart_templates(*, template_dir: Path, dest: Path) -> None:
    """The chart templates into the project's .dvc/plots (committed with it, so every clone draws the same)."""
    charts = sorted(template_dir.glob("*.json"))
    if not charts:
        raise ConfigError(f"{template_dir}: no chart templates (*.json) for dvc.yaml's plots: reinstall rlpipe")
    dest.mkdir(parents=True, exist_ok=True)
    for chart in charts:
        shutil.copyfile(chart, dest / chart.name)


def _first_commit(root: Path) -> None:
    try:
        _run(["git", "commit", "-q", "-m", "rlpipe init: the project (model and prompt files tracked by DVC)"], root)
    except ConfigError as e:
        raise ConfigError(f"the project is written, but its first commit failed ({e}); fix that (often: "
                          f"`git config --global user.email ...`), then `git -C {root} commit -m init`") from None
