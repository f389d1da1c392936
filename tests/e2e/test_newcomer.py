"""A newcomer's first hour, end to end: their own tokenizer, model, JSONL prompts and reward module.

`rlpipe init` -> `dvc repro` (refused, naming the option still to fill in; then a full iteration)
-> a reward option changed re-runs only `score` and what follows -> `rlpipe iterate` commits what
defined the iteration -> iteration 0 restores in a second clone from a DVC remote, `dvc status` clean.
"""
from __future__ import annotations

import json

import polars as pl
import pytest

from rlpipe.data.io import read_artifact, read_json
from rlpipe.data.schema import PROMPTS, SCORES
from tests.e2e.conftest import restores, run
from tests.e2e.test_pipeline import STAGES, ran_stages
from tests.newcomer import SMALL_SETTINGS, newcomer_inputs

pytestmark = pytest.mark.slow


def test_newcomer_init_repro_iterate_restore(tmp_path):
    inputs = newcomer_inputs(tmp_path / "mine")
    root = tmp_path / "project"
    settings = {**SMALL_SETTINGS, "evaluate.metrics_by": "[difficulty]"}  # the files' own column (tests/newcomer.py)
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    out = run(["rlpipe", "init", str(root), "--model", str(inputs["model"]), "--train", str(inputs["train"]),
               "--eval", str(inputs["eval"]), "--reward", "myrewards:reverse_reward", *sets], inputs["rewards"]).stdout
    assert "myrewards:reverse_reward: scale" in out  # the option without a default, to fill in
    assert "(under 100M parameters): kept rlpipe's defaults" in out  # a 1-layer toy: init says what it chose
    assert (root / "myrewards.py").is_file() and run(["git", "status", "--porcelain"], root).stdout == ""

    refused = run(["dvc", "repro"], root, check=False)
    assert refused.returncode != 0
    assert "score.rewards[0] (myrewards:reverse_reward).options.scale" in refused.stdout + refused.stderr
    params = root / "params.yaml"
    params.write_text(params.read_text().replace("scale: FILL_IN", "scale: 1.0"))

    first = run(["dvc", "repro"], root)
    assert ran_stages(first.stdout) == STAGES
    assert "generate.prompts_per_iteration is 32 but" in first.stderr and "holds 24 prompts" in first.stderr
    assert "next: `rlpipe inspect . --show 4`" in first.stderr  # the evaluate stage's hint
    prompts = read_artifact(root / "artifacts/prepare/train_prompts.parquet", PROMPTS).frame
    meta = json.loads(prompts["metadata"][0])
    assert meta["prompt"] == f"reverse: {meta['word']}"  # the file's raw prompt and every column
    assert prompts["prompt"][0].startswith("<|user|>reverse: ")  # the tokenizer's chat template applied
    assert "reward_reverse_reward" in read_artifact(root / "artifacts/score/scores.parquet", SCORES).frame.columns
    # the file's own columns, typed, one join from the rollouts: inspect filters on them; evaluate reports by them
    assert prompts.schema["difficulty"] == pl.String and prompts.schema["word"] == pl.String
    hard = json.loads(run(["rlpipe", "inspect", ".", "--where", "difficulty = 'hard'", "--show", "2", "--json"],
                          root).stdout)
    assert hard["rows"] and all(r["prompt_columns"]["difficulty"] == "hard" for r in hard["rows"])
    assert all(len(r["prompt_columns"]["word"]) == 4 for r in hard["rows"])
    by = read_json(root / "metrics/evaluate.json")["by"]["difficulty"]
    assert set(by) <= {"easy", "hard"} and sum(v["num_prompts"] for v in by.values()) == 8
    assert set(read_json(root / "metrics/headline/baseline.json")["accuracy_by"]["difficulty"]) == set(by)

    params.write_text(params.read_text().replace("partial_credit: 0.0", "partial_credit: 0.5"))
    again = run(["dvc", "repro"], root)
    assert ran_stages(again.stdout) == ["score", "advantage", "train", "evaluate"]

    run(["dvc", "remote", "add", "-d", "store", str(tmp_path / "remote")], root)
    iterated = run(["rlpipe", "iterate"], root)
    assert "next: `dvc repro`" in iterated.stdout
    history = [json.loads(line) for line in (root / "history/iterations.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [-1, 0] and history[0]["baseline"]  # the starting model first
    assert {f"eval_accuracy_by.difficulty.{v}" for v in by} <= set(history[0]) & set(history[1])
    assert run(["git", "status", "--porcelain"], root).stdout == ""  # nothing that defined it left out
    committed = run(["git", "show", "--name-only", "--format=", "iteration-0"], root).stdout.split()
    assert {"dvc.lock", "params.yaml", ".dvc/config", "artifacts/score/.gitignore",
            "dvclive/iterations/metrics.json"} <= set(committed)  # iterate.trackers: [dvclive]
    # no `dvc push` by hand: iterate pushed the recorded iteration to the default remote (iterate.push: auto)
    assert restores(tmp_path / "clone", root, "iteration-0")
    assert "partial_credit: 0.5" in (tmp_path / "clone" / "params.yaml").read_text()

    # a plain `dvc repro` of iteration 1, then `rlpipe run -n 1`: iteration 1 is recorded, one *new* one trained
    run(["dvc", "repro"], root)
    ran = run(["rlpipe", "run", "-n", "1", "--no-servers"], root)
    assert "already reproduced" in ran.stdout
    assert run(["git", "tag", "--list", "iteration-*"], root).stdout.split() == [f"iteration-{k}" for k in range(3)]
    for k in range(3):  # every tag restores in a fresh clone, each pushed as it was recorded
        assert restores(tmp_path / f"clone-{k}", root, f"iteration-{k}")
