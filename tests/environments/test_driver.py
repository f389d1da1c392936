"""The multi-turn driver over a scripted engine: turns, seeds, limits, failures, concurrency, determinism, resume."""
from __future__ import annotations

import random
import threading
import time

import polars as pl
import pytest

from rlpipe.engines.base import derive_seed
from rlpipe.environments import Environment, Step, ToolCall
from rlpipe.environments.calculator import CalculatorEnvironment
from rlpipe.environments.driver import turn_seed
from rlpipe.errors import ConfigError, InfrastructureError
from tests.environments.conftest import ScriptedEngine, encode, make_driver, prompts_frame

PROMPTS = ["31415+92653=", "2+2="]
SEEDS = [101, 202]


def always_calls(prompt_ids, seed):
    return "<call>add(1,2)</call>"


def run(driver, n_prompts: int = 2) -> pl.DataFrame:
    return driver.run(prompts_frame(driver.tokenizer, PROMPTS[:n_prompts] if n_prompts <= 2 else
                                    [f"{i}+{i}=" for i in range(n_prompts)]), [*SEEDS, *range(303, 303 + n_prompts)])


def test_a_model_that_never_stops_calling_tools_ends_at_max_turns(tokenizer):
    engine = ScriptedEngine(tokenizer, always_calls)
    out = run(make_driver(engine, tokenizer, CalculatorEnvironment, max_turns=3, group_size=1))
    call, obs = encode(tokenizer, "<call>add(1,2)</call>"), encode(tokenizer, "<tool>3<ai>", eos=False)
    row = out.row(0, named=True)
    assert row["finish_reason"] == "max_turns" and row["num_turns"] == 3 and not row["truncated"]
    # turn, observation, turn, observation, turn: the last tool result is not appended (nothing would follow it)
    assert row["completion_token_ids"] == call + obs + call + obs + call
    assert row["policy_mask"] == [True] * len(call) + [False] * len(obs) + [True] * len(call) + [False] * len(obs) \
        + [True] * len(call)
    assert [x == 0.0 for x in row["sampler_logprobs"]] == [not m for m in row["policy_mask"]]
    assert row["turn_starts"] == [0, len(call) + len(obs), 2 * (len(call) + len(obs))]
    assert row["turn_texts"] == ["add(1,2)"] * 3 and row["turn_rewards"] == [None] * 3
    assert [(c["turn"], c["status"], c["result"]) for c in row["tool_calls"]] == [(0, "ok", "3"), (1, "ok", "3"),
                                                                                (2, "ok", "3")]


def test_turn_zero_is_a_group_request_and_later_turns_continue_the_prefix_with_their_own_seed(tokenizer):
    engine = ScriptedEngine(tokenizer, always_calls)
    out = run(make_driver(engine, tokenizer, CalculatorEnvironment, max_turns=3, group_size=2, prompts_per_chunk=2))
    first, second, third = engine.calls
    assert [(r.seed, r.n) for r in first[0]] == [(SEEDS[0], 2), (SEEDS[1], 2)]  # as single-turn generation asks
    rows = {(r["prompt_id"], r["sample_idx"]): r for r in out.iter_rows(named=True)}
    for turn, (requests, _) in ((1, second), (2, third)):
        for request, key in zip(requests, [(0, 0), (0, 1), (1, 0), (1, 1)]):
            row = rows[key]
            assert row["sample_seed"] == derive_seed(SEEDS[key[0]], key[1])
            assert request.n == 1 and request.seed == turn_seed(row["sample_seed"], turn)
            # the prompt is the whole prefix the sampler saw: prompt + every earlier turn and observation
            assert list(request.prompt_token_ids) == row["prompt_token_ids"] + \
                row["completion_token_ids"][:row["turn_starts"][turn]]


def test_token_budget_cuts_a_turn_and_refuses_an_observation_that_does_not_fit(tokenizer):
    long_answer = ScriptedEngine(tokenizer, lambda p, s: "1234567890" * 3)
    out = run(make_driver(long_answer, tokenizer, CalculatorEnvironment, max_total_tokens=12, group_size=1))
    assert long_answer.calls[0][1].max_new_tokens == 12  # min(per-turn 24, the rollout's 12 left)
    assert out["completion_token_ids"].to_list()[0] == encode(tokenizer, "1234567890" * 3)[:12]
    assert out["finish_reason"].to_list() == ["max_tokens"] * 2 and out["truncated"].all()
    # the call (10 tokens) fits in 14; its observation (<tool>3<ai>, 3 tokens) would leave no room for a token
    calls = ScriptedEngine(tokenizer, always_calls)
    out = run(make_driver(calls, tokenizer, CalculatorEnvironment, max_total_tokens=13, group_size=1))
    assert out["completion_token_ids"].to_list()[0] == encode(tokenizer, "<call>add(1,2)</call>")
    assert out["finish_reason"].to_list() == ["max_tokens"] * 2 and out["tool_calls"].list.len().to_list() == [1, 1]


class Raises(Environment):
    def step(self, turn):
        raise RuntimeError("the environment's bug")


class Hangs(Environment):
    def step(self, turn):
        time.sleep(30)


class GivesUp(Environment):
    def step(self, turn):
        return Step(done=True, error="the tool service refused the call",
                    tool_calls=(ToolCall("search", "{}", "error", "error: refused"),))


class BrokenSandbox(Environment):
    def step(self, turn):
        raise InfrastructureError("sandbox unavailable")


class NotAStep(Environment):
    def step(self, turn):
        return "done"


