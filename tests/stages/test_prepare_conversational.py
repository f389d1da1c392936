"""prepare on TRL's conversational format: message lists rendered by the chat template, kept for rewards,
and every refusal (no template, template off, mixed formats, a reward column a file lacks) naming its cause."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest

from rlpipe.config import PrepareConfig, PromptFilesConfig, RewardEntry
from rlpipe.data.schema import PROMPT_MESSAGES_KEY
from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.stages.prepare import prompt_footer, read_file_sources, read_preference_rows, tables
from rlpipe.tiny import build_char_tokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 :[];"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
SYSTEM = {"role": "system", "content": "answer in one word"}


def chats(words: list[str]) -> list[list[dict]]:
    return [[SYSTEM, {"role": "user", "content": f"reverse {w}"}] for w in words]


@pytest.fixture()
def files(tmp_path):
    """A model dir with a chat template, one without, and conversational train/eval Parquet files."""
    for name, template in (("model", TEMPLATE), ("plain", None)):
        tokenizer = build_char_tokenizer(ALPHABET)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path / name)
    pl.DataFrame({"prompt": chats(["ab", "cd"]), "solution": ["ba", "dc"], "level": [1, 2]}).write_parquet(
        tmp_path / "train.parquet")
    pl.DataFrame({"prompt": chats(["ef"]), "solution": ["fe"]}).write_parquet(tmp_path / "eval.parquet")
    return tmp_path


def config(files: Path, **kw) -> PrepareConfig:
    base = dict(train=str(files / "train.parquet"), eval=str(files / "eval.parquet"), tokenizer_path=str(files / "model"),
                prompt_column="prompt", answer_column="solution", chat_template="auto", preferences=None)
    return PrepareConfig(source="files", max_prompt_tokens=96, tiny=None, files=PromptFilesConfig(**{**base, **kw}))


def test_messages_are_rendered_with_the_generation_prompt_and_kept_for_rewards(files):
    sources = read_file_sources(config(files))
    train, held_out, _ = tables(sources, max_prompt_tokens=64)
    assert train["prompt"].to_list() == ["[system]answer in one word;[user]reverse ab;[assistant]",
                                         "[system]answer in one word;[user]reverse cd;[assistant]"]
    assert train["prompt_token_ids"][0].to_list() == sources.tokenizer(train["prompt"][0],
                                                                       add_special_tokens=False)["input_ids"]
    assert json.loads(held_out["metadata"][0]) == {"prompt": chats(["ef"])[0], "solution": "fe"}
    assert prompt_footer(sources, "eval") == {"split": "eval", "chat_template": True, PROMPT_MESSAGES_KEY: "prompt"}


def test_jsonl_gives_the_same_tables_as_parquet(files):
    for split in ("train", "eval"):
        pl.read_parquet(files / f"{split}.parquet").write_ndjson(files / f"{split}.jsonl")
    from_parquet = tables(read_file_sources(config(files)), max_prompt_tokens=64)
    from_jsonl = tables(read_file_sources(config(files, train=str(files / "train.jsonl"),
                                                 eval=str(files / "eval.jsonl"))), max_prompt_tokens=64)
    for a, b in zip(from_parquet[:2], from_jsonl[:2]):
        assert a.equals(b)


def test_a_standard_file_keeps_its_footer_without_the_messages_key(files):
    pl.DataFrame({"prompt": ["reverse ab"], "solution": ["ba"]}).write_parquet(files / "s.parquet")
    sources = read_file_sources(config(files, train=str(files / "s.parquet"), eval=str(files / "s.parquet")))
    assert prompt_footer(sources, "train") == {"split": "train", "chat_template": True}
    assert tables(sources, max_prompt_tokens=64)[0]["prompt"].to_list() == ["[user]reverse ab;[assistant]"]


def test_conversational_prompts_without_a_chat_template_are_refused(files):
    with pytest.raises(ConfigError, match=f"{files / 'train.parquet'} holds conversational prompts .* the tokenizer "
                                          f"in {files / 'plain'} has no chat template"):
        read_file_sources(config(files, tokenizer_path=str(files / "plain")))


def test_conversational_prompts_with_the_chat_template_off_are_refused(files):
    with pytest.raises(ConfigError, match="prepare.files.chat_template is 'off'; set it to auto or on"):
        read_file_sources(config(files, chat_template="off"))


def test_train_and_eval_of_different_formats_are_refused(files):
    pl.DataFrame({"prompt": ["reverse ef"], "solution": ["fe"]}).write_parquet(files / "eval.parquet")
    with pytest.raises(ArtifactError, match=r"train.parquet is conversational, .*eval.parquet is standard"):
        read_file_sources(config(files))


def test_a_message_without_content_is_refused_naming_file_and_row(files):
    bad = chats(["ef", "gh"])
    bad[1][1] = {"role": "user", "content": None}
    pl.DataFrame({"prompt": bad, "solution": ["fe", "hg"]}).write_parquet(files / "eval.parquet")
    with pytest.raises(ArtifactError, match=r"eval.parquet: row 1: message 1 needs a role and a string content"):
        read_file_sources(config(files))


REWARDS = '''
def by_level(completions, solution, level, **kwargs):
    return [float(level) for _ in completions]

def with_option(completions, *, level):
    return [float(level) for _ in completions]
'''


@pytest.fixture()
def reward_module(files, monkeypatch):
    (files / "lvl_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(files)  # prepare runs in the project root, where reward modules are imported from
    yield
    sys.modules.pop("lvl_rewards", None)


def test_a_reward_column_the_eval_file_lacks_is_refused_at_prepare(files, reward_module):
    entry = RewardEntry("lvl_rewards:by_level", 1.0, {})
    with pytest.raises(ConfigError, match=r"score.rewards: reward 'lvl_rewards:by_level' needs column\(s\) 'level' "
                                          rf"\(its required parameters\), which {files / 'eval.parquet'} lacks; its "
                                          r"columns are \['prompt', 'solution'\]"):
        read_file_sources(config(files), rewards=[entry])


def test_reward_columns_present_in_both_files_or_given_as_options_pass(files, reward_module):
    pl.DataFrame({"prompt": chats(["ef"]), "solution": ["fe"], "level": [3]}).write_parquet(files / "eval.parquet")
    entries = [RewardEntry("lvl_rewards:by_level", 1.0, {}), RewardEntry("lvl_rewards:with_option", 1.0, {"level": 2}),
               RewardEntry("exact_answer", 1.0, {})]
    assert len(read_file_sources(config(files), rewards=entries).eval) == 1


# ---------------------------------------------------------------- preference files in both of TRL's formats


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_conversational_preferences_with_an_explicit_prompt(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": chats(["ab"])[0], "chosen": assistant("ba"),
                                                "rejected": assistant("ab")}])
    assert read_preference_rows(path) == [{"prompt": chats(["ab"])[0], "chosen": "ba", "rejected": "ab"}]


def test_an_implicit_prompt_is_what_chosen_and_rejected_share(tmp_path):
    conversation = chats(["ab"])[0]
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"chosen": conversation + assistant("ba"), "rejected": conversation + assistant("aab")}])
    assert read_preference_rows(path) == [{"prompt": conversation, "chosen": "ba", "rejected": "aab"}]
    path = write_jsonl(tmp_path / "s.jsonl", [{"chosen": "reverse ab: ba", "rejected": "reverse ab: bb"}])
    # the shared text "reverse ab: b" is cut back to just after its last space
    assert read_preference_rows(path) == [{"prompt": "reverse ab: ", "chosen": "ba", "rejected": "bb"}]


@pytest.mark.parametrize(("row", "needle"), [
    ({"prompt": "q", "chosen": assistant("a") + assistant("b"), "rejected": assistant("c")},
     "row 0: chosen: must be one assistant message"),
    ({"chosen": chats(["ab"])[0] + assistant("ba"), "rejected": chats(["cd"])[0] + assistant("dc")},
     "row 0: without a prompt column, chosen and rejected must be the same conversation up to their last message"),
    ({"chosen": "ab", "rejected": "cd"}, "row 0: without a prompt column, chosen and rejected must begin with the "
                                         "same text"),
])
def test_bad_preference_pairs_are_refused_naming_row_and_field(tmp_path, row, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ArtifactError, match=f"{path}: " + needle):
        read_preference_rows(path)


def test_conversational_preferences_are_tokenized_through_the_chat_template(files):
    write_jsonl(files / "p.jsonl", [{"prompt": chats(["ab"])[0], "chosen": assistant("ba"),
                                     "rejected": assistant("ab")}])
    sources = read_file_sources(config(files, preferences=str(files / "p.jsonl")))
    prefs = tables(sources, max_prompt_tokens=64)[2]
    assert prefs["prompt"].to_list() == ["[system]answer in one word;[user]reverse ab;[assistant]"]
    assert prefs["chosen_token_ids"][0].to_list() == [*sources.tokenizer("ba", add_special_tokens=False)["input_ids"],
                                                      sources.tokenizer.eos_token_id]
    pl.DataFrame({"prompt": ["reverse ab"], "solution": ["ba"]}).write_parquet(files / "s.parquet")
    standard_prompts = config(files, preferences=str(files / "p.jsonl"), tokenizer_path=str(files / "plain"),
                              train=str(files / "s.parquet"), eval=str(files / "s.parquet"))
    with pytest.raises(ConfigError, match=r"p.jsonl holds conversational prompts .* has no chat template"):
        read_file_sources(standard_prompts)


# ---------------------------------------------------------------- the stage script: footers, exit codes


def stage_params(files: Path, **updates) -> dict:
    return {"prepare.source": "files", "prepare.max_prompt_tokens": 64,
            "prepare.files.train": str(files / "train.parquet"), "prepare.files.eval": str(files / "eval.parquet"),
            "prepare.files.tokenizer_path": str(files / "model"), "prepare.files.answer_column": "solution",
            **updates}


def test_the_stage_writes_the_messages_field_in_both_footers(files):
    from rlpipe.data.io import read_artifact
    from rlpipe.data.schema import PROMPTS
    from tests.stages.test_prepare_preferences import run_prepare

    code, output, out = run_prepare(files, stage_params(files))
    assert code == 0, output
    for split in ("train", "eval"):
        assert read_artifact(out / f"{split}.parquet", PROMPTS).metadata[PROMPT_MESSAGES_KEY] == "prompt"


def test_the_stage_exits_non_zero_naming_the_missing_template_or_column(files, reward_module):
    from tests.stages.test_prepare_preferences import run_prepare

    code, output, _ = run_prepare(files, stage_params(files, **{"prepare.files.tokenizer_path": str(files / "plain")}))
    assert code != 0 and "has no chat template" in output and str(files / "plain") in output
    rewards = {"score.rewards": [{"name": "lvl_rewards:by_level", "weight": 1.0, "options": {}}],
               "score.accuracy_reward": "lvl_rewards:by_level"}
    code, output, _ = run_prepare(files, stage_params(files, **rewards))
    assert code != 0 and "reward 'lvl_rewards:by_level' needs column(s) 'level'" in output
    assert "eval.parquet lacks" in output


def test_a_prompt_ending_with_an_assistant_message_is_continued_not_answered_anew(files):
    """TRL's "bootstrap": a begun reply is rendered without a new generation prompt, for the model to continue."""
    begun = chats(["ab"])[0] + [{"role": "assistant", "content": "the word is"}]
    pl.DataFrame({"prompt": [begun], "solution": ["ba"]}).write_parquet(files / "begun.parquet")
    sources = read_file_sources(config(files, train=str(files / "begun.parquet"), eval=str(files / "begun.parquet")))
    assert tables(sources, max_prompt_tokens=96)[0]["prompt"].to_list() == [
        "[system]answer in one word;[user]reverse ab;[assistant]the word is"]
