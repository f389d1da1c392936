"""Packed (unpadded, one row) log-probs against the padded path; token-budget batching; checkpointing."""
import copy

import numpy as np
import pytest
import torch

import rlpipe.engines.logprobs as lp
import rlpipe.engines.packed_attention as pa
from rlpipe.engines.logprobs import (
    batched_completion_logprobs,
    completion_logprobs,
    enable_gradient_checkpointing,
    make_packed_batch,
    make_token_batch,
    token_budget_batches,
)
from rlpipe.engines.packed_attention import PACKED_ATTENTION

VOCAB, PAD_ID = 32, 0  # the tiny Llama of conftest.py
TEMPERATURE = 0.7


def _random_pairs(seed: int, count: int, vocab: int = VOCAB) -> tuple[list[list[int]], list[list[int]]]:
    """Ragged prompts (1..9 tokens) and completions (0..13 tokens), some lengths repeated."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(count):
        n_prompt = int(torch.randint(1, 10, (1,), generator=gen))
        n_completion = int(torch.randint(0, 14, (1,), generator=gen))
        prompts.append(torch.randint(1, vocab, (n_prompt,), generator=gen).tolist())
        completions.append(torch.randint(1, vocab, (n_completion,), generator=gen).tolist())
    prompts += [[1, 2, 3], [4, 5, 6]]  # two sequences of equal length: one batched SDPA call on the CPU path
    completions += [[7, 8], [9, 10]]
    return prompts, completions


def _small_model(kind: str, dtype=torch.float32):
    """A random 3-layer decoder with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_cls(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=kind == "qwen2")
    torch.manual_seed(0)
    return model_cls(config).to(dtype).eval()


def _both(model, prompts, completions, **kwargs):
    padded = completion_logprobs(model, make_token_batch(prompts, completions, pad_token_id=PAD_ID), **kwargs)
    packed = completion_logprobs(model, make_packed_batch(prompts, completions), **kwargs)
    return padded, packed


def test_make_packed_batch_layout():
    batch = make_packed_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])
    assert batch.input_ids_1T.tolist() == [[5, 6, 7, 9, 10, 8, 11, 12, 13]]
    assert batch.position_ids_1T.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert batch.cu_seqlens.tolist() == [0, 5, 9] and batch.cu_seqlens.dtype == torch.int32
    assert batch.prompt_lengths == [3, 1] and batch.completion_lengths == [2, 3]
    assert batch.max_length == 5 and batch.max_completion_length == 3
    # completion token t of sequence b is predicted at row position start_b + prompt_b - 1 + t
    pred_N, row_N, col_N = lp._packed_targets(batch)
    assert pred_N.tolist() == [2, 3, 5, 6, 7]
    assert row_N.tolist() == [0, 0, 1, 1, 1] and col_N.tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        make_packed_batch([[1], []], [[2], [3]])


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_packed_equals_padded_on_tiny_model(tiny_model, chunk_size):
    prompts, completions = _random_pairs(seed=1, count=8)
    with torch.no_grad():
        (lp_pad, ent_pad), (lp_pack, ent_pack) = _both(tiny_model, prompts, completions, temperature=TEMPERATURE,
                                                       chunk_size=chunk_size, with_entropy=True)
    assert lp_pack.shape == lp_pad.shape == (10, max(len(c) for c in completions))
    assert lp_pack.dtype == ent_pack.dtype == torch.float32
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_pack, ent_pad, atol=1e-5, rtol=1e-5)
    for row, completion in enumerate(completions):
        assert not lp_pack[row, len(completion):].any() and not ent_pack[row, len(completion):].any()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_equals_padded_with_grouped_query_attention(kind):
    model = _small_model(kind)
    prompts, completions = _random_pairs(seed=2, count=6, vocab=48)
    with torch.no_grad():
        (lp_pad, ent_pad), (lp_pack, ent_pack) = _both(model, prompts, completions, temperature=1.0, chunk_size=5,
                                                       with_entropy=True)
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_pack, ent_pad, atol=1e-5, rtol=1e-5)


def test_packed_gradients_equal_padded():
    # float64, so that the comparison is not lost in float32 summation-order noise.
    model = _small_model("llama", dtype=torch.float64)
    prompts, completions = _random_pairs(seed=3, count=5, vocab=48)
    weights_BC = torch.randn(len(prompts), max(len(c) for c in completions), generator=torch.Generator().manual_seed(0))
    grads = []
    for batch in (make_token_batch(prompts, completions, pad_token_id=PAD_ID), make_packed_batch(prompts, completions)):
        logprobs_BC, entropy_BC = completion_logprobs(model, batch, temperature=TEMPERATURE, chunk_size=4,
                                                      with_entropy=True)
        loss = (weights_BC * logprobs_BC).sum() + 0.1 * entropy_BC.sum()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for padded, packed in zip(*grads):
        torch.testing.assert_close(packed, padded, atol=1e-7, rtol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads[1])