@pytest.mark.parametrize("env_cls, reason, error", [
    (Raises, "infra_error", "RuntimeError: the environment's bug"),
    (BrokenSandbox, "infra_error", "InfrastructureError: sandbox unavailable"),
    (Hangs, "infra_error", "TimeoutError: the environment step ran past generate.environment.step_timeout_s=0.3"),
    (NotAStep, "infra_error", "TypeError: NotAStep.step returned str, not a Step"),
    (GivesUp, "tool_error", "the tool service refused the call"),
])
def test_environment_failures_end_the_rollout_with_who_is_at_fault(tokenizer, env_cls, reason, error):
    started = time.monotonic()
    out = run(make_driver(ScriptedEngine(tokenizer, always_calls), tokenizer, env_cls, step_timeout_s=0.3))
    assert time.monotonic() - started < 10
    assert out["finish_reason"].to_list() == [reason] * 4
    assert out["environment_error"].to_list() == [error] * 4
    assert out["num_turns"].to_list() == [1] * 4  # the model's turn is kept, nothing appended after it


def test_an_environment_that_cannot_be_created_fails_the_stage_before_any_step(tokenizer):
    class NeedsMetadata(Environment):
        def __init__(self, task):
            super().__init__(task)
            self.tests = task.metadata["tests"]

    engine = ScriptedEngine(tokenizer, always_calls)
    with pytest.raises(ConfigError, match=r"generate.environment: test could not be created \(prompt_id 0\): "
                                          "KeyError: 'tests'"):
        run(make_driver(engine, tokenizer, NeedsMetadata))
    assert engine.calls == []


class WaitsForOtherChunk(Environment):
    """Chunk 0's tool returns only once the engine has generated for chunk 1: proves generation went on."""

    other_generated = threading.Event()

    def step(self, turn):
        if self.task.prompt_id == 0:
            assert self.other_generated.wait(timeout=2.0)
        return Step(done=True)


def test_generation_continues_for_other_chunks_while_one_waits_on_its_tool(tokenizer):
    class Engine(ScriptedEngine):
        def generate(self, requests, params, *, progress=None):
            if any(r.seed == SEEDS[1] for r in requests):  # the turn-0 request of prompt 1 (chunk 1)
                WaitsForOtherChunk.other_generated.set()
            return super().generate(requests, params)

    for in_flight, expected in ((2, "done"), (1, "infra_error")):  # one chunk at a time: the tool waits in vain
        WaitsForOtherChunk.other_generated.clear()
        driver = make_driver(Engine(tokenizer, always_calls), tokenizer, WaitsForOtherChunk, group_size=1,
                             prompts_per_chunk=1, chunks_in_flight=in_flight, step_timeout_s=1.0)
        out = run(driver)
        assert out.filter(pl.col("prompt_id") == 0)["finish_reason"].to_list() == [expected], in_flight


class SlowRandomTools(CalculatorEnvironment):
    """The calculator, with tool calls taking a random (truly random: timing must not matter) time."""

    def step(self, turn):
        time.sleep(random.random() * 0.01)
        return super().step(turn)


def random_policy(prompt_ids, seed):
    rng = random.Random(seed)
    return rng.choice(["<call>add(4,5)</call>", "9", "<call>add(4,", "<call>dad(1)</call>", "<call>add(1,1)</call>"])


def test_results_depend_on_seeds_and_tool_outputs_never_on_timing_or_scheduling(tokenizer):
    frames = []
    for workers, in_flight in ((1, 1), (8, 3), (3, 2)):
        driver = make_driver(ScriptedEngine(tokenizer, random_policy), tokenizer, SlowRandomTools, group_size=4,
                             workers=workers, chunks_in_flight=in_flight, prompts_per_chunk=1, max_turns=3)
        frames.append(run(driver, n_prompts=5))
    assert frames[0].equals(frames[1]) and frames[0].equals(frames[2])
    reasons = set(frames[0]["finish_reason"].to_list())
    statuses = set(frames[0]["tool_calls"].explode().struct.field("status").drop_nulls().to_list())
    assert {"done", "max_turns"} <= reasons and {"ok", "parse_error", "unknown_tool"} <= statuses


def test_finished_chunks_are_kept_and_a_rerun_resumes_from_them(tokenizer, tmp_path):
    def driver(engine):
        return make_driver(engine, tokenizer, CalculatorEnvironment, group_size=2, prompts_per_chunk=1,
                           resume_dir=tmp_path / "keep")

    full = run(driver(ScriptedEngine(tokenizer, random_policy)), n_prompts=3)
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["chunk-00000.parquet", "chunk-00001.parquet",
                                                                     "chunk-00002.parquet"]

    class Refuses(ScriptedEngine):
        def generate(self, requests, params, *, progress=None):
            raise AssertionError("every chunk was kept: nothing to generate")

    resumed = driver(Refuses(tokenizer, random_policy))
    assert run(resumed, n_prompts=3).equals(full) and resumed.resumed_chunks == 3
    (tmp_path / "keep/chunk-00001.parquet").unlink()  # as if killed before chunk 1 was written
    engine = ScriptedEngine(tokenizer, random_policy)
    partial = driver(engine)
    assert run(partial, n_prompts=3).equals(full) and partial.resumed_chunks == 2
    assert {r.seed for r in engine.calls[0][0]} == {SEEDS[1]}  # only chunk 1 (prompt 1) was generated again


def test_progress_counts_every_finished_sample(tokenizer):
    counted = []
    driver = make_driver(ScriptedEngine(tokenizer, random_policy), tokenizer, CalculatorEnvironment, group_size=3)
    driver.progress = counted.append
    assert run(driver).height == sum(counted) == 6
