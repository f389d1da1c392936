"""TRL-style reward functions: ``fn(prompts, completions, **columns) -> list[float]``, used as they are.

Why: a reward written for TRL's GRPOTrainer (``reward_funcs=[...]``) should work in rlpipe
without a rewrite. Such a function is recognised by its first parameter, named ``prompts`` or
``completions``; it is then called once with every row (like a `batch_reward`) with keyword
arguments, as TRL calls it:

* ``prompts``: the prompt text the model saw (after the chat template), one per row; for a
  conversational prompt file, the prompt's list of ``{role, content}`` messages, as the file gave them;
* ``completions``: the completion text (multi-turn: the final model turn); for a conversational
  file, as TRL passes it: a one-message list ``[{"role": "assistant", "content": text}]`` (a prompt
  that ends with a begun assistant reply gives that reply's text to the completion, `conversation`);
* ``completion_ids``: the completion's token ids (EOS included when produced);
* ``answer``: the ground truth (the file's answer column), unless the file has a column of that name;
* every column of the prompt file by its own name (the raw prompt and answer columns included,
  from ``Sample.metadata``), one value per row, e.g. ``solution``;
* its options from params.yaml.

A function without ``**kwargs`` gets only the arguments it names. A file of prompt strings (TRL's
"standard" format) gives plain strings; a file of message lists (its "conversational" format) gives
message lists, so ``completion[0]["content"]`` works as it does under TRL.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from rlpipe.rewards.base import Sample, batch_reward

TRL_FIRST_PARAMETERS = ("prompts", "completions")
GENERATED_ARGUMENTS = ("prompts", "completions", "completion_ids")  # per-row, from the rollout, not a file column
TRL_ARGUMENTS = (*GENERATED_ARGUMENTS, "answer")  # per-row, besides the file's columns


def is_trl_reward(fn: Callable[..., Any]) -> bool:
    """True for a function whose first parameter is ``prompts`` or ``completions`` (TRL's convention).

    >>> is_trl_reward(lambda completions, **kw: [0.0] * len(completions))
    True
    >>> is_trl_reward(lambda sample, *, scale: 0.0)
    False
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(parameters) and parameters[0].name in TRL_FIRST_PARAMETERS


def check_trl_options(fn: Callable[..., Any], options: dict, name: str) -> None:
    """Raise for an option the function cannot take, or one that would shadow a per-row argument.

    Required parameters are not checked: a column of the prompt file may supply them.
    """
    parameters = inspect.signature(fn).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for key in options:
        if key in TRL_ARGUMENTS:
            raise ValueError(f"reward {name!r}: option {key!r} would shadow the per-row argument of that name")
        if not accepts_any and key not in parameters:
            valid = ", ".join(k for k in parameters if k not in TRL_ARGUMENTS) or "(none)"
            raise ValueError(f"reward {name!r} has no option {key!r}; its options are: {valid}")


def trl_arguments(samples: Sequence[Sample]) -> dict[str, list]:
    """The per-row keyword arguments TRL would pass, built from the samples (see module docstring).

    >>> s = Sample("Q: 1+1?", "2", "2", {"question": "1+1?", "answer": "2"}, 1, False, completion_token_ids=[5])
    >>> trl_arguments([s])
    {'prompts': ['Q: 1+1?'], 'completions': ['2'], 'completion_ids': [[5]], 'answer': ['2'], 'question': ['1+1?']}
    >>> chat = [{"role": "user", "content": "1+1?"}]
    >>> args = trl_arguments([Sample("<u>1+1?<a>", "2", "2", {}, 1, False, prompt_messages=chat)])
    >>> args["prompts"], args["completions"]
    ([[{'role': 'user', 'content': '1+1?'}]], [[{'role': 'assistant', 'content': '2'}]])
    """
    conversational = bool(samples) and samples[0].prompt_messages is not None
    args: dict[str, list] = {
        "prompts": [conversation(s)[0] if conversational else s.prompt for s in samples],
        "completions": [conversation(s)[1] if conversational else s.completion for s in samples],
        "completion_ids": [None if s.completion_token_ids is None else list(s.completion_token_ids)
                           for s in samples],
    }
    columns = sorted({key for s in samples for key in s.metadata} | {"answer"})
    for column in columns:
        if column not in args:
            args[column] = [s.metadata.get(column, s.answer if column == "answer" else None) for s in samples]
    return args


def conversation(sample: Sample) -> tuple[list[dict], list[dict]]:
    """A conversational sample's (prompt messages, completion messages) as TRL's GRPOTrainer builds them: a prompt
    ending with an assistant message (a reply begun for the model) gives that text to the completion.

    >>> begun = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is "}]
    >>> conversation(Sample("...", "4", None, {}, 1, False, prompt_messages=begun))
    ([{'role': 'user', 'content': '2+2?'}], [{'role': 'assistant', 'content': 'It is 4'}])
    """
    messages = list(sample.prompt_messages)
    begun = messages.pop()["content"] if messages and messages[-1]["role"] == "assistant" else ""
    return messages, [{"role": "assistant", "content": begun + sample.completion}]


def trl_adapter(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` as an rlpipe batch reward: ``adapter(samples, **options)`` calls it the way TRL does."""
    parameters = inspect.signature(fn).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    @batch_reward
    def adapter(samples: Sequence[Sample], **options: Any) -> list:
        args = {k: v for k, v in trl_arguments(samples).items() if accepts_any or k in parameters}
        return fn(**args, **options)

    adapter.__name__ = getattr(fn, "__name__", name)
    adapter.__doc__ = fn.__doc__
    return adapter