def test_packed_attention_gets_no_mask_and_is_switched_off_after(tiny_model, monkeypatch):
    seen, real = [], pa.packed_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs["cu_seq_lens_q"].tolist(), kwargs["max_length_q"]))
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(pa, "packed_attention", spy)
    before = tiny_model.config._attn_implementation
    with torch.no_grad():
        completion_logprobs(tiny_model, make_packed_batch([[1, 2], [3]], [[4], [5, 6, 7]]), temperature=1.0,
                            chunk_size=8, with_entropy=False)
    assert len(seen) == tiny_model.config.num_hidden_layers
    assert all(mask is None and cu == [0, 3, 7] and longest == 4 for mask, cu, longest in seen)  # no [T, T] mask
    assert tiny_model.config._attn_implementation == before != PACKED_ATTENTION


def test_packed_attention_refuses_what_it_cannot_do():
    q = k = v = torch.zeros(1, 2, 3, 4)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        pa.packed_attention(None, q, k, v, None)
    with pytest.raises(NotImplementedError, match="sliding"):
        pa.packed_attention(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=3, sliding_window=2)
    with pytest.raises(ValueError, match="one packed row"):
        pa.packed_attention(None, q.expand(2, -1, -1, -1), k, v, None, cu_seq_lens_q=cu, max_length_q=3)


