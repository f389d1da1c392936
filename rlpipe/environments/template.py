"""Observation tokens as the chat template renders them, and the start-up checks that make that sound.

A multi-turn rollout is built from token ids and never re-tokenised: the model's turns stay exactly
as sampled, and only the observation is tokenised, as the *suffix* the chat template adds after an
assistant turn that ended with EOS: render a dummy conversation ending with an assistant turn, render
it again with the observation messages and the next generation prompt appended, and tokenise what
the second has beyond the first's end-of-turn token. Everything the template writes between the
model's EOS and the next turn (Qwen's newline after ``<|im_end|>``, the tool role header, the
generation prompt) is therefore an observation token: masked out of the loss, present in the ids.

Why not render the whole conversation at the end: re-templating the final messages does not give
back the sampled ids (decode then encode is not a bijection, a parsed tool call re-renders
differently); verl reported PPO not converging that way and TRL fixed the same bug (issue 5224).

That only works for templates that *append*: rendering a longer conversation must start with the
shorter one's text. Templates that rewrite or drop earlier turns (reasoning stripped from earlier
assistant turns, as Qwen3's does after a new user message) break it; `ChatRenderer` detects that at
start-up and refuses the template by name rather than train on ids the model never saw. It also
refuses a template that does not end an assistant turn with the model's EOS, and an observation
suffix that would tokenise differently on its own than after the turn.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any, Sequence

from rlpipe.errors import ConfigError

# The dummy conversation's contents: mixed case, so that a template changing case is caught too.
USER, TURN, NEXT_TURN, OBSERVATION = "Rlpipe user", "Rlpipe turn", "Rlpipe next", "Rlpipe observation"
REASONING = "<think>\nRlpipe reasoning\n</think>\n\n"


def tokenizer_hash(tokenizer: Any) -> str:
    """16 hex digits naming the tokenizer (its full definition, or its vocabulary) and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256(body.encode())
    h.update(b"\0" + (getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


class ChatRenderer:
    """Token ids of observations as ``tokenizer``'s chat template renders them after an assistant turn.

    ``eos_token_ids``: the ids that end a model turn; ``source``: where the tokenizer came from (named
    in errors). Construction runs the checks of the module docstring and raises ConfigError.
    """

    def __init__(self, tokenizer: Any, *, eos_token_ids: Sequence[int], source: str) -> None:
        self.tokenizer, self.source = tokenizer, source
        if not getattr(tokenizer, "chat_template", None):
            raise self._refuse("the tokenizer has no chat template; multi-turn rollouts render observations with it")
        self.eos_texts = sorted({tokenizer.decode([int(t)], skip_special_tokens=False) for t in eos_token_ids},
                                key=len, reverse=True)
        self._base = [{"role": "user", "content": USER}]
        self._turn_text = self._render(self._base + [self._assistant(TURN)], False)
        self._turn_end = self._end_of(self._turn_text, TURN)
        self._check_appends()
        self._check_tokenisation()

    def observation_ids(self, messages: Sequence[dict]) -> list[int]:
        """Ids of ``messages`` plus the next generation prompt, as rendered after an assistant turn's EOS."""
        return list(self._ids(self.observation_text(tuple(tuple(sorted(m.items())) for m in messages))))

    @lru_cache(maxsize=4096)
    def observation_text(self, messages: tuple) -> str:
        full = self._render(self._base + [self._assistant(TURN)] + [dict(m) for m in messages], True)
        if full[:self._turn_end] != self._turn_text[:self._turn_end]:
            raise self._refuse("rendering an observation changed the assistant turn before it")
        return full[self._turn_end:]

    # -- checks ------------------------------------------------------------------------------------

    def _check_appends(self) -> None:
        """A longer conversation's text must start with a shorter one's, up to its last turn's EOS."""
        observation = [{"role": "tool", "content": OBSERVATION}]
        for first in (TURN, REASONING + TURN):
            head = self._render(self._base + [self._assistant(first)], False)
            end = self._end_of(head, first)
            longer = self._render(self._base + [self._assistant(first)] + observation + [self._assistant(NEXT_TURN)],
                                  False)
            if not longer.startswith(head[:end]):
                what = "drops the reasoning of earlier assistant turns" if first != TURN else "rewrites earlier turns"
                raise self._refuse(f"the template {what}: a conversation rendered with one more turn does not start "
                                   "with the shorter one, so ids built turn by turn would not be what it renders")

    def _check_tokenisation(self) -> None:
        head = self._turn_text[:self._turn_end]
        suffix = self.observation_text(((("content", OBSERVATION), ("role", "tool")),))
        if self._ids(head + suffix) != self._ids(head) + self._ids(suffix):
            raise self._refuse("the observation suffix tokenises differently on its own than after the model's EOS")

    # -- helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _assistant(content: str) -> dict:
        return {"role": "assistant", "content": content}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja raises many types; the template is at fault
            raise self._refuse(f"rendering failed: {type(e).__name__}: {e}") from None

    def _end_of(self, text: str, content: str) -> int:
        """Index just after the EOS that ends the assistant turn holding ``content`` in ``text``."""
        at = text.rfind(content)
        if at < 0:
            raise self._refuse("an assistant message's content does not appear in the rendered text")
        after = at + len(content)
        for eos in self.eos_texts:
            if text.startswith(eos, after):
                return after + len(eos)
        raise self._refuse(f"an assistant turn is not closed by an EOS token ({', '.join(map(repr, self.eos_texts))}) "
                           f"right after its content; the template writes {text[after:after + 20]!r}")

    def _ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _refuse(self, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: chat template refused for multi-turn rollouts: {why} "
                           "(docs/multi-turn.md, 'Templates')")
