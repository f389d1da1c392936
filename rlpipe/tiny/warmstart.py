"""Warm start (supervised fine-tuning) of the tiny model, and a greedy-accuracy probe.

GRPO learns only from prompts where a group of samples disagrees, so the tiny default starts from
a model that already solves part of the task: a short supervised pass on prompt + answer + <eos>
(loss on the answer tokens only), stopped early on purpose. Everything runs on CPU and is
deterministic for a given seed (no dropout; batches drawn from a seeded generator).
"""
from __future__ import annotations

import math
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlpipe.tiny.task import is_correct

IGNORE_INDEX = -100  # label value that cross-entropy skips (prompt and padding positions)


def encode_supervised(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]]
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with <bos>, answer ids + <eos>) per row."""
    encoded = []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        answer_ids = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt_ids, answer_ids))
    return encoded


def collate_supervised(
    pairs: list[tuple[list[int], list[int]] | tuple[list[int], list[int], list[bool]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (answer tokens only), each [B, T].

    A pair may carry a third element, a mask over its answer tokens: tokens where it is False (the
    observations of a multi-turn example) are context, not labels.
    """
    width = max(len(p[0]) + len(p[1]) for p in pairs)
    input_ids = torch.full((len(pairs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt_ids, answer_ids, *mask) in enumerate(pairs):
        n_p, n = len(prompt_ids), len(prompt_ids) + len(answer_ids)
        input_ids[i, :n] = torch.tensor(list(prompt_ids) + list(answer_ids))
        attention_mask[i, :n] = 1
        answer = torch.tensor(answer_ids)
        labels[i, n_p:n] = answer if not mask else torch.where(torch.tensor(mask[0]), answer, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def warmup_cosine_lr(step: int, *, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay from ``lr`` to ``min_ratio * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> dict[str, float]:
    """Supervised next-token training on prompt + answer + <eos>, loss on answer tokens only.

    Batches walk seeded permutations of ``rows`` (every row once per epoch). AdamW without
    weight decay, gradient clipping at 1.0, 10% linear warm-up then cosine decay to lr/10.
    The loss is the token mean over the batch's answer tokens. Returns metrics: losses at the
    start and end (means over the first and last 10% of steps), epochs, seconds.
    """
    if not rows:
        raise ValueError("warm_start needs at least one row")
    return warm_start_encoded(model, encode_supervised(tokenizer, rows), pad_token_id=tokenizer.pad_token_id,
                              steps=steps, batch_size=batch_size, lr=lr, seed=seed)


def warm_start_encoded(
    model: PreTrainedModel,
    pairs: list[tuple],
    *,
    pad_token_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> dict[str, float]:
    """`warm_start` on already tokenized (prompt ids, completion ids[, completion mask]) examples.

    The mask (multi-turn examples) keeps observation tokens out of the loss, as in RL training.
    """
    if steps < 1 or batch_size < 1 or not pairs:
        raise ValueError("warm_start needs steps >= 1, batch_size >= 1 and at least one row")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    order = torch.randperm(len(pairs), generator=generator)
    cursor = 0
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(pairs), generator=generator), 0
        batch = collate_supervised([pairs[i] for i in order[cursor : cursor + batch_size].tolist()], pad_token_id)
        cursor += batch_size
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine_lr(step, steps=steps, lr=lr, warmup=warmup)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    window = max(1, steps // 10)
    return {
        "steps": float(steps),
        "epochs": steps * batch_size / len(pairs),
        "loss_first": sum(losses[:window]) / window,
        "loss_last": sum(losses[-window:]) / window,
        "seconds": time.perf_counter() - started,
    }


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched decoding: greedy when ``temperature == 0``, else sampling from softmax(logits / T).

    Prompts are left-padded; each step recomputes the whole (short) sequence, which at these
    lengths costs less than managing a KV cache. A sequence stops after its <eos>; later slots
    hold <pad>. Returns ``prompt_ids_BP`` (left-padded), ``completion_ids_BC`` and
    ``completion_mask_BC`` (1 on generated tokens, <eos> included).
    """
    was_training = model.training
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_ids_BP, prompt_mask_BP = enc["input_ids"], enc["attention_mask"]
    ids, mask = prompt_ids_BP, prompt_mask_BP
    B = ids.shape[0]
    done_B = torch.zeros(B, dtype=torch.bool)
    new_tokens, new_mask = [], []
    for _ in range(max_new_tokens):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits_BV = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].float()
        if temperature > 0:
            probs_BV = torch.softmax(logits_BV / temperature, dim=-1)
            token_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
        else:
            token_B = logits_BV.argmax(-1)
        alive_B = ~done_B
        token_B = torch.where(alive_B, token_B, torch.full_like(token_B, tokenizer.pad_token_id))
        new_tokens.append(token_B)
        new_mask.append(alive_B.long())
        done_B = done_B | (token_B == tokenizer.eos_token_id)
        ids = torch.cat([ids, token_B[:, None]], dim=1)
        mask = torch.cat([mask, alive_B.long()[:, None]], dim=1)
        if bool(done_B.all()):
            break
    if was_training:
        model.train()
    return prompt_ids_BP, torch.stack(new_tokens, 1), torch.stack(new_mask, 1)


def completion_texts(tokenizer: PreTrainedTokenizerBase, completion_ids_BC: torch.Tensor, completion_mask_BC: torch.Tensor) -> list[str]:
    """Decoded completions without special tokens (the text a reward function sees)."""
    return [
        tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True)
        for ids, m in zip(completion_ids_BC, completion_mask_BC)
    ]


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, str]],
    *,
    max_new_tokens: int,
    batch_size: int = 512,
) -> float:
    """Fraction of rows whose greedy completion's last number equals the answer."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        _, ids, mask = decode(model, tokenizer, [r["prompt"] for r in chunk], max_new_tokens=max_new_tokens)
        texts = completion_texts(tokenizer, ids, mask)
        correct += sum(is_correct(text, row["answer"]) for text, row in zip(texts, chunk))
    return correct / len(rows)
