"""ChatRenderer: observation ids are the template's suffix after the model's EOS; bad templates are refused by name."""
from __future__ import annotations

import string

import pytest

from rlpipe.environments.template import ChatRenderer, tokenizer_hash
from rlpipe.errors import ConfigError
from rlpipe.tiny.tokenizer import build_char_tokenizer

START, END = "<|im_start|>", "<|im_end|>"
# An appending template in the ChatML layout of Qwen2.5: consecutive tool messages share one user block.
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Drops the reasoning of every assistant turn but the last (what Qwen3's template does after a new query).
STRIPS_REASONING = CHATML.replace(
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']",
    "{% else %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + c")
REWRITES = CHATML.replace("+ m['content'] + '<|im_end|>", "+ (m['content'] if loop.last else m['content'] | upper) "
                          "+ '<|im_end|>")
NO_EOS = CHATML.replace("+ m['content'] + '<|im_end|>\\n' }}", "+ m['content'] + '\\n\\n' }}")


def chatml_tokenizer(template: str | None):
    tok = build_char_tokenizer(string.ascii_letters + string.digits + string.punctuation + " \n",
                               extra_special_tokens=(START, END))
    tok.chat_template = template
    return tok


def renderer(template: str | None) -> ChatRenderer:
    tok = chatml_tokenizer(template)
    return ChatRenderer(tok, eos_token_ids=[tok.convert_tokens_to_ids(END)], source="models/chatml")


def test_chatml_observation_is_the_suffix_after_the_models_eos():
    r = renderer(CHATML)
    # The newline the template writes after <|im_end|> was never sampled: it is an observation token.
    assert r.observation_text(((("content", "42"), ("role", "tool")),)) == (
        "\n" + START + "user\n<tool_response>\n42\n</tool_response>" + END + "\n" + START + "assistant\n")
    two = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    text = "\n" + START + "user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>" + END \
        + "\n" + START + "assistant\n"
    assert r.observation_ids(two) == list(r.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert r.observation_ids(two)[1] == r.tokenizer.convert_tokens_to_ids(START)  # one token, not 12 characters


def test_calculator_template_renders_tool_result_then_generation_prompt(tokenizer):
    r = ChatRenderer(tokenizer, eos_token_ids=[tokenizer.eos_token_id], source="tiny")
    ids = r.observation_ids([{"role": "tool", "name": "add", "content": "124068"}])
    assert tokenizer.convert_ids_to_tokens(ids) == ["<tool>", "1", "2", "4", "0", "6", "8", "<ai>"]


@pytest.mark.parametrize("template, why", [
    (STRIPS_REASONING, "the template drops the reasoning of earlier assistant turns"),
    (REWRITES, "the template rewrites earlier turns"),
    (NO_EOS, "an assistant turn is not closed by an EOS token ('<|im_end|>') right after its content"),
    (None, "the tokenizer has no chat template"),
    ("{{ messages[0]['nope'] + 1 }}", "rendering failed"),
])
def test_templates_that_do_not_append_are_refused_by_name(template, why):
    with pytest.raises(ConfigError) as exc:
        renderer(template)
    msg = str(exc.value)
    assert msg.startswith("models/chatml: chat template refused for multi-turn rollouts: ")
    assert why in msg and "docs/multi-turn.md" in msg


def test_tokenizer_hash_names_vocabulary_and_template():
    a, b = chatml_tokenizer(CHATML), chatml_tokenizer(REWRITES)
    assert tokenizer_hash(a) == tokenizer_hash(chatml_tokenizer(CHATML))
    assert len(tokenizer_hash(a)) == 16 and tokenizer_hash(a) != tokenizer_hash(b)
