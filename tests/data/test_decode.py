"""rlpipe.data.decode: per-token text under a byte-level BPE, where one character can span several tokens."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from rlpipe.data.decode import TokenDecoder


@pytest.fixture(scope="module")
def byte_tokens(tmp_path_factory):
    """A byte-level BPE without merges: every byte its own token, so a 3-byte en dash is 3 tokens."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, TokenDecoder(path)


@pytest.mark.parametrize(("text", "expected"), [
    ("a–b", ["a", "", "", "–", "b"]),  # en dash: 3 bytes, drawn whole by the token that completes it
    ("x→y 😀!", ["x", "", "", "→", "y", " ", "", "", "", "😀", "!"]),
    ("€", ["", "", "€"]),
    ("plain", ["p", "l", "a", "i", "n"]),
])
def test_characters_split_over_tokens_are_drawn_whole(byte_tokens, text, expected):
    tok, decoder = byte_tokens
    pieces = decoder.pieces(tok.encode(text).ids)
    assert pieces == expected and "".join(pieces) == text


def test_a_completion_cut_mid_character_shows_its_last_bytes_as_such(byte_tokens):
    tok, decoder = byte_tokens
    ids = tok.encode("ab😀").ids[:-1]  # the emoji's last byte was never generated
    assert decoder.pieces(ids) == ["a", "b", "", "", "\ufffd"]
