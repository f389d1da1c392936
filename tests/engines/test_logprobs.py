"""Chunked completion log-probs against the obvious full-logits computation on a tiny random Llama."""
import copy

import numpy as np
import pytest
import torch

from rlpipe.engines.logprobs import (
    batched_completion_logprobs,
    completion_logprobs,
    make_token_batch,
    unpad,
)

VOCAB, PAD_ID = 32, 0  # the tiny Llama of conftest.py
TEMPERATURE = 0.7


def _random_pairs(seed: int, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """Ragged prompts (1..9 tokens) and completions (0..11 tokens) of random token ids."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(count):
        n_prompt = int(torch.randint(1, 10, (1,), generator=gen))
        n_completion = int(torch.randint(0, 12, (1,), generator=gen))
        prompts.append(torch.randint(1, VOCAB, (n_prompt,), generator=gen).tolist())
        completions.append(torch.randint(1, VOCAB, (n_completion,), generator=gen).tolist())
    return prompts, completions


def _naive(model, prompt: list[int], completion: list[int], temperature: float = TEMPERATURE):
    """One unpadded sequence: full [T, V] logits, log_softmax(logits / T), gather; and the entropy."""
    ids = torch.tensor([prompt + completion])
    logits_TV = model(input_ids=ids).logits[0].float() / temperature
    logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
    predicting = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
    target_C = torch.tensor(completion, dtype=torch.long)
    logprob_C = logprobs_TV[predicting].gather(-1, target_C.unsqueeze(-1)).squeeze(-1)
    entropy_C = -(logprobs_TV[predicting].exp() * logprobs_TV[predicting]).sum(-1)
    return logprob_C, entropy_C


def test_make_token_batch_layout():
    batch = make_token_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_token_id=0)
    assert batch.input_ids_BT.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.completion_mask_BT.tolist() == [
        [False, False, False, True, True],
        [False, True, True, True, False],
    ]
    assert batch.prompt_lengths == [3, 1] and batch.completion_lengths == [2, 3]
    with pytest.raises(ValueError, match="empty"):
        make_token_batch([[]], [[1]], pad_token_id=0)


def test_unpad_splits_rows():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    rows = unpad(values, [2, 1])
    assert [r.tolist() for r in rows] == [[1.0, 2.0], [3.0]]
    assert all(r.dtype == np.float32 for r in rows)


@pytest.mark.parametrize("chunk_size", [1, 3, 10_000])
def test_matches_naive_full_logits(tiny_model, chunk_size):
    prompts, completions = _random_pairs(seed=1, count=6)
    batch = make_token_batch(prompts, completions, pad_token_id=PAD_ID)
    with torch.no_grad():
        logprobs_BC, entropy_BC = completion_logprobs(
            tiny_model, batch, temperature=TEMPERATURE, chunk_size=chunk_size, with_entropy=True
        )
        assert logprobs_BC.shape == entropy_BC.shape == (6, max(len(c) for c in completions))
        assert logprobs_BC.dtype == entropy_BC.dtype == torch.float32
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            expected_logprob, expected_entropy = _naive(tiny_model, prompt, completion)
            n = len(completion)
            torch.testing.assert_close(logprobs_BC[row, :n], expected_logprob, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(entropy_BC[row, :n], expected_entropy, atol=1e-5, rtol=1e-5)
            assert not logprobs_BC[row, n:].any() and not entropy_BC[row, n:].any()  # zero padding


def test_entropy_is_optional(tiny_model):
    batch = make_token_batch([[3, 4]], [[5, 6]], pad_token_id=PAD_ID)
    with torch.no_grad():
        _, entropy = completion_logprobs(tiny_model, batch, temperature=1.0, chunk_size=4, with_entropy=False)
    assert entropy is None


def test_lm_head_sees_only_completion_positions_in_chunks(tiny_model):
    prompts, completions = _random_pairs(seed=2, count=5)
    batch = make_token_batch(prompts, completions, pad_token_id=PAD_ID)
    rows_seen = []  # positions per head call; the wrapper's own call (logits_to_keep empty) sees none
    hook = tiny_model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows_seen.append(args[0].shape[:-1].numel())
    )
    try:
        with torch.no_grad():
            completion_logprobs(tiny_model, batch, temperature=1.0, chunk_size=4, with_entropy=True)
    finally:
        hook.remove()
    assert max(rows_seen) <= 4
    assert sum(rows_seen) == sum(len(c) for c in completions)


def test_gradient_matches_naive(tiny_model):
    # float64 weights, so that the comparison is not lost in float32 summation-order noise (the
    # float32 cast of the logits inside both computations is the only rounding left).
    tiny_model = copy.deepcopy(tiny_model).double()
    prompts, completions = _random_pairs(seed=3, count=4)
    batch = make_token_batch(prompts, completions, pad_token_id=PAD_ID)
    weights_BC = torch.randn(4, batch.max_completion_length, generator=torch.Generator().manual_seed(0))
    naive_loss = torch.zeros((), dtype=torch.float64)
    params = [p for p in tiny_model.parameters()]

    logprobs_BC, entropy_BC = completion_logprobs(
        tiny_model, batch, temperature=TEMPERATURE, chunk_size=3, with_entropy=True
    )
    loss = (weights_BC * logprobs_BC).sum() + 0.1 * entropy_BC.sum()
    assert loss.requires_grad
    grads = torch.autograd.grad(loss, params)

    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        logprob_C, entropy_C = _naive(tiny_model, prompt, completion)
        naive_loss = naive_loss + (weights_BC[row, : len(completion)] * logprob_C).sum() + 0.1 * entropy_C.sum()
    naive_grads = torch.autograd.grad(naive_loss, params)

    torch.testing.assert_close(loss.double(), naive_loss, atol=1e-4, rtol=1e-5)
    for grad, naive_grad in zip(grads, naive_grads):
        torch.testing.assert_close(grad, naive_grad, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads)


def test_backward_keeps_no_per_chunk_logits():
    """With grad, each chunk's [chunk, V] logits are recomputed in backward rather than kept alive."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 48  # unlike the hidden size (32), so saved logits and saved hidden states can be told apart
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    prompts, completions = _random_pairs(seed=7, count=6)
    batch = make_token_batch(prompts, completions, pad_token_id=PAD_ID)
    saved_shapes = []
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:  # the head's weight itself costs nothing
            saved_shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs_BC, entropy_BC = completion_logprobs(
            model, batch, temperature=1.0, chunk_size=5, with_entropy=True
        )
    (logprobs_BC.sum() + entropy_BC.sum()).backward()
    assert model.get_output_embeddings().weight.grad is not None
    assert saved_shapes and not [shape for shape in saved_shapes if vocab in shape[1:]]


def test_rows_independent_of_batch_composition_and_padding(tiny_model):
    prompts, completions = _random_pairs(seed=4, count=8)
    # A very long companion adds lots of right padding to every other row.
    long_prompt, long_completion = list(range(1, 20)), list(range(3, 31))

    def rows(indices, with_long):
        p = [prompts[i] for i in indices] + ([long_prompt] if with_long else [])
        c = [completions[i] for i in indices] + ([long_completion] if with_long else [])
        batch = make_token_batch(p, c, pad_token_id=PAD_ID)
        with torch.no_grad():
            logprobs_BC, _ = completion_logprobs(
                tiny_model, batch, temperature=1.0, chunk_size=5, with_entropy=False
            )
        return dict(zip(indices, unpad(logprobs_BC, batch.completion_lengths)))

    alone = {i: rows([i], with_long=False)[i] for i in range(8)}
    together = rows(list(range(8)), with_long=False)
    shuffled_padded = rows([5, 2, 7, 0, 3], with_long=True)
    for i in range(8):
        np.testing.assert_allclose(together[i], alone[i], atol=1e-5, rtol=1e-5)
    for i, values in shuffled_padded.items():
        np.testing.assert_allclose(values, alone[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_tokens_per_batch", [1, 40, 100_000])
def test_batched_returns_input_order(tiny_model, max_tokens_per_batch):
    prompts, completions = _random_pairs(seed=5, count=7)
    tiny_model.train()  # the batched helper must switch dropout off and restore the mode
    logprobs, entropies = batched_completion_logprobs(
        tiny_model,
        prompts,
        completions,
        pad_token_id=PAD_ID,
        temperature=TEMPERATURE,
        max_tokens_per_batch=max_tokens_per_batch,
        chunk_size=4,
        with_entropy=True,
        device="cpu",
    )
    assert tiny_model.training
    tiny_model.eval()
    with torch.no_grad():
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            expected_logprob, expected_entropy = _naive(tiny_model, prompt, completion)
            assert logprobs[i].dtype == np.float32 and logprobs[i].shape == (len(completion),)
            np.testing.assert_allclose(logprobs[i], expected_logprob.numpy(), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(entropies[i], expected_entropy.numpy(), atol=1e-5, rtol=1e-5)


def test_batched_without_entropy(tiny_model):
    logprobs, entropies = batched_completion_logprobs(
        tiny_model,
        [[1, 2]],
        [[3]],
        pad_token_id=PAD_ID,
        temperature=1.0,
        max_tokens_per_batch=64,
        chunk_size=8,
        with_entropy=False,
    )
    assert entropies is None and logprobs[0].shape == (1,)


def test_rejects_bad_arguments(tiny_model):
    batch = make_token_batch([[1]], [[2]], pad_token_id=PAD_ID)
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(tiny_model, batch, temperature=0.0, chunk_size=1, with_entropy=False)
    with pytest.raises(ValueError, match="chunk_size"):
        completion_logprobs(tiny_model, batch, temperature=1.0, chunk_size=0, with_entropy=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bfloat16_cuda_close_to_float32(tiny_model_dir):
    from rlpipe.engines.hf import load_causal_lm

    prompts, completions = _random_pairs(seed=6, count=16)
    model32 = load_causal_lm(tiny_model_dir, device="cuda", dtype="float32")
    model16 = load_causal_lm(tiny_model_dir, device="cuda", dtype="bfloat16")
    kwargs = dict(pad_token_id=PAD_ID, temperature=1.0, max_tokens_per_batch=64, chunk_size=7, with_entropy=True)
    lp32, ent32 = batched_completion_logprobs(model32, prompts, completions, device="cuda", **kwargs)
    lp16, ent16 = batched_completion_logprobs(model16, prompts, completions, device="cuda", **kwargs)
    for a, b in zip(lp32 + ent32, lp16 + ent16):
        assert b.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=0.5, rtol=0.1)  # bf16 weights: a loose sanity bound

    batch = make_token_batch(prompts, completions, pad_token_id=PAD_ID)
    logprobs_BC, _ = completion_logprobs(model16, batch, temperature=1.0, chunk_size=5, with_entropy=False)
    logprobs_BC.sum().backward()
    assert model16.get_output_embeddings().weight.grad is not None
