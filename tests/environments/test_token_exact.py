"""Token exactness: the ids in the rollout table are the ids the sampler saw, and the trainer's log-probs of
them (read back from Parquet) reproduce the sampler's to float noise, on the policy's tokens."""
from __future__ import annotations

import numpy as np
import pytest

from rlpipe.data.io import read_artifact, write_artifact
from rlpipe.data.schema import ROLLOUTS
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.hf import HFEngine
from rlpipe.engines.logprobs import batched_completion_logprobs
from rlpipe.stages.generate import generate_multi_turn
from rlpipe.tiny.model import build_tiny_llama
from rlpipe.training.data import training_data
from tests.environments.conftest import make_driver, prompts_frame
from tests.environments.echo import Echo


class Recording:
    """A GenerationEngine proxy that keeps every request it forwards."""

    def __init__(self, engine):
        self.engine, self.name, self.requests = engine, engine.name, []

    def generate(self, requests, params, *, progress=None):
        self.requests += list(requests)
        return self.engine.generate(requests, params, progress=progress)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_llama(tokenizer, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                            max_position_embeddings=128, seed=3).eval()


def test_round_trip_through_the_table_reproduces_the_sampler_logprobs(tokenizer, model, tmp_path):
    engine = Recording(HFEngine.from_model(model, batch_size=64, eos_token_ids=[tokenizer.eos_token_id],
                                           pad_token_id=tokenizer.pad_token_id))
    sampling = SamplingParams(temperature=0.9, top_p=1.0, top_k=0, max_new_tokens=12)
    driver = make_driver(engine, tokenizer, Echo, group_size=8, sampling=sampling, max_total_tokens=90,
                         prompts_per_chunk=2)
    prompts = prompts_frame(tokenizer, ["12+34=", "5+6=", "789+1=", "2+2="])
    out = generate_multi_turn(driver, prompts, seed=7, iteration=0, policy_version=0)
    path = write_artifact(out, tmp_path / "rollouts.parquet", ROLLOUTS)
    table = read_artifact(path, ROLLOUTS).frame
    assert table.equals(out.select(table.columns))
    assert (table["num_turns"] >= 2).sum() >= 8 and (table["num_turns"] == 3).sum() >= 2

    # the sampler saw exactly these ids: every request's prompt is a prefix of a row, cut at a turn start
    prefixes = {tuple(r["prompt_token_ids"] + r["completion_token_ids"][:s])
                for r in table.iter_rows(named=True) for s in r["turn_starts"]}
    assert {tuple(req.prompt_token_ids) for req in engine.requests} <= prefixes

    # what train and reference_logprob compute, from what they read
    data = training_data(table.with_columns(token_advantages=table["sampler_logprobs"], ref_logprobs=table[
        "sampler_logprobs"], advantage=None, filtered_reason=None))
    logprobs, _ = batched_completion_logprobs(model, data.prompt_token_ids, data.completion_token_ids,
                                              pad_token_id=tokenizer.pad_token_id, temperature=0.9,
                                              max_tokens_per_batch=4096, chunk_size=64, with_entropy=False)
    policy = np.concatenate([m for m in data.policy_mask])
    trainer = np.concatenate(logprobs)
    sampler = np.concatenate(data.sampler_logprobs)
    assert policy.sum() > 200 and (~policy).sum() > 50
    assert np.abs(trainer[policy] - sampler[policy]).max() < 2e-5  # float noise (measured: 4.8e-7 on 505 tokens)
    assert np.all(sampler[~policy] == 0.0)  # observation tokens carry no sampler log-prob
