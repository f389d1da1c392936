"""Per-token text of completions for `rlpipe inspect`: the policy's tokenizer when there is one, else a fallback.

Only the `tokenizers` library (no torch, no transformers), so inspecting stays fast.
"""
from __future__ import annotations

from pathlib import Path

from rlpipe.errors import ArtifactError


REPLACEMENT = "\ufffd"  # what a decoder makes of bytes that are not (yet) a whole UTF-8 character


class TokenDecoder:
    """Per-token text with a tokenizer's own decoder (``tokenizer.json``, via the `tokenizers` library).

    Each token's text is the growth of the decoded text when the token is appended to a few tokens
    of left context: that keeps the spaces of SentencePiece/BPE pieces and multi-byte characters
    that a token-by-token decode would mangle, at O(n) cost. A character whose bytes span several
    tokens (an en dash, an emoji, under a byte-level BPE) is drawn whole by the token that completes
    it; the tokens before it show nothing (their bytes decode to U+FFFD until the character is whole).
    """

    CONTEXT = 6

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self.path = tokenizer_json
        self._tok = Tokenizer.from_file(str(tokenizer_json))

    def text(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def pieces(self, ids: list[int]) -> list[str]:
        ids = list(ids)
        # every token's context and context + token, decoded in two batched calls (not two calls a token:
        # a whole iteration's page decodes millions of tokens)
        contexts = [ids[max(0, i - self.CONTEXT):i] for i in range(len(ids))]
        befores = self._tok.decode_batch(contexts, skip_special_tokens=False)
        afters = self._tok.decode_batch([[*c, t] for c, t in zip(contexts, ids)], skip_special_tokens=False)
        out = []
        for i, (before, after) in enumerate(zip(befores, afters)):
            # bytes of a character not yet complete decode to U+FFFD: they belong to the token that completes it
            before = before.rstrip(REPLACEMENT)
            if i + 1 < len(ids):  # the last token keeps what it cannot complete: the text really ends there
                after = after.rstrip(REPLACEMENT)
            out.append(after[len(before):] if after.startswith(before) else self.text([ids[i]]))
        return out


def find_decoder(model_dirs: list[Path], override: str | None = None) -> TokenDecoder | None:
    """The tokenizer of the first model directory holding a tokenizer.json (``override`` first), or None."""
    candidates = [Path(override)] if override else list(model_dirs)
    for d in candidates:
        f = d if d.is_file() else d / "tokenizer.json"
        if f.is_file():
            try:
                return TokenDecoder(f)
            except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
                if override:
                    raise ArtifactError(f"{f}: could not load the tokenizer: {e}") from None
    if override:
        raise ArtifactError(f"{override}: no tokenizer.json there")
    return None


def fallback_pieces(text: str | None, ids: list[int]) -> list[str]:
    """Token texts without a tokenizer: the stored text one character per token when the counts agree
    (character tokenizers; a trailing special token shows as its id), else the token ids."""
    if text is not None and len(text) == len(ids):
        return list(text)
    if text is not None and len(text) == len(ids) - 1:
        return [*text, f"⟨{ids[-1]}⟩"]
    return [f"⟨{i}⟩" for i in ids]
