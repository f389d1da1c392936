"""Shared pieces of the multi-turn tests: the calculator tokenizer, a scripted engine, a driver factory."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import polars as pl
import pytest

from rlpipe.config import EnvironmentConfig
from rlpipe.engines.base import Completion, PromptRequest, SamplingParams, derive_seed
from rlpipe.environments.driver import Driver
from rlpipe.environments.template import ChatRenderer
from rlpipe.tiny.tool_task import build_calculator_tokenizer, prompt_text

ENV = EnvironmentConfig(name="test", options={}, max_turns=4, max_total_tokens=64, tool_timeout_s=5.0,
                        step_timeout_s=10.0, workers=4, prompts_per_chunk=2, chunks_in_flight=2)
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24)


@pytest.fixture(scope="session")
def tokenizer():
    return build_calculator_tokenizer()


def encode(tokenizer, text: str, *, eos: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([tokenizer.eos_token_id] if eos else [])


class ScriptedEngine:
    """A GenerationEngine whose "model" is a Python function of (prompt ids, sample seed) -> text.

    It honours the protocol as the real engines do: sample j of a request draws from
    derive_seed(request.seed, j), the EOS ends a sample and is kept, max_new_tokens cuts. Log-probs
    are a function of (seed, position) only. Every call is recorded.
    """

    name = "scripted"

    def __init__(self, tokenizer, policy: Callable[[list[int], int], str]) -> None:
        self.tokenizer, self.policy = tokenizer, policy
        self.calls: list[tuple[list[PromptRequest], SamplingParams]] = []

    def generate(self, requests: Sequence[PromptRequest], params: SamplingParams, *, progress=None):
        self.calls.append((list(requests), params))
        out = []
        for r in requests:
            group = []
            for j in range(r.n):
                seed = derive_seed(r.seed, j)
                ids = encode(self.tokenizer, self.policy(list(r.prompt_token_ids), seed))[:params.max_new_tokens]
                rng = random.Random(seed)
                logprobs = [-rng.random() for _ in ids]
                stopped = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
                group.append(Completion(ids, logprobs, "stop" if stopped else "length"))
            out.append(group)
        return out


def prompts_frame(tokenizer, prompts: list[str], answers: list[str] | None = None) -> pl.DataFrame:
    return pl.DataFrame({
        "prompt_id": list(range(len(prompts))), "prompt": prompts,
        "prompt_token_ids": [encode(tokenizer, prompt_text(tokenizer, p), eos=False) for p in prompts],
        "answer": answers or [None] * len(prompts), "metadata": ["{}"] * len(prompts)},
        schema_overrides={"answer": pl.String})


def make_driver(engine, tokenizer, env_cls: type, *, group_size: int = 2, sampling: SamplingParams = SAMPLING,
                resume_dir=None, **env_overrides) -> Driver:
    env = dataclasses.replace(ENV, **env_overrides)
    eos = [tokenizer.eos_token_id]
    return Driver(engine, sampling=sampling, group_size=group_size, env=env, env_cls=env_cls, tokenizer=tokenizer,
                  renderer=ChatRenderer(tokenizer, eos_token_ids=eos, source="test"), eos_token_ids=eos,
                  tokenizer_hash="0123456789abcdef", resume_dir=resume_dir)
