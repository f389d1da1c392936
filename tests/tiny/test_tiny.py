"""The tiny default: tokenizer, model, task and warm start (fast, CPU, one thread)."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpipe.tiny import (
    TASK_ALPHABET,
    build_char_tokenizer,
    build_tiny_llama,
    carry_free_sum,
    greedy_accuracy,
    make_task_rows,
    warm_start,
    with_carry_bugs,
)

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=32)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(TASK_ALPHABET + " \n")


def test_tokenizer_ids_are_fixed(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    # special tokens 0..3, then the sorted characters: "\n" (10) < " " (32) < "+" (43) < "0".."9" < "="
    assert tokenizer.convert_ids_to_tokens([4, 5, 6, 7, 16, 17]) == ["\n", " ", "+", "0", "9", "="]
    # the id map depends on the set of characters only
    assert build_char_tokenizer("=9876543210+ \n").get_vocab() == tokenizer.get_vocab()


def test_tokenizer_round_trip_after_save_and_load(tokenizer, tmp_path):
    text = "12 + 3=\n 15\n\n  7"
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded(text)["input_ids"]
    assert ids == tokenizer(text)["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<bos>", "<eos>")
    batch = loaded(["1+1=", "12+34="], padding=True)["input_ids"]
    assert batch[0][:2] == [loaded.pad_token_id] * 2  # left padding, for batched generation


def test_model_is_deterministic_from_seed(tokenizer):
    a = build_tiny_llama(tokenizer, **SMALL, seed=0).state_dict()
    b = build_tiny_llama(tokenizer, **SMALL, seed=0).state_dict()
    c = build_tiny_llama(tokenizer, **SMALL, seed=1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())


def test_model_save_and_load_keeps_outputs(tokenizer, tmp_path):
    model = build_tiny_llama(tokenizer, **SMALL, seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_task_rows_deterministic_disjoint_and_correct():
    train, evals = make_task_rows(num_train=300, num_eval=100, seed=3, num_digits=2)
    assert (train, evals) == make_task_rows(num_train=300, num_eval=100, seed=3, num_digits=2)
    assert train != make_task_rows(num_train=300, num_eval=100, seed=4, num_digits=2)[0]
    assert len(train) == 300 and len(evals) == 100

    def operands(row):
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"]).groups()
        return int(a), int(b)

    for row in train + evals:
        a, b = operands(row)
        assert 0 <= a < 100 and 0 <= b < 100
        assert row["answer"] == str(a + b)
    unordered = lambda rows: {frozenset(operands(r)) for r in rows}  # noqa: E731
    assert not unordered(train) & unordered(evals)
    assert len({r["prompt"] for r in train + evals}) == 400


def test_carry_bugs():
    assert carry_free_sum(47, 85) == 22  # 7+5=12 -> 2, 4+8=12 -> 2
    assert carry_free_sum(5, 0) == 5 and carry_free_sum(0, 0) == 0 and carry_free_sum(123, 9) == 122
    rows = [{"prompt": "47+85=", "answer": "132"}, {"prompt": "12+34=", "answer": "46"}] * 50
    assert with_carry_bugs(rows, rate=0.0, seed=0) == rows
    all_buggy = with_carry_bugs(rows, rate=1.0, seed=0)
    assert all_buggy[0]["answer"] == "22" and all_buggy[1]["answer"] == "46"  # no carry: unchanged
    assert rows[0]["answer"] == "132"  # input untouched
    some = with_carry_bugs(rows, rate=0.5, seed=0)
    assert some == with_carry_bugs(rows, rate=0.5, seed=0)
    assert 10 < sum(r["answer"] == "22" for r in some) < 40


def test_warm_start_reduces_loss_and_is_deterministic(tokenizer):
    rows, _ = make_task_rows(num_train=64, num_eval=0, seed=0, num_digits=2)

    def run():
        model = build_tiny_llama(tokenizer, **SMALL, seed=0)
        metrics = warm_start(model, tokenizer, rows, steps=30, batch_size=16, lr=3e-3, seed=0)
        return model, metrics

    model, metrics = run()
    assert metrics["loss_last"] < metrics["loss_first"] - 0.5
    assert not model.training
    again, metrics_again = run()
    assert metrics_again["loss_last"] == metrics["loss_last"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


class _Scripted(torch.nn.Module):
    """A stand-in causal LM whose next token is a fixed function of the last input token."""

    def __init__(self, vocab_size: int, next_token: dict[int, int]):
        super().__init__()
        self.vocab_size, self.next_token, self.training = vocab_size, next_token, False

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        logits = torch.full((*input_ids.shape, self.vocab_size), -1e9)
        for i, row in enumerate(input_ids.tolist()):
            for t, tok in enumerate(row):
                logits[i, t, self.next_token.get(tok, 2)] = 0.0
        return type("Out", (), {"logits": logits})()


def test_greedy_accuracy_on_a_hand_made_model(tokenizer):
    vid = tokenizer.convert_tokens_to_ids
    # after "=" say "4", after "4" say "2", after "2" stop: every prompt is answered "42".
    model = _Scripted(len(tokenizer), {vid("="): vid("4"), vid("4"): vid("2"), vid("2"): tokenizer.eos_token_id})
    rows = [
        {"prompt": "40+2=", "answer": "42"},
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "21+21=", "answer": "42"},
        {"prompt": "9+9=", "answer": "18"},
    ]
    assert greedy_accuracy(model, tokenizer, rows, max_new_tokens=4) == 0.5
    assert greedy_accuracy(model, tokenizer, rows, max_new_tokens=4, batch_size=3) == 0.5
    # cut off after one token, the completion is "4": nothing is right
    assert greedy_accuracy(model, tokenizer, rows, max_new_tokens=1) == 0.0