def test_sdpa_per_sequence_matches_a_loop_over_sequences():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 3, 5, 3, 1]  # repeated lengths share one SDPA call
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    q_HTD = torch.randn(4, sum(lengths), 8, generator=gen, dtype=torch.float64)
    k_HTD, v_HTD = (torch.randn(2, sum(lengths), 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out_THD = pa._sdpa_per_sequence(q_HTD, k_HTD, v_HTD, cu, 0.3)
    for a, b in zip(cu[:-1], cu[1:]):
        k, v = (x[:, a:b].repeat_interleave(2, dim=0) for x in (k_HTD, v_HTD))  # GQA: 2 query heads per kv head
        scores = (q_HTD[:, a:b] @ k.transpose(-1, -2)) * 0.3
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(out_THD[a:b], (scores.softmax(-1) @ v).transpose(0, 1))


def test_token_budget_batches_by_hand():
    lengths = [3, 9, 4, 4, 12, 1]
    # longest first, ties by index: 12(#4) 9(#1) 4(#2) 4(#3) 3(#0) 1(#5)
    # packed, sum <= 12: [12] | [9] (9+4 > 12) | 4+4+3+1 = 12
    assert token_budget_batches(lengths, 12, packed=True) == [[4], [1], [2, 3, 0, 5]]
    # padded, rows x first (longest) length <= 12: [12] | [9] (2x9 > 12) | 3x4 = 12 | [1]
    assert token_budget_batches(lengths, 12, packed=False) == [[4], [1], [2, 3, 0], [5]]
    # a sequence longer than the budget gets a batch of its own
    assert token_budget_batches([5, 20, 5], 10, packed=True) == [[1], [0, 2]]


@pytest.mark.parametrize("max_tokens_per_batch", [1, 30, 100_000])
def test_batched_packed_equals_padded_in_input_order(tiny_model, max_tokens_per_batch):
    prompts, completions = _random_pairs(seed=5, count=9)
    kwargs = dict(pad_token_id=PAD_ID, temperature=TEMPERATURE, max_tokens_per_batch=max_tokens_per_batch,
                  chunk_size=4, with_entropy=True)
    seen = []
    packed = batched_completion_logprobs(tiny_model, prompts, completions, packed=True, progress=seen.append, **kwargs)
    padded = batched_completion_logprobs(tiny_model, prompts, completions, packed=False, **kwargs)
    assert sum(seen) == len(prompts)
    for values_packed, values_padded, completion in zip(packed[0] + packed[1], padded[0] + padded[1],
                                                         completions + completions):
        assert values_packed.dtype == np.float32 and values_packed.shape == (len(completion),)
        np.testing.assert_allclose(values_packed, values_padded, atol=1e-5, rtol=1e-5)


def test_batched_under_bf16_autocast_stays_close(tiny_model):
    prompts, completions = _random_pairs(seed=6, count=6)
    kwargs = dict(pad_token_id=PAD_ID, temperature=1.0, max_tokens_per_batch=64, chunk_size=8, with_entropy=False)
    exact, _ = batched_completion_logprobs(tiny_model, prompts, completions, **kwargs)
    bf16, _ = batched_completion_logprobs(tiny_model, prompts, completions, autocast_dtype=torch.bfloat16, **kwargs)
    for a, b in zip(exact, bf16):
        assert b.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=0.5, rtol=0.1)  # bf16 matmuls: a loose sanity bound


def test_gradient_checkpointing_same_gradients_less_saved():
    model = _small_model("qwen2")  # eval mode: transformers' own checkpointing would do nothing here
    checkpointed = copy.deepcopy(model)
    assert enable_gradient_checkpointing(checkpointed) == 3
    assert enable_gradient_checkpointing(checkpointed) == 3  # idempotent
    assert list(checkpointed.state_dict()) == list(model.state_dict())  # parameter names unchanged
    prompts, completions = _random_pairs(seed=7, count=5, vocab=48)
    results = []
    for m in (model, checkpointed):
        for batch in (make_packed_batch(prompts, completions), make_token_batch(prompts, completions, pad_token_id=0)):
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                logprobs_BC, entropy_BC = completion_logprobs(m, batch, temperature=1.0, chunk_size=4,
                                                              with_entropy=True)
            grads = torch.autograd.grad(logprobs_BC.sum() + entropy_BC.sum(), list(m.parameters()))
            results.append((len(saved), grads))
    for plain, ckpt in zip(results[:2], results[2:]):
        assert ckpt[0] < plain[0]
        for a, b in zip(plain[1], ckpt[1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_compile_layers_auto_means_cuda_only():
    assert lp.compile_layers_wanted("auto", "cuda") and lp.compile_layers_wanted("auto", torch.device("cuda", 1))
    assert not lp.compile_layers_wanted("auto", "cpu")
    assert lp.compile_layers_wanted(True, "cpu") and not lp.compile_layers_wanted(False, "cuda")


def test_compile_decoder_layers_keeps_names_and_results():
    model = _small_model("llama")
    compiled = copy.deepcopy(model)
    # backend "eager": Dynamo traces the layers (packed attention included) without code generation.
    assert lp.compile_decoder_layers(compiled, backend="eager") == 3
    assert list(compiled.state_dict()) == list(model.state_dict())
    prompts, completions = _random_pairs(seed=10, count=4, vocab=48)
    with torch.no_grad():
        expected, _ = completion_logprobs(model, make_packed_batch(prompts, completions), temperature=1.0,
                                          chunk_size=8, with_entropy=False)
        got, _ = completion_logprobs(compiled, make_packed_batch(prompts, completions), temperature=1.0,
                                     chunk_size=8, with_entropy=False)
    torch.testing.assert_close(got, expected)


def test_reference_stage_logic_packs_and_keeps_order(tiny_model):
    pl = pytest.importorskip("polars")
    from rlpipe.config import ReferenceLogprobConfig
    from rlpipe.stages.reference_logprob import reference_logprobs

    prompts, completions = _random_pairs(seed=8, count=7)
    rollouts = pl.DataFrame({"prompt_id": list(range(len(prompts))), "sample_idx": [0] * len(prompts),
                             "prompt_token_ids": prompts, "completion_token_ids": completions})
    cfg = ReferenceLogprobConfig(device="cpu", dtype="float32", max_tokens_per_batch=24, chunk_size=4,
                                 compile_layers=False)
    ref = reference_logprobs(tiny_model, rollouts, cfg, temperature=TEMPERATURE, pad_token_id=PAD_ID,
                             reference_version=3, progress=None)
    expected, _ = batched_completion_logprobs(tiny_model, prompts, completions, pad_token_id=PAD_ID,
                                              temperature=TEMPERATURE, max_tokens_per_batch=1, chunk_size=4,
                                              with_entropy=False, packed=False)
    assert ref["prompt_id"].to_list() == list(range(len(prompts))) and set(ref["reference_version"]) == {3}
    for got, want in zip(ref["ref_logprobs"].to_list(), expected):
        np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_flash_close_to_padded():
    """bf16 on CUDA: the packed path runs PyTorch's varlen flash kernel; compare with padded SDPA and float32."""
    model32 = _small_model("qwen2").cuda()
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    prompts, completions = _random_pairs(seed=9, count=16, vocab=48)
    with torch.no_grad():
        (truth, _), (packed32, _) = _both(model32, prompts, completions, temperature=1.0, chunk_size=7,
                                          with_entropy=False)
        (padded16, _), (packed16, _) = _both(model16, prompts, completions, temperature=1.0, chunk_size=7,
                                             with_entropy=False)
    torch.testing.assert_close(packed32, truth, atol=1e-5, rtol=1e-5)
    assert (packed16 - truth).norm() <= 2 * (padded16 - truth).norm() + 1e-3
    logprobs_BC, _ = completion_logprobs(model16, make_packed_batch(prompts, completions), temperature=1.0,
                                         chunk_size=5, with_entropy=False)
    logprobs_BC.sum().backward()
    assert model16.get_output_embeddings().weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_layers_match_eager_under_bf16_autocast():
    """compile_decoder_layers with inductor (the GPU use): same log-probs and gradients to bf16 rounding."""
    model = _small_model("qwen2").cuda()
    compiled = copy.deepcopy(model)
    lp.compile_decoder_layers(compiled)
    prompts, completions = _random_pairs(seed=11, count=12, vocab=48)
    results = []
    for m in (model, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp_BC, entropy_BC = completion_logprobs(m, make_packed_batch(prompts, completions), temperature=0.9,
                                                      chunk_size=16, with_entropy=True)
        grads = torch.autograd.grad(logp_BC.sum() + entropy_BC.sum(), list(m.parameters()))
        results.append((logp_BC, torch.cat([g.flatten() for g in grads])))
    torch.testing.assert_close(results[1][0], results[0][0], atol=0.05, rtol=0.05)
    assert (results[1][1] - results[0][1]).norm() <= 0.05 * results[0][1].norm()
