"""Progress callbacks of the engines: they count every unit once and never change a result."""
import torch

from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
from rlpipe.engines.hf import HFEngine
from rlpipe.engines.logprobs import batched_completion_logprobs

EOS_ID, PAD_ID = 2, 0  # the tiny Llama of conftest.py


def counter():
    calls: list[int] = []
    return calls, calls.append


def test_generate_reports_every_sample_per_batch(tiny_model):
    engine = HFEngine.from_model(tiny_model, batch_size=4, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    requests = [PromptRequest(prompt_token_ids=(5, 6, 7 + i), seed=derive_seed(9, i), n=3) for i in range(3)]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4)
    calls, hook = counter()
    with_bar = engine.generate(requests, params, progress=hook)
    assert calls == [4, 4, 1]  # 9 samples in batches of 4
    without = engine.generate(requests, params)
    assert [[c.token_ids for c in g] for g in with_bar] == [[c.token_ids for c in g] for g in without]


def test_logprobs_report_every_sequence_per_batch(tiny_model):
    prompts = [[5, 6], [7, 8, 9], [10]]
    completions = [[11, 12], [13], [14, 15, 16]]
    calls, hook = counter()
    kwargs = dict(pad_token_id=PAD_ID, temperature=1.0, max_tokens_per_batch=8, chunk_size=2, with_entropy=False)
    got, _ = batched_completion_logprobs(tiny_model, prompts, completions, progress=hook, **kwargs)
    assert sum(calls) == 3 and len(calls) >= 2
    plain, _ = batched_completion_logprobs(tiny_model, prompts, completions, **kwargs)
    for a, b in zip(got, plain):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
