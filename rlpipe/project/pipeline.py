"""A project's dvc.yaml and params.yaml, derived from rlpipe's own (the one home of every stage and default).

dvc.yaml: the same stages and commands. What changes is what a stage depends on: the user's
prompt files and tokenizer (for `prepare`, which then builds no tiny model) and reward modules
(for `score`, `evaluate` and `baseline`) are added; rlpipe's own modules (``rlpipe/...``) are dropped, since a
project runs the installed package (the copied stage scripts stay deps).

params.yaml: rlpipe's file with its comments, every path that named the tiny model pointed at the
user's model, the prompt-file settings filled in, and the user's rewards listed with every option.
"""
from __future__ import annotations

import re
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any, Sequence

import yaml

from rlpipe.config import UNSET_OPTION
from rlpipe.errors import ConfigError
from rlpipe.project.sources import UserReward
from rlpipe.run.params_file import set_params

MODEL_KEYS = ("paths.model_dir", "policy.path", "policy.latest_path", "reference.path", "critic.path",
              "reward_model.init", "prepare.files.tokenizer_path")  # paths.model_dir: the starting policy (baseline)
DEVICE_KEYS = ("generate", "reference_logprob", "values", "train", "reward_model", "evaluate")


TEMPLATE_FILES = ("params.yaml", "dvc.yaml", "stages")


def template_root(candidates: Sequence[Path] | None = None) -> Path:
    """Where rlpipe's params.yaml, dvc.yaml and stages/ are, the template of every project: the source tree
    (an editable install, a checkout), else the copy a wheel installs under ``<prefix>/share/rlpipe/template``."""
    if candidates is None:
        data = {Path(sysconfig.get_path("data")), Path(sys.prefix), Path(site.getuserbase())}
        candidates = [Path(__file__).resolve().parents[2], *(d / "share/rlpipe/template" for d in sorted(data))]
    for root in candidates:
        if all((root / f).exists() for f in TEMPLATE_FILES):
            return root
    raise ConfigError("rlpipe init needs rlpipe's params.yaml, dvc.yaml and stages/ (a checkout, or an install "
                      f"that carried them to share/rlpipe/template); none of {[str(c) for c in candidates]} "
                      "holds all three: reinstall rlpipe")


def project_dvc_yaml(template: str, *, reward_files: Sequence[str]) -> str:
    """The template's dvc.yaml for a project of prompt files: see the module docstring."""
    data = yaml.safe_load(template)
    for name, stage in data["stages"].items():
        stage["deps"] = [d for d in stage.get("deps", []) if not str(d).startswith("rlpipe/")]
        if name == "prepare":
            stage["deps"] += ["${prepare.files.train}", "${prepare.files.eval}", "${prepare.files.tokenizer_path}"]
            stage["outs"] = [o for o in stage["outs"] if o != "${paths.model_dir}"]
        if name in ("score", "evaluate", "baseline"):
            stage["deps"] += list(reward_files)
    header = ("# One iteration, written by `rlpipe init` from rlpipe's dvc.yaml (stages, commands, params).\n"
              "# Each stage depends on its stage script, its inputs and the params it reads; rlpipe's own\n"
              "# modules are not listed (the installed package runs): after upgrading rlpipe, `dvc repro -f`.\n")
    return header + yaml.safe_dump(data, sort_keys=False, width=110)


def replace_rewards(text: str, rewards: Sequence[UserReward], accuracy_reward: str) -> str:
    """params.yaml text with ``score.rewards`` replaced by the user's rewards (comments of the key kept)."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, ln in enumerate(lines) if ln.startswith("score:"))
        key = next(i for i in range(start + 1, len(lines)) if re.match(r"^  rewards:", lines[i]))
    except StopIteration:
        raise ConfigError("params.yaml template: no score.rewards block") from None
    end = key + 1
    kept = []
    while end < len(lines) and (not lines[end].strip() or lines[end].lstrip().startswith("#")
                                or len(lines[end]) - len(lines[end].lstrip()) > 2):
        if lines[end].lstrip().startswith("#"):
            kept.append(lines[end])
        end += 1
    entries = []
    for r in rewards:
        options = yaml.safe_dump(r.options, default_flow_style=True, width=1_000_000).strip()
        unset = [k for k, v in r.options.items() if v == UNSET_OPTION]
        note = f"  # write a value for {', '.join(unset)}" if unset else ""
        entries += [f"    - name: {r.name}\n", "      weight: 1.0\n", f"      options: {options}{note}\n"]
    lines[key + 1:end] = kept + entries
    text = "".join(lines)
    return re.sub(r"(?m)^  accuracy_reward: .*$", f"  accuracy_reward: {accuracy_reward}"
                  "   # its value >= 1 counts as correct (accuracy metrics)", text, count=1)


def project_params(template: str, *, model: str, train: str, eval_: str, prompt_column: str,
                   answer_column: str | None, chat_template: str, device: str,
                   rewards: Sequence[UserReward], settings: dict[str, Any], work: Path) -> str:
    """The template's params.yaml for a project (see module docstring); ``settings``: extra dotted keys."""
    text = template
    if rewards:
        text = replace_rewards(text, rewards, rewards[0].name)
    path = work / "params.yaml"
    path.write_text(text)
    updates: dict[str, Any] = {"iteration": 0, "policy.version": 0, "policy.max_staleness": 0,
                               "reference.version": 0, "prepare.source": "files",
                               "prepare.files.train": train, "prepare.files.eval": eval_,
                               "prepare.files.prompt_column": prompt_column,
                               "prepare.files.answer_column": answer_column,
                               "prepare.files.chat_template": chat_template, "prepare.files.preferences": None}
    updates.update({key: model for key in MODEL_KEYS})
    for section in DEVICE_KEYS:
        updates[f"{section}.device"] = device
        updates[f"{section}.dtype"] = "bfloat16" if device == "cuda" else "float32"
    updates.update(settings)
    set_params(path, updates)
    return path.read_text()
