"""The code task through real stage processes: prepare reads its prompt file (source: files), score runs
`code_tests` on a correct and a wrong completion of each of the 30 problems (docs/reliability.md)."""
from __future__ import annotations

import json
import string
import sys

import polars as pl
import pytest

from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import PROMPTS, ROLLOUTS, SCORES
from rlpipe.stages.generate import single_turn_columns
from rlpipe.tiny.tokenizer import build_char_tokenizer
from tests.code_task import PROBLEMS, completion, write_prompt_file
from tests.e2e.conftest import make_project, run

pytestmark = pytest.mark.slow

CODE_TESTS = {"name": "code_tests", "weight": 1.0, "options": {
    "tests_key": "tests", "timeout_s": 5.0, "cpu_time_s": 5, "memory_mb": 512, "max_processes": 32,
    "max_open_files": 64, "max_file_mb": 16, "work_dir_mb": 64, "max_output_bytes": 1_000_000,
    "partial_credit": False, "float_tolerance": 1e-6, "allow_forgeable_tests": False, "required_protections": []}}


def rollouts(prompts: pl.DataFrame) -> pl.DataFrame:
    """Two samples per prompt as a policy would have written them: 0 correct, 1 wrong."""
    rows = []
    for prompt_id, ids in zip(prompts["prompt_id"], prompts["prompt_token_ids"]):
        for sample_idx, which in enumerate(("correct", "wrong")):
            text = completion(PROBLEMS[prompt_id], which)
            rows.append({"prompt_id": prompt_id, "sample_idx": sample_idx, "policy_version": 0,
                         "sample_seed": 2 * prompt_id + sample_idx, "prompt_token_ids": list(ids),
                         "completion_token_ids": [5] * len(text), "completion_text": text,
                         "completion_length": len(text), "sampler_logprobs": [-1.0] * len(text),
                         "finish_reason": "stop", "truncated": False})
    return single_turn_columns(pl.DataFrame(rows))


def test_the_code_task_through_prepare_and_score(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "data").mkdir()
    write_prompt_file(project / "data/train.jsonl")
    write_prompt_file(project / "data/eval.jsonl")
    build_char_tokenizer(string.printable).save_pretrained(str(project / "tokenizer"))
    make_project(project, {
        "prepare.source": "files", "prepare.max_prompt_tokens": 512,
        "prepare.files.train": "data/train.jsonl", "prepare.files.eval": "data/eval.jsonl",
        "prepare.files.tokenizer_path": "tokenizer", "prepare.files.answer_column": None,
        "score.rewards": [CODE_TESTS], "score.accuracy_reward": "code_tests", "score.workers": 2,
        "score.max_error_fraction": 0.0})
    run([sys.executable, "stages/prepare.py", "--params", "params.yaml", "--model-dir", "out/model",
         "--train-prompts", "out/train_prompts.parquet", "--eval-prompts", "out/eval_prompts.parquet",
         "--preferences", "out/preferences.parquet", "--metrics", "out/prepare.json"], project)
    prompts = read_artifact(project / "out/train_prompts.parquet", PROMPTS).frame
    assert [json.loads(m)["tests"] for m in prompts["metadata"]] == [p["tests"] for p in PROBLEMS]
    write_artifact(rollouts(prompts), project / "out/rollouts.parquet", ROLLOUTS, metadata={"policy_version": 0})
    score = [sys.executable, "stages/score.py", "--params", "params.yaml", "--rollouts", "out/rollouts.parquet",
             "--prompts", "out/train_prompts.parquet", "--out", "out/scores.parquet", "--metrics", "out/score.json"]
    run(score, project)
    scores = read_artifact(project / "out/scores.parquet", SCORES).frame.sort("prompt_id", "sample_idx")
    assert scores["reward"].to_list() == [1.0, 0.0] * len(PROBLEMS)
    assert scores["correct"].to_list() == [True, False] * len(PROBLEMS)
    assert scores["score_error"].null_count() == scores.height
    metrics = json.loads((project / "out/score.json").read_text())
    assert metrics["details"] == {"code_tests": {"pass": 30, "wrong_answer": 30}}
    assert metrics["errors"] == 0 and metrics["accuracy"] == 0.5
    sandbox = metrics["reward_info"]["code_tests"]["sandbox"]
    assert "kill_all" in sandbox["active"] and set(sandbox["active"]).isdisjoint(sandbox["missing"])
    first = (project / "out/scores.parquet").read_bytes()
    run(score, project)  # same inputs and params: the same bytes
    assert (project / "out/scores.parquet").read_bytes() == first
