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
from rlpipe.data.schema import (ADVANTAGES, EVAL_ROLLOUTS, PROMPTS, REF_LOGPROBS, ROLLOUTS, SCORES, TOOL_CALL,
                                TRAIN_TOKEN_STATS)
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
        "turn_starts": [[0]] * 4, "tool_calls": [[]] * 4, "num_tool_calls": [0] * 4,
        "reward": [1.5 if ok else 0.0 for ok in correct], "correct": correct},
        schema_overrides={"turn_starts": pl.List(pl.Int32), "tool_calls": pl.List(TOOL_CALL)})


def make_project(root: Path, *, eval_correct: list[bool] = (True, False, False, True), version: int = 0,
                 with_tokenizer: bool = True, reward_weight: float | None = None,
                 prompt_columns: tuple[dict, dict] = ({}, {})) -> Path:
    """Write params.yaml, every artifact of one iteration, metrics and (optionally) a tokenizer under ``root``.

    ``reward_weight``: params.yaml's weight of exact_answer (score.rewards); none by default. The rewards
    above are 1.5 x exact_answer, so 1.5 is the weight they were scored with. ``prompt_columns``: (train, eval)
    user columns of the prompt tables.
    """
    a = lambda key: root / PATHS[key]  # noqa: E731
    root.mkdir(parents=True, exist_ok=True)
    params = {"iteration": version, "policy": {"path": "model"}, "advantage": {"estimator": "grpo"}, "paths": PATHS}
    if reward_weight is not None:
        params["score"] = {"rewards": [{"name": "exact_answer", "weight": reward_weight}]}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
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


# A multi-turn iteration (calculator tool), one character per token and no tokenizer (tokens from the text):
#   model turn 1 "c(2+3)" calls the tool, the environment answers "=5;" (not the policy's), model turn 2 "5."
MT_TURN1, MT_REPLY, MT_TURN2 = "c(2+3)", "=5;", "5."
MT_CALL = {"turn": 0, "name": "calculator", "arguments": '{"expr": "2+3"}', "status": "ok", "result": "5"}
MT_BAD = {"turn": 0, "name": "calculator", "arguments": "2+", "status": "parse_error", "result": "bad JSON"}


def _multi_turn_row(turn1: str, reply: str, turn2: str, calls: list[dict], finish: str) -> dict:
    text = turn1 + reply + turn2
    mask = [True] * len(turn1) + [False] * len(reply) + [True] * len(turn2)
    return {"completion_token_ids": [100 + i for i in range(len(text))], "completion_text": text,
            "completion_length": len(text), "policy_mask": mask, "num_turns": 2 if reply else 1,
            "turn_starts": [0, len(turn1) + len(reply)] if reply else [0], "tool_calls": calls,
            "finish_reason": finish, "truncated": False,
            # the policy's tokens near certain (white on the sampler log-prob scale) but the first, an unlikely
            # one (full orange); the environment's tokens have 0.0, which also reads "certain"
            "sampler_logprobs": [(-3.0 if i == 0 else -0.001) if m else 0.0 for i, m in enumerate(mask)]}


def make_multi_turn_project(root: Path) -> Path:
    """Rollouts and eval rollouts of a tool-calling run (no tokenizer); only rollouts, scores and prompts."""
    def a(key: str) -> Path:
        return root / PATHS[key]

    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump({"iteration": 0, "policy": {"path": "model"}, "paths": PATHS}))
    write_artifact(_prompts(["2+3="], ["5"]), a("train_prompts"), PROMPTS)
    write_artifact(_prompts(["2+3=", "4+4="], ["5", "8"]), a("eval_prompts"), PROMPTS)
    rows = [_multi_turn_row(MT_TURN1, MT_REPLY, MT_TURN2, [MT_CALL], "done"),
            _multi_turn_row("5.", "", "", [], "done")]
    frame = pl.DataFrame(rows, schema_overrides={"tool_calls": pl.List(TOOL_CALL), "turn_starts": pl.List(pl.Int32)})
    write_artifact(frame.with_columns(
        prompt_id=pl.lit(0, pl.Int64), sample_idx=pl.Series([0, 1], dtype=pl.Int32), policy_version=pl.lit(0, pl.Int64),
        sample_seed=pl.Series([0, 1], dtype=pl.Int64), prompt_token_ids=pl.lit([1, 2], pl.List(pl.Int32)),
        turn_texts=pl.lit(None, pl.List(pl.String)), turn_rewards=pl.lit([None], pl.List(pl.Float64)),
        environment_error=pl.lit(None, pl.String), tokenizer_hash=pl.lit("", pl.String)),
        a("rollouts"), ROLLOUTS, metadata={"policy_version": 0})
    write_artifact(pl.DataFrame({"prompt_id": [0, 0], "sample_idx": [0, 1], "reward": [1.0, 1.0],
                                 "correct": [True, True], "score_error": [None, None]},
                                schema_overrides={"score_error": pl.String}), a("scores"), SCORES,
                   metadata={"policy_version": 0})
    evals = [_multi_turn_row(MT_TURN1, MT_REPLY, MT_TURN2, [MT_CALL], "done"),
             _multi_turn_row("c(2+", "?;", "7.", [MT_BAD], "max_turns")]
    frame = pl.DataFrame(evals, schema_overrides={"tool_calls": pl.List(TOOL_CALL), "turn_starts": pl.List(pl.Int32)})
    write_artifact(frame.drop("sampler_logprobs").with_columns(
        prompt_id=pl.Series([0, 1], dtype=pl.Int64), sample_idx=pl.lit(0, pl.Int32), policy_version=pl.lit(1, pl.Int64),
        num_tool_calls=pl.lit(1, pl.Int32), reward=pl.Series([1.0, 0.0]), correct=pl.Series([True, False])),
        a("eval_rollouts"), EVAL_ROLLOUTS, metadata={"policy_version": 1})
    for stage, m in {"evaluate": {"accuracy": 0.5, "reward_mean": 0.5, "length_mean": 11.0, "tool_use_rate": 1.0,
                                  "turns_mean": 2.0},
                     "generate": {"length_mean": 6.5, "tool_use_rate": 0.5, "turns_mean": 1.5}}.items():
        write_json(root / "metrics" / f"{stage}.json", {"stage": stage, **m, "seconds": {"total": 1.0}})
    return root
