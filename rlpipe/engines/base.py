"""The generation-engine contract: what goes in, what comes out, and how randomness is seeded.

Every engine (HF, vLLM) takes the same `PromptRequest`s and `SamplingParams` and returns
`Completion`s, so the generate stage does not care which one ran. This module imports no torch:
stages that only need the types or `derive_seed` stay cheap to import.

Seeding rule used throughout rlpipe: the randomness of one sample depends only on integers that
name it (global seed, iteration, prompt id, sample index), combined with `derive_seed`. It never
depends on batch order, batch size or which other prompts were generated alongside.
"""
from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length")

_SEED_PERSON = b"rlpipe.seed.v1"  # blake2b personalisation: keeps these digests apart from other uses
_SEED_PART_BYTES = 16  # fixed width per part, so (1, 23) and (12, 3) can never collide


def derive_seed(*parts: int) -> int:
    """Combine integers into a stable, well-mixed 63-bit seed (0 <= seed < 2**63).

    Stable across processes, platforms and Python versions (unlike `hash`), because it is a
    blake2b digest of each part written as a fixed-width signed little-endian integer.
    Order matters: `derive_seed(1, 2) != derive_seed(2, 1)`.

    >>> derive_seed(0, 1) == derive_seed(0, 1)
    True
    >>> 0 <= derive_seed(7) < 2**63
    True
    """
    if not parts:
        raise ValueError("derive_seed needs at least one integer")
    digest = hashlib.blake2b(digest_size=8, person=_SEED_PERSON)
    for part in parts:
        value = operator.index(part)  # rejects floats and strings; accepts numpy ints
        try:
            digest.update(value.to_bytes(_SEED_PART_BYTES, "little", signed=True))
        except OverflowError:
            raise ValueError(f"seed part {value} does not fit in {8 * _SEED_PART_BYTES} bits") from None
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    temperature: logits are divided by it before softmax; 0 means greedy (argmax).
    top_p: nucleus sampling, keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 = off.
    top_k: keep the k most likely tokens (ties with the k-th are kept too); 0 = off.
    max_new_tokens: hard cap on generated tokens per sample (the EOS token counts).
    Filters apply in the order temperature -> top-k -> top-p, each on the renormalised result of the previous.
    """

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """True when top-k/top-p cut the support, so sampler log-probs are renormalised (see ALGORITHMS.md)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(frozen=True)
class PromptRequest:
    """One prompt to sample `n` completions for (a GRPO group).

    Sample j of this request draws its randomness from `derive_seed(seed, j)`; callers usually pass
    `seed = derive_seed(global_seed, iteration, prompt_id)`.
    """

    prompt_token_ids: tuple[int, ...]
    seed: int
    n: int

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class Completion:
    """One generated sample.

    token_ids: generated tokens only (no prompt), including the EOS token when one was produced.
    sampler_logprobs: per token, log-prob under the distribution actually sampled from (after temperature
        and top-k/top-p renormalisation; for greedy, the untempered softmax). Same length as token_ids.
    finish_reason: "stop" (ended with EOS) or "length" (hit max_new_tokens without EOS).
    """

    token_ids: list[int]
    sampler_logprobs: list[float]
    finish_reason: str

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.sampler_logprobs):
            raise ValueError(
                f"{len(self.token_ids)} token_ids but {len(self.sampler_logprobs)} sampler_logprobs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@runtime_checkable
class GenerationEngine(Protocol):
    """Anything that turns prompt requests into completions.

    Returns one list per request, in request order, each holding `request.n` completions in sample order.
    `progress`, when given, is called after each batch with the number of samples it finished (progress bars only).
    """

    name: str

    def generate(
        self, requests: Sequence[PromptRequest], params: SamplingParams, *,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Completion]]: ...


@contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Run a torch module in eval mode (no dropout) and hand it back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
