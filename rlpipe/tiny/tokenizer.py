"""A character-level tokenizer for the tiny default: one token per character, no downloads.

Why character level: the synthetic arithmetic task needs a handful of symbols, and a one-to-one
map from characters to ids makes every decode exact (spaces and newlines included) and every
completion length predictable. Built with the ``tokenizers`` library and wrapped as a
``PreTrainedTokenizerFast`` so that ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work
like for any hub model. Pair it with a Llama-type model: transformers 5.x swaps in Qwen's own
tokenizer class for Qwen2-type checkpoints and ignores a saved ``tokenizer.json``.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Ids 0..3 are the special tokens in this order; characters follow in sorted order, so the ids
# depend only on the set of characters in the alphabet, never on how it was written.
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(alphabet: str, *, extra_special_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus <pad>=0, <bos>=1, <eos>=2, <unk>=3.

    ``extra_special_tokens`` (e.g. chat role markers) get the ids after <unk>, in the given order,
    each one token wherever it appears in a text; decoding without special tokens drops them.

    Encoding prepends <bos> (a template post-processor), so ``tokenizer(prompt)`` gives what the
    model was trained on; <eos> is never added by encoding: the model must produce it.
    Characters outside the alphabet map to <unk>. Padding is on the left, as batched generation
    needs (the model uses RoPE, so the shift of positions does not change its outputs).
    """
    chars = sorted(set(alphabet))
    if not chars:
        raise ValueError("alphabet must contain at least one character")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(extra_special_tokens))}
    for ch in chars:
        vocab[ch] = len(vocab)

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "[\s\S]" matches any single character, newline included (the regex engine, Oniguruma, has
    # no dot-all flag); "isolated" keeps each match as its own piece.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the pieces; the default decoder would join them with spaces.
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        **({"additional_special_tokens": list(extra_special_tokens)} if extra_special_tokens else {}),
    )
