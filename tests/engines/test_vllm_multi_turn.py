"""Multi-turn rollouts through VLLMEngine against the fake vLLM API: each later turn is one request of n = 1
whose prompt is the trajectory's whole prefix and whose seed is the turn's own (no vllm, no GPU)."""
from __future__ import annotations

import numpy as np

from rlpipe.engines import vllm as vllm_engine
from rlpipe.engines.base import SamplingParams, derive_seed
from rlpipe.engines.vllm import VLLMEngine
from rlpipe.environments.driver import turn_seed
from rlpipe.tiny.tool_task import build_calculator_tokenizer
from tests.engines.test_vllm_adapter import EOS, FakeLLM, fake_sample, fake_vllm  # noqa: F401 - fake_vllm: fixture
from tests.environments.conftest import make_driver, prompts_frame
from tests.environments.echo import Echo

PARAMS = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=8)
BUDGET = 60


def test_vllm_continues_each_sample_with_the_whole_prefix_and_its_turn_seed(fake_vllm):
    tokenizer = build_calculator_tokenizer()
    assert tokenizer.eos_token_id == EOS  # the fake samples ids 3..19 and stops on 2
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    driver = make_driver(engine, tokenizer, Echo, group_size=3, sampling=PARAMS, max_total_tokens=BUDGET,
                         prompts_per_chunk=2)
    seeds = [derive_seed(9, i) for i in range(2)]
    out = driver.run(prompts_frame(tokenizer, ["12+3=", "4+56="]), seeds)
    (_, first), *later = FakeLLM.instances[0].calls
    # turn 0: one request of n = G per prompt, as single-turn generation; later turns: n = 1 each
    assert [(sp.n, sp.seed) for sp in first] == [(3, vllm_engine.vllm_seed(s)) for s in seeds]
    sent = {(tuple(p["prompt_token_ids"]), sp.seed, sp.n) for prompts, sampling in later
            for p, sp in zip(prompts, sampling)}
    turns = 0
    for row in out.iter_rows(named=True):
        prompt, ids = row["prompt_token_ids"], row["completion_token_ids"]
        for t, start in enumerate(row["turn_starts"]):
            prefix = prompt + ids[:start]
            if t == 0:  # vLLM seeds child j of a request with its seed + j
                seed = vllm_engine.vllm_seed(seeds[row["prompt_id"]]) + row["sample_idx"]
            else:
                seed = vllm_engine.vllm_seed(turn_seed(row["sample_seed"], t))
                assert (tuple(prefix), seed, 1) in sent
                turns += 1
            tokens, logprobs = fake_sample(prefix, seed, PARAMS.max_new_tokens, {EOS})
            tokens, logprobs = tokens[:BUDGET - start], logprobs[:BUDGET - start]
            assert ids[start:start + len(tokens)] == tokens
            np.testing.assert_allclose(row["sampler_logprobs"][start:start + len(tokens)], logprobs, rtol=1e-6)
            assert all(row["policy_mask"][start:start + len(tokens)])
    assert turns >= 3  # later turns did happen
