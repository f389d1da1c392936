"""A newcomer with a dataset in TRL's conversational format and TRL-style rewards in a package of their own.

`rlpipe init` (train prompts in a `datasets` save_to_disk directory, eval prompts in Parquet: one project covers
both sources) says which format it found -> `dvc repro` renders the messages with the model's chat template,
the rewards receive message lists as TRL passes them (`completion[0]["content"]`, the system message first in
each prompt) on the train rollouts and at evaluate -> `rlpipe inspect` shows the rendered prompt and filters on
the file's own `word` column -> a reward option changed re-runs only `score` and what follows -> `rlpipe
iterate` records the iteration and pushes it -> it restores in a fresh clone.
"""
from __future__ import annotations

import json

import pytest

from rlpipe.data.io import read_artifact, read_json
from rlpipe.data.schema import PROMPT_MESSAGES_KEY, PROMPTS, SCORES
from tests.e2e.conftest import restores, run, warm_server
from tests.e2e.test_pipeline import STAGES, ran_stages
from tests.newcomer import SMALL_SETTINGS, SYSTEM_PROMPT, conversational_inputs

pytestmark = pytest.mark.slow
REWARDS = ["trlrewards.rewards:reversed_word", "trlrewards.rewards:brevity"]


def init(root, inputs, train) -> str:
    sets = [arg for key, value in SMALL_SETTINGS.items() for arg in ("--set", f"{key}={value}")]
    rewards = [arg for name in REWARDS for arg in ("--reward", name)]
    return run(["rlpipe", "init", str(root), "--model", str(inputs["model"]), "--train", str(train), "--eval",
                str(inputs["eval"]), *rewards, *sets], inputs["rewards"]).stdout


def test_conversational_dataset_init_repro_inspect(tmp_path):
    pytest.importorskip("datasets")
    inputs = conversational_inputs(tmp_path / "mine")
    root = tmp_path / "project"
    out = init(root, inputs, inputs["hf_train"])
    assert "prompts: conversational format" in out and "FILL_IN" not in (root / "params.yaml").read_text()
    assert (root / "trlrewards" / "rewards.py").is_file()  # the user's package, copied into the project

    with warm_server("stage", root, ["--warm", str(root / "models/base")]):  # each stage forks: no torch import
        assert ran_stages(run(["dvc", "repro"], root).stdout) == STAGES
    prompts = read_artifact(root / "artifacts/prepare/train_prompts.parquet", PROMPTS)
    assert prompts.metadata[PROMPT_MESSAGES_KEY] == "prompt"
    first = json.loads(prompts.frame["metadata"][0])["prompt"]
    assert first[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert prompts.frame["prompt"][0] == f"<|system|>{SYSTEM_PROMPT}\n<|user|>{first[1]['content']}\n<|assistant|>"
    scores = read_artifact(root / "artifacts/score/scores.parquet", SCORES).frame
    assert scores["score_error"].null_count() == scores.height  # every row scored: no reward raised
    assert set(scores["reward_reversed_word"].unique().to_list()) <= {0.0, 1.0}
    assert scores["reward_brevity"].max() <= 0.0
    evaluated = read_json(root / "metrics/evaluate.json")
    assert evaluated["num_prompts"] == 8 and evaluated["scorer_errors"] == 0  # the eval file through the same rewards

    shown = run(["rlpipe", "inspect", ".", "--show", "1"], root).stdout
    assert SYSTEM_PROMPT in shown and "reverse: " in shown

    held_out = read_artifact(root / "artifacts/prepare/eval_prompts.parquet", PROMPTS)  # from the Parquet file
    assert held_out.metadata[PROMPT_MESSAGES_KEY] == "prompt"
    assert held_out.frame["prompt"][0].startswith(f"<|system|>{SYSTEM_PROMPT}\n<|user|>reverse: ")

    # the file's own column, typed and one join away from the rollouts: inspect filters on it
    word = prompts.frame["word"][0]
    picked = json.loads(run(["rlpipe", "inspect", ".", "--where", f"word = '{word}'", "--show", "2", "--json"],
                            root).stdout)
    assert picked["rows"] and all(r["prompt_columns"]["word"] == word for r in picked["rows"])

    params = root / "params.yaml"  # brevity's keyword-only option, written out by init
    assert params.read_text().count("target: 4") == 1
    params.write_text(params.read_text().replace("target: 4", "target: 5"))
    with warm_server("stage", root, ["--warm", str(root / "models/base")]):
        assert ran_stages(run(["dvc", "repro"], root).stdout) == ["score", "advantage", "train", "evaluate"]

    run(["dvc", "remote", "add", "-d", "store", str(tmp_path / "remote")], root)
    run(["rlpipe", "iterate"], root)  # commits, tags iteration-0 and pushes it (iterate.push: auto)
    assert restores(tmp_path / "clone", root, "iteration-0")
    assert "target: 5" in (tmp_path / "clone" / "params.yaml").read_text()
