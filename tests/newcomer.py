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
            f.write(json.dumps({"prompt": f"reverse: {w}", "answer": w[::-1], "word": w,
                                "difficulty": "easy" if len(w) <= 3 else "hard"}) + "\n")
    return path


def build_model(dest: Path, corpus: list[str], chat_template: str = CHAT_TEMPLATE) -> Path:
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
    fast.chat_template = chat_template
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


# --------------------------------------------------------------------------------------------
# the same task in TRL's conversational format, with TRL-style rewards in a package of the user's own

ROLE_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}<|system|>{% elif m['role'] == 'user' %}"
                 "<|user|>{% else %}<|assistant|>{% endif %}{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM_PROMPT = "Reply with the word only."
TRL_REWARDS = '''
def reversed_word(prompts, completions, word, **kwargs):
    """TRL's conversational format: each prompt a message list, each completion [{"role": "assistant", ...}]."""
    rewards = []
    for prompt, completion, w in zip(prompts, completions, word):
        if prompt[0]["role"] != "system":
            raise ValueError(f"expected the system message first, got {prompt[0]}")
        rewards.append(1.0 if completion[0]["content"].strip() == w[::-1] else 0.0)
    return rewards


def brevity(completions, *, target=4, **kwargs):
    return [-abs(target - len(completion[0]["content"])) / target for completion in completions]
'''


def write_chats(path: Path, items: list[str]) -> Path:
    """Parquet in TRL's conversational format: a system and a user message per prompt, plus answer and word."""
    import polars as pl

    prompts = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"reverse: {w}"}]
               for w in items]
    pl.DataFrame({"prompt": prompts, "answer": [w[::-1] for w in items], "word": items}).write_parquet(path)
    return path


def conversational_inputs(where: Path) -> dict[str, Path]:
    """The model dir (its chat template renders each role), train/eval Parquet, a `datasets` save_to_disk copy of
    the train file, and the reward package trlrewards/ (the user's own, outside the project until init copies it)."""
    import datasets
    import polars as pl

    where.mkdir(parents=True, exist_ok=True)
    train, held_out = words(24, seed=1), words(8, seed=2)
    corpus = [f"{SYSTEM_PROMPT}\nreverse: {w}\n{w[::-1]}" for w in train + held_out]
    (where / "trlrewards").mkdir()
    (where / "trlrewards" / "__init__.py").write_text("")
    (where / "trlrewards" / "rewards.py").write_text(textwrap.dedent(TRL_REWARDS))
    train_file = write_chats(where / "train.parquet", train)
    datasets.Dataset.from_list(pl.read_parquet(train_file).to_dicts()).save_to_disk(str(where / "hf_train"))
    return {"model": build_model(where / "my-model", corpus, ROLE_TEMPLATE), "train": train_file,
            "hf_train": where / "hf_train", "eval": write_chats(where / "eval.parquet", held_out), "rewards": where}
