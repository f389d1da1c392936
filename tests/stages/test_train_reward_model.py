"""The Bradley-Terry reward model: loss (hand-computed), training on the tiny synthetic set, the stage
(model and placeholder), and the `reward_model` reward scoring in batches like row by row."""
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.data.io import read_json, write_artifact
from rlpipe.data.schema import PREFERENCES
from rlpipe.engines.logprobs import make_token_batch
from rlpipe.engines.scalar_head import batched_scores, sequence_scores
from rlpipe.errors import ArtifactError
from rlpipe.models.loading import save_checkpoint
from rlpipe.models.value_model import load_scalar_model
from rlpipe.rewards.functions import Sample
from rlpipe.rewards.model_reward import reward_model
from rlpipe.stages.prepare import preference_table
from rlpipe.stages.score import score_rows
from rlpipe.stages.train_reward_model import (PreferencePairs, bradley_terry_loss, evaluate_pairs, pairwise_accuracy,
                                 split_pairs, train_bradley_terry)
from rlpipe.tiny import TASK_ALPHABET, build_char_tokenizer, build_tiny_llama, make_task_rows
from rlpipe.tiny.preferences import make_preference_rows
from tests.shipped import shipped_params

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=16)
TRAIN = dict(batch_size=32, lr=3e-3, weight_decay=0.0, max_grad_norm=1.0, pad_token_id=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(TASK_ALPHABET)


@pytest.fixture(scope="module")
def lm_dir(tokenizer, tmp_path_factory):
    """A random-init tiny Llama saved as a causal-LM dir (the reward model's init)."""
    path = tmp_path_factory.mktemp("lm") / "model"
    save_checkpoint(build_tiny_llama(tokenizer, **SMALL, seed=0), tokenizer, path, policy_version=0)
    return path


@pytest.fixture(scope="module")
def prefs(tokenizer):
    train, _ = make_task_rows(num_train=400, num_eval=0, seed=0)
    rows = make_preference_rows(train, num_pairs=400, seed=1)
    return preference_table(rows, tokenizer, max_prompt_tokens=16, chat_template=False, source="test")


# ---------------------------------------------------------------- the loss and accuracy


def test_bradley_terry_loss_hand_computed():
    # margins 2 and 0: -log sigmoid(2) = log(1 + e^-2) = 0.126928, -log sigmoid(0) = log 2 = 0.693147
    loss = bradley_terry_loss(torch.tensor([3.0, 0.5]), torch.tensor([1.0, 0.5]))
    assert loss.item() == pytest.approx((math.log1p(math.exp(-2)) + math.log(2)) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.410038, abs=1e-6)


def test_bradley_terry_loss_gradient_pushes_chosen_up():
    chosen = torch.tensor([3.0, 0.5], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    # d/dr_c of -log sigmoid(r_c - r_r) / B = -(1 - sigmoid(margin)) / B: -(1 - 0.880797) / 2, -(1 - 0.5) / 2
    assert chosen.grad.tolist() == pytest.approx([-0.059601, -0.25], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([0.059601, 0.25], abs=1e-6)


def test_bradley_terry_loss_is_finite_for_extreme_margins():
    loss = bradley_terry_loss(torch.tensor([-100.0, 100.0]), torch.tensor([0.0, 0.0]))
    assert loss.item() == pytest.approx(50.0)  # (100 + ~0) / 2, not inf


def test_pairwise_accuracy_counts_ties_half():
    # pair 1 right, pair 2 tied (1/2), pair 3 wrong: (1 + 0.5 + 0) / 3
    assert pairwise_accuracy(np.array([1.0, 2.0, 3.0]), np.array([0.0, 2.0, 4.0])) == pytest.approx(0.5)


def test_split_pairs_is_seeded_disjoint_and_sized():
    tr, ev = split_pairs(100, eval_fraction=0.25, seed=7)
    assert len(tr) == 75 and len(ev) == 25
    assert sorted(set(tr) | set(ev)) == list(range(100))
    again = split_pairs(100, eval_fraction=0.25, seed=7)
    assert np.array_equal(tr, again[0]) and np.array_equal(ev, again[1])
    assert not np.array_equal(ev, split_pairs(100, eval_fraction=0.25, seed=8)[1])
    assert len(split_pairs(10, eval_fraction=0.0, seed=0)[1]) == 0


# ---------------------------------------------------------------- training


def test_training_raises_heldout_pairwise_accuracy(lm_dir, prefs):
    pairs = PreferencePairs.from_frame(prefs)
    tr, ev = split_pairs(len(pairs), eval_fraction=0.25, seed=2)
    model = load_scalar_model(lm_dir, seed=3, device="cpu")
    before = evaluate_pairs(model, pairs, ev, pad_token_id=0)
    m = train_bradley_terry(model, pairs, tr, epochs=4, seed=4, **TRAIN)
    after = evaluate_pairs(model, pairs, ev, pad_token_id=0)
    assert m["optimizer_steps"] == 4 * math.ceil(300 / 32)
    assert m["train_loss_last"] < m["train_loss_first"]
    assert after["accuracy"] >= 0.7 and after["accuracy"] > before["accuracy"] + 0.15, (before, after)
    assert after["margin_mean"] > 0 and after["score_chosen_mean"] > after["score_rejected_mean"]


def test_training_is_deterministic(lm_dir, prefs):
    pairs = PreferencePairs.from_frame(prefs)

    def run():
        model = load_scalar_model(lm_dir, seed=3, device="cpu")
        metrics = train_bradley_terry(model, pairs, np.arange(64), epochs=1, seed=4, **TRAIN)
        return model.state_dict(), metrics

    (a, ma), (b, mb) = run(), run()
    assert ma == mb
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = load_scalar_model(lm_dir, seed=3, device="cpu").state_dict()
    assert not torch.equal(a["head.weight"], base["head.weight"])  # the parameters moved
    assert not torch.equal(a["body.embed_tokens.weight"], base["body.embed_tokens.weight"])


# ---------------------------------------------------------------- the reward


@pytest.fixture(scope="module")
def rm_dir(lm_dir, prefs, tmp_path_factory):
    """A briefly trained reward model, saved as the stage saves it."""
    from rlpipe.models.loading import load_tokenizer
    from rlpipe.models.value_model import save_scalar_model

    model = load_scalar_model(lm_dir, seed=3, device="cpu")
    train_bradley_terry(model, PreferencePairs.from_frame(prefs), np.arange(128), epochs=1, seed=4, **TRAIN)
    path = tmp_path_factory.mktemp("rm") / "model"
    save_scalar_model(model, load_tokenizer(lm_dir), path, info={})
    return path


def samples_from(prefs, n):
    out = []
    for row in prefs.head(n).iter_rows(named=True):
        for key in ("chosen", "rejected"):
            out.append(Sample(prompt=row["prompt"], completion=row[key], answer=None, metadata={},
                              completion_tokens=len(row[f"{key}_token_ids"]), truncated=False,
                              prompt_token_ids=row["prompt_token_ids"], completion_token_ids=row[f"{key}_token_ids"]))
    return out


def test_batch_reward_matches_row_by_row_scores(rm_dir, prefs):
    samples = samples_from(prefs, 12)
    batched = reward_model(samples, path=str(rm_dir), device="cpu", dtype="float32", max_tokens_per_batch=4096)
    model = load_scalar_model(rm_dir, seed=999, device="cpu")  # seed unused: the saved head is loaded
    one_by_one = []
    with torch.no_grad():
        for s in samples:
            batch = make_token_batch([s.prompt_token_ids], [s.completion_token_ids], pad_token_id=0)
            one_by_one.append(sequence_scores(model, batch).item())
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    # any batch budget gives the same numbers: one row per batch vs all rows at once
    single = batched_scores(model, [s.prompt_token_ids for s in samples], [s.completion_token_ids for s in samples],
                            pad_token_id=0, max_tokens_per_batch=1)
    assert batched == pytest.approx(single.tolist(), abs=1e-5)
    assert reward_model([], path="/no/such/dir", device="cpu", dtype="float32", max_tokens_per_batch=1) == []


def rollout_rows(prefs, n):
    samples = samples_from(prefs, n)
    return pl.DataFrame({
        "prompt_id": list(range(len(samples))), "sample_idx": pl.Series([0] * len(samples), dtype=pl.Int32),
        "prompt": [s.prompt for s in samples], "completion_text": [s.completion for s in samples],
        "answer": [None] * len(samples), "metadata": ["{}"] * len(samples),
        "completion_length": pl.Series([s.completion_tokens for s in samples], dtype=pl.Int32),
        "truncated": [False] * len(samples),
        "prompt_token_ids": pl.Series([list(s.prompt_token_ids) for s in samples], dtype=pl.List(pl.Int32)),
        "completion_token_ids": pl.Series([list(s.completion_token_ids) for s in samples], dtype=pl.List(pl.Int32)),
    })


def score_cfg(path, workers=1):
    rm = RewardEntry("reward_model", 0.5, {"path": str(path), "device": "cpu", "dtype": "float32",
                                           "max_tokens_per_batch": 64})
    fmt = RewardEntry("format_regex", 1.0, {"pattern": r"\d+", "mode": "fullmatch"})
    return ScoreConfig(rewards=(fmt, rm), accuracy_reward="format_regex", fallback_reward=0.0, max_error_fraction=0.0,
                       workers=workers, row_timeout_s=None)


def test_score_rows_with_reward_model_is_byte_identical_for_any_workers(rm_dir, prefs, tmp_path):
    from rlpipe.data.schema import SCORES

    rows = rollout_rows(prefs, 20)
    one, m1 = score_rows(rows, score_cfg(rm_dir, workers=1))
    three, m3 = score_rows(rows, score_cfg(rm_dir, workers=3))
    assert one.equals(three) and m1 == m3
    write_artifact(one, tmp_path / "a.parquet", SCORES)
    write_artifact(three, tmp_path / "b.parquet", SCORES)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    direct = reward_model(samples_from(prefs, 20), path=str(rm_dir), device="cpu", dtype="float32",
                          max_tokens_per_batch=64)
    assert one["reward_reward_model"].to_list() == direct
    assert one["reward"].to_list() == pytest.approx([1.0 + 0.5 * v for v in direct])  # all completions are digits


def test_reward_model_refuses_a_plain_lm_dir_and_rows_without_tokens(lm_dir, rm_dir, prefs):
    samples = samples_from(prefs, 2)
    with pytest.raises(ArtifactError, match="not a reward model written by train_reward_model"):
        reward_model(samples, path=str(lm_dir), device="cpu", dtype="float32", max_tokens_per_batch=64)
    with pytest.raises(ArtifactError, match="reward model directory not found"):
        reward_model(samples, path="/no/such/rm", device="cpu", dtype="float32", max_tokens_per_batch=64)
    no_tokens = [Sample("1+1=", "2", None, {}, 2, False)]
    with pytest.raises(ArtifactError, match="row 0 has no prompt_token_ids"):
        reward_model(no_tokens, path=str(rm_dir), device="cpu", dtype="float32", max_tokens_per_batch=64)


# ---------------------------------------------------------------- the stage


def stage_app():
    spec = importlib.util.spec_from_file_location("stage_train_reward_model", REPO / "stages/train_reward_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app


def run_stage(tmp_path, prefs_frame, init, out, *, train: bool = True):
    params = yaml.safe_load(shipped_params().read_text())
    params["reward_model"].update(train=train, epochs=2, batch_size=32, lr=3e-3, eval_fraction=0.25)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    write_artifact(prefs_frame, tmp_path / "prefs.parquet", PREFERENCES, metadata={"source": "test"})
    args = ["--params", tmp_path / "params.yaml", "--preferences", tmp_path / "prefs.parquet", "--init", init,
            "--out", out, "--metrics", tmp_path / "metrics.json"]
    result = CliRunner().invoke(stage_app(), [str(a) for a in args])
    return result.exit_code, result.output


def test_stage_trains_a_reward_model_deterministically(lm_dir, prefs, tmp_path):
    code, out = run_stage(tmp_path, prefs, lm_dir, tmp_path / "rm")
    assert code == 0, out
    m = read_json(tmp_path / "metrics.json")
    assert m["kind"] == "bradley_terry" and (m["num_train_pairs"], m["num_eval_pairs"]) == (300, 100)
    assert m["eval_accuracy"] > max(0.6, m["eval_accuracy_init"]), m
    info = json.loads((tmp_path / "rm/rlpipe.json").read_text())
    assert info["kind"] == "scalar_head" and info["num_train_pairs"] == 300
    first = {f: (tmp_path / "rm" / f).read_bytes() for f in ("model.safetensors", "scalar_head.safetensors")}
    code, out = run_stage(tmp_path, prefs, lm_dir, tmp_path / "rm")
    assert code == 0, out
    assert first == {f: (tmp_path / "rm" / f).read_bytes() for f in first}
    assert load_file(str(tmp_path / "rm/scalar_head.safetensors"))["weight"].shape == (1, SMALL["hidden_size"])


def test_stage_with_training_off_writes_a_placeholder_without_loading_a_model(prefs, tmp_path):
    """reward_model.train: false (the default): no torch work, whatever the preferences hold."""
    code, out = run_stage(tmp_path, prefs, "/init/is/not/needed", tmp_path / "rm", train=False)
    assert code == 0, out
    assert [p.name for p in (tmp_path / "rm").iterdir()] == ["rlpipe.json"]
    info = json.loads((tmp_path / "rm/rlpipe.json").read_text())
    assert info["kind"] == "none" and "reward_model.train is false" in info["reason"]
    assert read_json(tmp_path / "metrics.json")["num_pairs"] == prefs.height  # in the file, none trained on
    assert f"pairs={prefs.height} model=none train=false" in out
    with pytest.raises(ArtifactError, match=r"no reward model was trained .*reward_model\.train is false"):
        score_rows(rollout_rows(prefs, 2), score_cfg(tmp_path / "rm"))


def test_stage_without_preferences_writes_a_placeholder_the_reward_refuses(prefs, tmp_path):
    code, out = run_stage(tmp_path, prefs.clear(), "/init/is/not/needed", tmp_path / "rm")
    assert code == 0, out
    assert [p.name for p in (tmp_path / "rm").iterdir()] == ["rlpipe.json"]
    info = json.loads((tmp_path / "rm/rlpipe.json").read_text())
    assert info["kind"] == "none" and "no preference pairs" in info["reason"]
    m = read_json(tmp_path / "metrics.json")
    assert (m["kind"], m["num_pairs"]) == ("none", 0) and m["reason"] == info["reason"]
    with pytest.raises(ArtifactError, match=f"{tmp_path / 'rm'}: no reward model was trained .*no preference pairs"):
        score_rows(rollout_rows(prefs, 2), score_cfg(tmp_path / "rm"))
