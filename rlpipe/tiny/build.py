"""Build the whole embedded default from the seed: tokenizer, tiny Llama, task rows, warm start."""
from __future__ import annotations

import time
from typing import Any

from rlpipe.config import TinyTaskConfig
from rlpipe.engines.base import derive_seed
from rlpipe.models.loading import save_checkpoint
from rlpipe.tiny.model import build_tiny_llama, count_parameters
from rlpipe.tiny.task import TASK_ALPHABET, make_task_rows, with_carry_bugs
from rlpipe.tiny.tokenizer import build_char_tokenizer
from rlpipe.tiny.warmstart import greedy_accuracy, warm_start

# Seed domains, so that the task, the initial weights and the warm-start batches draw from
# independent streams of the one params seed.
TASK_STREAM, MODEL_STREAM, WARMSTART_STREAM, CARRY_BUG_STREAM = 11, 12, 13, 14


def build_tiny_default(cfg: TinyTaskConfig, *, seed: int, model_dir: str) -> tuple[Any, list, list, dict]:
    """Create and save the warm-started tiny model (policy version 0); return tokenizer, rows and metrics."""
    if cfg.task == "calculator":
        return build_calculator_task(cfg, seed=seed, model_dir=model_dir)
    started = time.perf_counter()
    tokenizer = build_char_tokenizer(TASK_ALPHABET)
    train_rows, eval_rows = make_task_rows(num_train=cfg.num_train, num_eval=cfg.num_eval,
                                           seed=derive_seed(seed, TASK_STREAM), num_digits=cfg.num_digits)
    model = build_tiny_llama(tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                             num_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                             max_position_embeddings=cfg.max_position_embeddings,
                             seed=derive_seed(seed, MODEL_STREAM))
    # The warm start learns from flawed labels (some answers drop their carries); the prompt tables,
    # rewards and evaluation always use the true answers. See rlpipe/tiny/task.py: with_carry_bugs.
    sft_rows = with_carry_bugs(train_rows, rate=cfg.carry_bug_rate, seed=derive_seed(seed, CARRY_BUG_STREAM))
    ws = warm_start(model, tokenizer, sft_rows, steps=cfg.warmstart_steps, batch_size=cfg.warmstart_batch_size,
                    lr=cfg.warmstart_lr, seed=derive_seed(seed, WARMSTART_STREAM))
    answer_tokens = cfg.num_digits + 2  # the longest sum plus <eos>
    metrics = {
        "parameters": count_parameters(model),
        "warmstart_loss_first": ws["loss_first"],
        "warmstart_loss_last": ws["loss_last"],
        "warmstart_epochs": ws["epochs"],
        "warmstart_flawed_answers": sum(a["answer"] != b["answer"] for a, b in zip(sft_rows, train_rows)),
        "warmstart_eval_accuracy": greedy_accuracy(model, tokenizer, eval_rows, max_new_tokens=answer_tokens),
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    save_checkpoint(model, tokenizer, model_dir, policy_version=0)
    return tokenizer, train_rows, eval_rows, metrics


def build_calculator_task(cfg: TinyTaskConfig, *, seed: int, model_dir: str) -> tuple[Any, list, list, dict]:
    """The multi-turn calculator task (rlpipe/tiny/tool_task.py): its tokenizer with a chat template, rows,
    the model warm-started on a mix of tool trajectories and direct answers; saved as policy version 0."""
    from rlpipe.environments.template import ChatRenderer
    from rlpipe.tiny.tool_task import build_calculator_tokenizer, greedy_tool_accuracy, warmstart_examples
    from rlpipe.tiny.warmstart import warm_start_encoded

    started = time.perf_counter()
    tokenizer = build_calculator_tokenizer()
    train_rows, eval_rows = make_task_rows(num_train=cfg.num_train, num_eval=cfg.num_eval,
                                           seed=derive_seed(seed, TASK_STREAM), num_digits=cfg.num_digits)
    model = build_tiny_llama(tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                             num_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                             max_position_embeddings=cfg.max_position_embeddings,
                             seed=derive_seed(seed, MODEL_STREAM))
    renderer = ChatRenderer(tokenizer, eos_token_ids=[tokenizer.eos_token_id], source="the calculator tokenizer")
    examples = warmstart_examples(train_rows, tokenizer, renderer, tool_use_rate=cfg.tool_use_rate,
                                  carry_bug_rate=cfg.carry_bug_rate, seed=derive_seed(seed, CARRY_BUG_STREAM))
    ws = warm_start_encoded(model, examples, pad_token_id=tokenizer.pad_token_id, steps=cfg.warmstart_steps,
                            batch_size=cfg.warmstart_batch_size, lr=cfg.warmstart_lr,
                            seed=derive_seed(seed, WARMSTART_STREAM))
    accuracy, tool_use = greedy_tool_accuracy(model, tokenizer, eval_rows)
    metrics = {
        "parameters": count_parameters(model),
        "warmstart_loss_first": ws["loss_first"],
        "warmstart_loss_last": ws["loss_last"],
        "warmstart_epochs": ws["epochs"],
        "warmstart_tool_examples": sum(any(not m for m in mask) for _, _, mask in examples),
        "warmstart_eval_accuracy": accuracy,
        "warmstart_eval_tool_use_rate": tool_use,
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    save_checkpoint(model, tokenizer, model_dir, policy_version=0)
    return tokenizer, train_rows, eval_rows, metrics
