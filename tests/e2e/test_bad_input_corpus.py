"""The bad-input corpus: every stage x every kind of bad input, as one parametrised table.

Each bad case must give exit code 2, a message naming the file and the column or key at fault,
no output written, and inputs untouched (hashed before and after). The valid-but-odd cases (empty
completions, groups of size 1, unicode) must run and give sensible values.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import pytest

from rlpipe.data.schema import SCHEMA_VERSION
from tests.e2e.conftest import edit_params
from tests.e2e.test_stage_errors import invoke, nothing_written, stage_args, with_footer, ws  # noqa: F401

pytestmark = pytest.mark.slow

# Each stage's Parquet inputs (option -> the column a "missing column" case drops)
INPUTS = {
    "generate": {"--prompts": "prompt_token_ids"},
    "score": {"--rollouts": "completion_text", "--prompts": "answer"},
    "reference_logprob": {"--rollouts": "completion_token_ids"},
    "values": {"--rollouts": "prompt_token_ids"},
    "train_reward_model": {"--preferences": "chosen_token_ids"},
    "advantage": {"--rollouts": "completion_length", "--scores": "reward"},
    "train": {"--rollouts": "completion_token_ids", "--scores": "reward", "--ref-logprobs": "ref_logprobs",
              "--advantages": "token_advantages"},
    "evaluate": {"--prompts": "prompt_token_ids"},
}
PER_TOKEN = {"--rollouts": "sampler_logprobs", "--ref-logprobs": "ref_logprobs", "--advantages": "token_advantages"}
# A stage checks the columns it reads (it reads only those): the per-token column to break, where it is not the above.
# Score with the built-in rewards reads no per-token column (no token ids either): it has no such case.
PER_TOKEN_READ = {("advantage", "--rollouts"): "policy_mask", ("score", "--rollouts"): None}
# inputs joined on keys with another input of the same stage: a row dropped here leaves a key unmatched
JOINED = {("score", "--prompts"), ("advantage", "--scores"), ("train", "--ref-logprobs"), ("train", "--advantages")}


def tree_hash(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file() and "out" not in f.relative_to(root).parts}


def rewrite(src: Path, dest: Path, change) -> Path:
    """A copy of an artifact with ``change`` applied to its pyarrow table, the rlpipe footer kept."""
    table = pq.read_table(src)
    meta = table.schema.metadata
    pq.write_table(change(table).replace_schema_metadata(meta), dest)
    return dest


def shorten_first_list(table: pa.Table, column: str) -> pa.Table:
    values = table[column].to_pylist()
    values[0] = values[0][:-1] if values[0] else [0.0]
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))


def cast_to_string(table: pa.Table, column: str) -> pa.Table:
    i = table.schema.get_field_index(column)
    return table.set_column(i, pa.field(column, pa.string()), pa.array([str(v) for v in table[column].to_pylist()]))


def bad_file(case: str, src: Path, dest: Path, drop: str, per_token: str | None, rollouts: Path):
    """Write the bad variant of ``src`` for ``case``; returns it and what the message must name besides the file."""
    if case == "missing_file":
        return dest, "not found"
    if case == "empty_file":
        dest.write_bytes(b"")
        return dest, ""
    if case == "truncated_parquet":
        dest.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
        return dest, ""
    if case == "corrupt_parquet":
        data = bytearray(src.read_bytes())
        data[4:-8] = bytes(len(data) - 12)  # magic bytes intact, everything between zeroed
        dest.write_bytes(bytes(data))
        return dest, ""
    if case == "wrong_schema_version":
        return with_footer(src, dest, schema_version=0), "schema version 0"
    if case == "missing_column":
        return rewrite(src, dest, lambda t: t.drop_columns([drop])), drop
    if case == "wrong_dtype":
        return rewrite(src, dest, lambda t: cast_to_string(t, "prompt_id")), "prompt_id"
    if case == "duplicate_keys":
        return rewrite(src, dest, lambda t: pa.concat_tables([t, t.slice(0, 1)])), "duplicate"
    if case == "token_length_mismatch":
        return rewrite(src, dest, lambda t: shorten_first_list(t, per_token)), per_token
    if case == "unmatched_keys":  # drop the first rollout's prompt: its rows have no partner here
        gone = pq.read_table(rollouts, columns=["prompt_id"])["prompt_id"][0]
        return rewrite(src, dest, lambda t: t.filter(pa.compute.not_equal(t["prompt_id"], gone))), "prompt_id"
    raise ValueError(case)


FILE_CASES = ["missing_file", "empty_file", "truncated_parquet", "corrupt_parquet", "wrong_schema_version",
              "missing_column", "wrong_dtype", "duplicate_keys", "token_length_mismatch", "unmatched_keys"]


def per_token_column(stage: str, option: str) -> str | None:
    return PER_TOKEN_READ.get((stage, option), PER_TOKEN.get(option))


def file_cases():
    for stage, inputs in INPUTS.items():
        for option in inputs:
            for case in FILE_CASES:
                if case == "token_length_mismatch" and per_token_column(stage, option) is None:
                    continue
                if case == "unmatched_keys" and (stage, option) not in JOINED:
                    continue
                yield pytest.param(stage, option, case, id=f"{stage}{option}-{case}")


def assert_refused(ws: Path, stage: str, args: list[str], *needles: str) -> str:
    before = tree_hash(ws)
    code, out = invoke(stage, args)
    assert code == 2, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in: {out}"
    assert nothing_written(ws), list((ws / "out").rglob("*"))
    assert tree_hash(ws) == before, "an input changed"
    return out


@pytest.mark.parametrize(("stage", "option", "case"), list(file_cases()))
def test_a_bad_input_file_is_refused_naming_it(ws, stage, option, case):  # noqa: F811
    src = Path(stage_args(ws, stage)[stage_args(ws, stage).index(option) + 1])
    dest = ws / f"bad_{case}.parquet"
    bad, needle = bad_file(case, src, dest, INPUTS[stage][option], per_token_column(stage, option),
                           ws / "artifacts/generate/rollouts.parquet")
    assert_refused(ws, stage, stage_args(ws, stage, **{option: str(bad)}), bad.name, needle)


def test_ppo_refuses_a_values_table_without_a_critic(ws):  # noqa: F811
    """advantage and train under gae, given the empty values table a GRPO iteration wrote: refused, naming it."""
    edit_params(ws / "params.yaml", {"advantage.estimator": "gae"})
    values = ws / "artifacts/values/values.parquet"
    assert_refused(ws, "advantage", stage_args(ws, "advantage"), values.name, "holds no critic values")
    adv = ws / "artifacts/advantage/advantages.parquet"
    assert_refused(ws, "train", stage_args(ws, "train", **{"--advantages": str(adv)}), values.name,
                   "holds no critic values")


def test_ppo_train_refuses_advantages_without_returns(ws):  # noqa: F811
    """A gae values table with GRPO advantages (no returns): the critic has no targets."""
    import numpy as np

    roll = pq.read_table(ws / "artifacts/generate/rollouts.parquet")
    lengths = roll["completion_length"].to_pylist()
    table = pa.table({"prompt_id": roll["prompt_id"], "sample_idx": roll["sample_idx"],
                      "values": pa.array([np.zeros(n, dtype=np.float32).tolist() for n in lengths],
                                         type=pa.large_list(pa.float32()))})
    critic_values = ws / "critic_values.parquet"
    meta = {"rlpipe": json.dumps({"artifact": "values", "schema_version": SCHEMA_VERSION, "policy_version": 0,
                                  "estimator": "gae", "critic": {"path": "x", "fresh_head": True,
                                                                 "critic_version": 0}})}
    pq.write_table(table.replace_schema_metadata(meta), critic_values)
    edit_params(ws / "params.yaml", {"advantage.estimator": "gae"})
    assert_refused(ws, "train", stage_args(ws, "train", **{"--values": str(critic_values)}),
                   "advantages.parquet", "'returns' is null")


PARAM_CASES = {
    "unknown_key": ({"train.lrr": 1.0, "generate.temprature": 1.0, "score.fallback": 0.0, "advantage.epss": 1.0,
                     "evaluate.batchsize": 1, "prepare.tiny.num_trian": 3, "reference_logprob.devic": "cpu"},
                    "unknown key"),
    "missing_key": (None, "missing required key"),
    "mistyped_key": ({"torch_threads": "one"}, "torch_threads: expected an integer"),
}
ALL_STAGES = ["prepare", *INPUTS]


@pytest.mark.parametrize("case", list(PARAM_CASES))
@pytest.mark.parametrize("stage", ALL_STAGES)
def test_a_bad_params_file_is_refused_naming_the_key(ws, stage, case):  # noqa: F811
    updates, needle = PARAM_CASES[case]
    params = ws / "params.yaml"
    if case == "missing_key":
        text = params.read_text()
        params.write_text("\n".join(line for line in text.splitlines() if not line.startswith("seed:")) + "\n")
        needle = "seed: missing required key"
    else:
        edit_params(params, updates)
    args = stage_args(ws, stage, **({"--model-dir": str(ws / "out/model")} if stage == "prepare" else {}))
    assert_refused(ws, stage, args, "params.yaml", needle)


@pytest.mark.parametrize("stage", ["generate", "evaluate"])
def test_prompts_exceeding_the_context_are_refused(ws, stage):  # noqa: F811
    section = "generate" if stage == "generate" else "evaluate"
    edit_params(ws / "params.yaml", {f"{section}.max_new_tokens": 10_000})
    assert_refused(ws, stage, stage_args(ws, stage), "prompt_id", f"{section}.max_new_tokens=10000", "context")


# ---------------------------------------------------------------------------------------------
# Valid but odd: must run and give sensible values
# ---------------------------------------------------------------------------------------------

def odd_rollouts(ws: Path, change) -> Path:
    return rewrite(ws / "artifacts/generate/rollouts.parquet", ws / "odd_rollouts.parquet", change)


def with_values(table: pa.Table, **columns) -> pa.Table:
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
    return table


def empty_first_completion(t: pa.Table) -> pa.Table:
    col = lambda name: t[name].to_pylist()  # noqa: E731
    ids, logps, lengths, texts, mask = (col("completion_token_ids"), col("sampler_logprobs"),
                                        col("completion_length"), col("completion_text"), col("policy_mask"))
    ids[0], logps[0], lengths[0], texts[0], mask[0] = [], [], 0, "", []
    return with_values(t, completion_token_ids=ids, sampler_logprobs=logps, completion_length=lengths,
                       completion_text=texts, policy_mask=mask)


def test_an_empty_completion_scores_zero_and_gets_empty_log_probs(ws):  # noqa: F811
    rollouts = odd_rollouts(ws, empty_first_completion)
    code, out = invoke("score", stage_args(ws, "score", **{"--rollouts": str(rollouts)}))
    assert code == 0, out
    first = pl.read_parquet(ws / "out/scores.parquet").row(0, named=True)
    assert first["reward"] == 0.0 and first["score_error"] is None and first["correct"] is False
    code, out = invoke("reference_logprob", stage_args(ws, "reference_logprob", **{"--rollouts": str(rollouts)}))
    assert code == 0, out
    assert pl.read_parquet(ws / "out/ref_logprobs.parquet")["ref_logprobs"][0].to_list() == []


def test_groups_of_size_one_get_zero_advantage(ws):  # noqa: F811
    keep = lambda t: t.filter(pa.compute.equal(t["sample_idx"], 0))  # noqa: E731
    rollouts = odd_rollouts(ws, keep)
    scores = rewrite(ws / "artifacts/score/scores.parquet", ws / "single_scores.parquet", keep)
    code, out = invoke("advantage", stage_args(ws, "advantage", **{"--rollouts": str(rollouts),
                                                                   "--scores": str(scores)}))
    assert code == 0, out
    adv = pl.read_parquet(ws / "out/advantages.parquet")
    assert adv["group_size"].unique().to_list() == [1]
    assert adv["advantage"].to_list() == [0.0] * adv.height  # no baseline to compare with: no signal


def test_unicode_completions_are_scored(ws):  # noqa: F811
    texts = ["١٢", "12\u0301", "🙂", "\u202e21", "\x00", "ｱ"]

    def unicode(t: pa.Table) -> pa.Table:
        col = t["completion_text"].to_pylist()
        col[: len(texts)] = texts
        return with_values(t, completion_text=col)
    code, out = invoke("score", stage_args(ws, "score", **{"--rollouts": str(odd_rollouts(ws, unicode))}))
    assert code == 0, out
    scores = pl.read_parquet(ws / "out/scores.parquet").head(len(texts))
    assert scores["score_error"].null_count() == len(texts)
    assert all(0.0 <= r <= 1.5 for r in scores["reward"].to_list())
    assert json.loads((ws / "out/score.json").read_text())["errors"] == 0


# ---------------------------------------------------------------------------------------------
# LoRA (docs/lora.md): bad params and an adapter over the wrong base, refused naming the key
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("updates", "needle"), [
    ({"train.lora.rank": -1}, "train.lora.rank must be >= 1 for LoRA, or 0/null for full fine-tuning (got -1)"),
    ({"train.lora.rank": 4, "train.lora.target_modules": ["q_projj"]},
     "train.lora.target_modules: ['q_projj'] match no module of LlamaForCausalLM"),
])
def test_bad_lora_params_are_refused_naming_the_key(ws, updates, needle):  # noqa: F811
    edit_params(ws / "params.yaml", updates)
    assert_refused(ws, "train", stage_args(ws, "train"), needle)


@pytest.mark.parametrize(("stage", "option"), [("generate", "--policy"), ("reference_logprob", "--reference"),
                                               ("evaluate", "--policy"), ("train", "--policy")])
def test_an_adapter_over_a_base_with_another_hash_is_refused(ws, stage, option):  # noqa: F811
    """Every stage that loads a policy refuses an adapter whose recorded base hash is not its base's."""
    from rlpipe.config import LoraConfig
    from rlpipe.models.loading import load_model
    from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training

    base = ws / "artifacts/prepare/model"
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                      train_embeddings=False)
    save_adapter(wrap_for_training(load_model(base, device="cpu", dtype="float32"), lora), ws / "adapter",
                 policy_version=0, base_path=base, base_hash="sha256:" + "0" * 64)
    edit_params(ws / "params.yaml", {"train.lora.rank": 4, "train.lora.alpha": 8.0})
    assert_refused(ws, stage, stage_args(ws, stage, **{option: str(ws / "adapter")}), "adapter/rlpipe.json: "
                   f"base_model_hash sha256:{'0' * 64} does not match the base model {base}")
