"""What a newcomer brings to `rlpipe init`: a small BPE tokenizer with a chat template, a tiny Llama
saved with `save_pretrained`, JSONL prompt files and a reward module with two options.

The task: reverse a word (``reverse: abc`` -> ``cba``); the reward reads the file's own ``word``
column from ``sample.metadata``. Sizes are the smallest that run every stage (seconds on CPU).
"""
from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REWARD_MODULE = '''
def reverse_reward(sample, *, scale, partial_credit=0.0):
    """scale if the completion is the file's word reversed; partial_credit x the share of right leading letters."""
    target = sample.metadata["word"][::-1]
    got = sample.completion.strip()
    if got == target:
        return float(scale)
    right = sum(1 for a, b in zip(got, target) if a == b)
    return float(partial_credit) * right / len(target)
'''


def words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4))) for _ in range(n)]


def write_prompts(path: Path, items: list[str]) -> Path:
    with path.open("w") as f:
        for w in items:
            f.write(json.dumps({"prompt": f"reverse: {w}", "answer": w[::-1], "word": w}) + "\n")
    return path


def build_model(dest: Path, corpus: list[str]) -> Path:
    """A BPE tokenizer trained on ``corpus`` and a randomly initialised 1-layer Llama, saved to ``dest``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(dest)
    fast.save_pretrained(dest)
    return dest


def newcomer_inputs(where: Path) -> dict[str, Path]:
    """The model dir, train/eval JSONL and the reward module (myrewards.py) under ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    train, held_out = words(24, seed=1), words(8, seed=2)
    corpus = [f"reverse: {w}\n{w[::-1]}" for w in train + held_out]
    (where / "myrewards.py").write_text(textwrap.dedent(REWARD_MODULE))
    return {"model": build_model(where / "my-model", corpus),
            "train": write_prompts(where / "train.jsonl", train),
            "eval": write_prompts(where / "eval.jsonl", held_out),
            "rewards": where}


SMALL_SETTINGS = {
    "prepare.max_prompt_tokens": 32,
    "generate.prompts_per_iteration": 32,  # more than the 24 train prompts: every one is used, with a warning
    "generate.group_size": 4,
    "generate.max_new_tokens": 6,
    "evaluate.max_new_tokens": 6,
    "train.epochs": 1,
    "train.minibatch_size": 16,
    "train.micro_batch_size": 16,
    "iterate.trackers": "[dvclive]",
}
