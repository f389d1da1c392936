"""The tiny multi-turn task (``prepare.tiny.task: calculator``): ask the ``add`` tool, copy its result.

A prompt is ``31415+92653=`` (five-digit operands by default). A 0.5M-parameter model cannot add
such numbers itself, but it can copy: the rewarded behaviour is a first turn calling the calculator,
``<call>add(31415,92653)</call>``, whose result the template renders as ``<tool>124068<ai>``, then
a second turn writing ``124068``. The reward is the usual exact answer on the final turn.

The tokenizer is the character tokenizer plus four special tokens, and it carries its own chat
template (saved with the model, so every stage renders the same):

    <bos>{user}<ai>{assistant}<eos><tool>{tool result}<ai>{assistant}<eos>...

Warm start (why it learns): a supervised pass on a mix of trajectories, ``tool_use_rate`` of them
calling the tool and copying its result, the rest answering directly with a flawed sum (the carry
bugs of the single-turn task, ``carry_bug_rate``). The warm-started model thus knows both moves and
how to copy, but greedily answers directly, and is mostly wrong; sampling still calls the tool in a
fraction of the rollouts, which is the within-group reward variance GRPO turns into tool use.
Multi-turn examples are tokenised exactly as the driver builds rollouts (the observation by
`ChatRenderer`), and their observation tokens are left out of the loss.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rlpipe.tiny.task import carry_free_sum
from rlpipe.tiny.tokenizer import build_char_tokenizer

TOOL_ALPHABET = "0123456789+=(),ad"
AI, TOOL, CALL, END_CALL = "<ai>", "<tool>", "<call>", "</call>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + AI + "{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}" + TOOL + "{{ m['content'] }}"
    "{% else %}{{ raise_exception('the tiny template has no role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + AI + "{% endif %}"
)


def build_calculator_tokenizer() -> Any:
    """The character tokenizer of the calculator task, with its chat template."""
    tokenizer = build_char_tokenizer(TOOL_ALPHABET, extra_special_tokens=(AI, TOOL, CALL, END_CALL))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def call_text(prompt: str) -> str:
    """The tool call that answers ``prompt``.

    >>> call_text("31415+92653=")
    '<call>add(31415,92653)</call>'
    """
    a, b = prompt.rstrip("=").split("+")
    return f"{CALL}add({int(a)},{int(b)}){END_CALL}"


def warmstart_examples(rows: list[dict[str, str]], tokenizer: Any, renderer: Any, *, tool_use_rate: float,
                       carry_bug_rate: float, seed: int) -> list[tuple[list[int], list[int], list[bool]]]:
    """(prompt ids, completion ids, policy mask) per row: a tool trajectory or a direct answer.

    Token ids are built as the multi-turn driver builds rollouts: the model's turns tokenised plus
    EOS, the observation from ``renderer`` (its mask False). Direct answers drop their carries with
    probability ``carry_bug_rate``.
    """
    rng = np.random.default_rng(seed)
    uses_tool = rng.random(len(rows)) < tool_use_rate
    buggy = rng.random(len(rows)) < carry_bug_rate
    eos = tokenizer.eos_token_id

    def turn(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]

    out = []
    for row, tool, bug in zip(rows, uses_tool, buggy):
        prompt_ids = list(tokenizer(prompt_text(tokenizer, row["prompt"]), add_special_tokens=False)["input_ids"])
        if tool:
            call, answer = turn(call_text(row["prompt"])), turn(row["answer"])
            observation = renderer.observation_ids([{"role": "tool", "name": "add", "content": row["answer"]}])
            ids = call + observation + answer
            mask = [True] * len(call) + [False] * len(observation) + [True] * len(answer)
        else:
            a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
            ids = turn(str(carry_free_sum(a, b)) if bug else row["answer"])
            mask = [True] * len(ids)
        out.append((prompt_ids, ids, mask))
    return out


def prompt_text(tokenizer: Any, prompt: str) -> str:
    """The prompt as the chat template renders it for generation (what prepare tokenizes)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


# The limits of the warm start's own accuracy probe (prepare), the same as docs/multi-turn.md's settings.
PROBE_MAX_TURNS, PROBE_MAX_TOTAL_TOKENS, PROBE_TURN_TOKENS = 3, 40, 20


def greedy_tool_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, str]], *, batch_size: int = 512
                         ) -> tuple[float, float]:
    """(accuracy, tool-use rate) of greedy multi-turn rollouts on ``rows``, through the real driver."""
    import polars as pl

    from rlpipe.config import EnvironmentConfig
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.hf import HFEngine
    from rlpipe.environments.base import resolve_environment
    from rlpipe.environments.driver import Driver
    from rlpipe.environments.template import ChatRenderer
    from rlpipe.tiny.task import is_correct

    eos = [tokenizer.eos_token_id]
    env = EnvironmentConfig(name="calculator", options={}, max_turns=PROBE_MAX_TURNS,
                            max_total_tokens=PROBE_MAX_TOTAL_TOKENS, tool_timeout_s=10.0, step_timeout_s=60.0,
                            workers=4, prompts_per_chunk=max(len(rows), 1), chunks_in_flight=1)
    renderer = ChatRenderer(tokenizer, eos_token_ids=eos, source="the calculator task's tokenizer")
    driver = Driver(HFEngine.from_model(model, batch_size=batch_size, eos_token_ids=eos,
                                        pad_token_id=tokenizer.pad_token_id),
                    sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=PROBE_TURN_TOKENS),
                    group_size=1, env=env, env_cls=resolve_environment("calculator", {}), tokenizer=tokenizer,
                    renderer=renderer, eos_token_ids=eos, tokenizer_hash="")
    prompts = pl.DataFrame({
        "prompt_id": list(range(len(rows))), "prompt": [r["prompt"] for r in rows],
        "prompt_token_ids": [tokenizer(prompt_text(tokenizer, r["prompt"]), add_special_tokens=False)["input_ids"]
                             for r in rows],
        "answer": [r["answer"] for r in rows], "metadata": ["{}"] * len(rows)})
    out = driver.run(prompts, [0] * len(rows))
    finals = [texts[-1] for texts in out["turn_texts"].to_list()]
    accuracy = sum(is_correct(text, row["answer"]) for text, row in zip(finals, rows)) / len(rows)
    return accuracy, float((out["tool_calls"].list.len() > 0).mean())
