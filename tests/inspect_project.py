"""A hand-made iteration (6 rollouts, 3 groups of 2) for the inspect/diff tests: every statistic is known.

    group  prompt  answer  sample 0                     sample 1
    0      1+1=    2       "2" reward 1.5 correct       "2" reward 1.5 correct      (zero variance, filtered)
    1      2+3=    5       "5" reward 1.5 correct       "4" reward 0.0 wrong
    2      4+4=    8       "88" truncated, ValueError   "8" reward 1.5 correct

Every completion has 2 tokens. Log-probs: old = sampler except one token 0.1 lower (row (1, 1));
ref = sampler - 0.5; new = old + 0.05; entropy 1.0.
"""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import yaml

from rlpipe.data.io import write_artifact, write_json
from rlpipe.data.schema import (ADVANTAGES, EVAL_ROLLOUTS, PROMPTS, REF_LOGPROBS, ROLLOUTS, SCORES, TRAIN_TOKEN_STATS)
from rlpipe.stages.generate import single_turn_columns

EOS = 2
CHAR_IDS = {c: i for i, c in enumerate(sorted("0123456789+="), start=4)}  # the tiny char tokenizer's ids
PATHS = {
    "model_dir": "model", "train_prompts": "a/train_prompts.parquet", "eval_prompts": "a/eval_prompts.parquet",
    "rollouts": "a/rollouts.parquet", "scores": "a/scores.parquet", "ref_logprobs": "a/ref_logprobs.parquet",
    "advantages": "a/advantages.parquet", "checkpoint": "ckpt", "token_stats": "a/token_stats.parquet",
    "eval_rollouts": "a/eval_rollouts.parquet", "metrics_dir": "metrics", "plots_dir": "plots",
    "history": "history/iterations.jsonl",
}
KEYS = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
TEXTS = ["2", "2", "5", "4", "88", "8"]
REWARDS = [1.5, 1.5, 1.5, 0.0, 0.0, 1.5]
CORRECT = [True, True, True, False, None, True]
SAMPLER = [[-0.1, -0.2], [-0.3, -0.2], [-0.5, -0.1], [-1.0, -0.4], [-0.7, -2.0], [-0.2, -0.3]]
ADVANTAGE = [0.0, 0.0, 0.7071, -0.7071, -0.7071, 0.7071]
EVAL_PROMPTS = ["1+2=", "2+2=", "3+3=", "5+5="]
EVAL_ANSWERS = ["3", "4", "6", "10"]


def ids(text: str, *, eos: bool) -> list[int]:
    return [CHAR_IDS[c] for c in text] + ([EOS] if eos else [])


def _prompts(texts: list[str], answers: list[str], columns: dict[str, list] | None = None) -> pl.DataFrame:
    """A prompt table; ``columns``: the user's own (schema.PROMPTS' user columns), as a prompt file gives them."""
    return pl.DataFrame({"prompt_id": list(range(len(texts))), "prompt": texts,
                         "prompt_token_ids": [[1, *ids(t, eos=False)] for t in texts], "answer": answers,
                         "metadata": ["{}"] * len(texts), **(columns or {})})


def eval_frame(correct: list[bool], version: int) -> pl.DataFrame:
    texts = [a if ok else "0" for a, ok in zip(EVAL_ANSWERS, correct)]
    return pl.DataFrame({
        "prompt_id": list(range(4)), "sample_idx": [0] * 4, "policy_version": [version] * 4,
        "completion_token_ids": [ids(t, eos=True) for t in texts], "completion_text": texts,
        "completion_length": [len(t) + 1 for t in texts], "truncated": [False] * 4,
        "finish_reason": ["stop"] * 4, "policy_mask": [[True] * (len(t) + 1) for t in texts], "num_turns": [1] * 4,
        "num_tool_calls": [0] * 4, "reward": [1.5 if ok else 0.0 for ok in correct], "correct": correct})


def make_project(root: Path, *, eval_correct: list[bool] = (True, False, False, True), version: int = 0,
                 with_tokenizer: bool = True, prompt_columns: tuple[dict, dict] = ({}, {})) -> Path:
    """Write params.yaml, every artifact of one iteration, metrics and (optionally) a tokenizer under ``root``;
    ``prompt_columns``: (train, eval) user columns of the prompt tables."""
    a = lambda key: root / PATHS[key]  # noqa: E731
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump({"iteration": version, "policy": {"path": "model"},
                                                      "advantage": {"estimator": "grpo"}, "paths": PATHS}))
    pid = [k[0] for k in KEYS]
    sidx = [k[1] for k in KEYS]
    tokens = [ids(t, eos=len(t) == 1) for t in TEXTS]
    meta = {"policy_version": version}
    write_artifact(_prompts(["1+1=", "2+3=", "4+4="], ["2", "5", "8"], prompt_columns[0]), a("train_prompts"),
                   PROMPTS)
    write_artifact(_prompts(EVAL_PROMPTS, EVAL_ANSWERS, prompt_columns[1]), a("eval_prompts"), PROMPTS)
    write_artifact(single_turn_columns(pl.DataFrame({
        "prompt_id": pid, "sample_idx": sidx, "policy_version": [version] * 6, "sample_seed": list(range(6)),
        "prompt_token_ids": [[1, *ids(p, eos=False)] for p in ["1+1="] * 2 + ["2+3="] * 2 + ["4+4="] * 2],
        "completion_token_ids": tokens, "completion_text": TEXTS, "completion_length": [2] * 6,
        "sampler_logprobs": SAMPLER, "finish_reason": ["length" if len(t) == 2 else "stop" for t in TEXTS],
        "truncated": [len(t) == 2 for t in TEXTS]})), a("rollouts"), ROLLOUTS, metadata=meta)
    write_artifact(pl.DataFrame({
        "prompt_id": pid, "sample_idx": sidx, "reward": REWARDS, "correct": CORRECT,
        "score_error": [None, None, None, None, "ValueError: boom", None],
        "reward_exact_answer": [1.0, 1.0, 1.0, 0.0, None, 1.0]}, schema_overrides={"score_error": pl.String}),
        a("scores"), SCORES, metadata=meta)
    write_artifact(pl.DataFrame({"prompt_id": pid, "sample_idx": sidx, "reference_version": [0] * 6,
                                 "ref_logprobs": [[x - 0.5 for x in row] for row in SAMPLER]}),
                   a("ref_logprobs"), REF_LOGPROBS, metadata=meta)
    write_artifact(pl.DataFrame({
        "prompt_id": pid, "sample_idx": sidx, "advantage": ADVANTAGE, "token_advantages": [[x, x] for x in ADVANTAGE],
        "returns": [None] * 6, "group_size": [2] * 6, "group_reward_mean": [1.5, 1.5, 0.75, 0.75, 0.75, 0.75],
        "group_reward_std": [0.0, 0.0, 1.06, 1.06, 1.06, 1.06],
        "filtered_reason": ["zero_variance_group"] * 2 + [None] * 4},
        schema_overrides={"returns": pl.List(pl.Float32), "filtered_reason": pl.String}),
        a("advantages"), ADVANTAGES, metadata=meta)
    old = [list(row) for row in SAMPLER]
    old[3][0] -= 0.1
    write_artifact(pl.DataFrame({"prompt_id": pid, "sample_idx": sidx, "old_logprobs": old,
                                 "entropy": [[1.0, 1.0]] * 6, "new_logprobs": [[x + 0.05 for x in r] for r in old]}),
                   a("token_stats"), TRAIN_TOKEN_STATS, metadata=meta)
    write_artifact(eval_frame(list(eval_correct), version + 1), a("eval_rollouts"), EVAL_ROLLOUTS,
                   metadata={"policy_version": version + 1})
    accuracy = sum(eval_correct) / len(eval_correct)
    for stage, m in {"evaluate": {"accuracy": accuracy, "reward_mean": 1.5 * accuracy, "length_mean": 2.0,
                                  "policy_version": version + 1},
                     "score": {"reward_mean": 1.0, "accuracy": 0.8}, "generate": {"length_mean": 2.0},
                     "train": {"kl_ref": 0.01 * (version + 1), "clip_fraction": 0.1}}.items():
        write_json(root / "metrics" / f"{stage}.json", {"stage": stage, **m, "seconds": {"total": 1.0 + version}})
    if with_tokenizer:
        from rlpipe.tiny.tokenizer import build_char_tokenizer

        build_char_tokenizer("0123456789+=").save_pretrained(str(root / "model"))
        assert json.loads((root / "model" / "tokenizer.json").read_text())["model"]["vocab"]["2"] == CHAR_IDS["2"]
    return root
