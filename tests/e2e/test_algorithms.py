"""One `dvc repro` iteration per algorithm of the suite, on one project whose generation stays cached.

Each variant is a params change; DVC re-runs only what it affects (never prepare, generate or
reference_logprob), so the whole matrix costs a few train/evaluate runs of the shrunk default.
"""
from __future__ import annotations

import json

import pytest
import yaml

from rlpipe.data.io import read_artifact, read_json
from rlpipe.data.schema import ADVANTAGES, VALUES
from rlpipe.worker import lifecycle
from tests.e2e.conftest import edit_params, run, warm_server

ALL_STAGES = ["prepare", "generate", "train_reward_model", "score", "reference_logprob", "values", "advantage",
              "train", "evaluate"]


def ran_stages(output: str) -> list[str]:
    return [s for s in ALL_STAGES if f"Running stage '{s}'" in output]

pytestmark = pytest.mark.slow

# name -> params; every variant starts from the default GRPO params of the reproduced project
VARIANTS = {
    "dr_grpo": {"advantage.estimator": "dr_grpo", "train.loss_aggregation": "seq-mean-token-sum-norm"},
    "dapo": {"train.eps_high": 0.28, "advantage.drop_zero_variance_groups": True,
             "train.loss_aggregation": "token-mean"},
    "gspo": {"train.policy_loss": "gspo", "train.eps_low": 3.0e-4, "train.eps_high": 4.0e-4},
    "rloo": {"advantage.estimator": "rloo"},
    "reinforce_plus_plus": {"advantage.estimator": "reinforce_plus_plus", "train.loss_aggregation": "token-mean"},
    "deepseek_v32": {"train.kl_beta": 0.01, "train.kl_importance_weighted": True,
                     "train.off_policy_mask_delta": 0.5, "train.tis_cap": 2.0},
    "ppo": {"advantage.estimator": "gae", "train.loss_aggregation": "token-mean"},
    # issue 16's losses and estimators, several per variant to keep the matrix short
    "cispo_batch_std_token_sum_80_20": {"train.policy_loss": "cispo", "train.eps_low": 1.0, "train.eps_high": 4.0,
                                        "advantage.std_scope": "batch", "train.loss_aggregation": "token-sum",
                                        "train.top_entropy_quantile": 0.2},
    "sapo_passk": {"train.policy_loss": "sapo", "advantage.estimator": "grpo_passk"},
    "gmpo_reinforce_pp_baseline": {"train.policy_loss": "gmpo", "train.eps_low": 0.4, "train.eps_high": 0.4,
                                   "advantage.estimator": "reinforce_plus_plus_baseline"},
    "gdpo_verl_profile": {"profile": "verl", "advantage.estimator": "gdpo"},
    "normalize_then_sum_ratio_cap": {"advantage.estimator": "grpo_normalize_then_sum", "train.ratio_cap": 4.0,
                                     "advantage.nan_rewards": "zero_advantage"},
    # RLHF: the reward is the trained Bradley-Terry model's score; exact_answer stays at weight 0 for accuracy
    "ppo_reward_model": {
        "advantage.estimator": "gae", "train.loss_aggregation": "token-mean", "reward_model.train": True,
        "score.rewards": [
            {"name": "reward_model", "weight": 1.0,
             "options": {"path": "artifacts/train_reward_model/model", "device": "cpu", "dtype": "float32",
                         "max_tokens_per_batch": 16384}},
            {"name": "exact_answer", "weight": 0.0,
             "options": {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True}}]},
}
DOWNSTREAM = ["values", "advantage", "train", "evaluate"]


def metrics(root, stage):
    return read_json(root / "metrics" / f"{stage}.json")


def test_every_algorithm_runs_one_iteration(project_copy):
    root = project_copy
    base = (root / "params.yaml").read_text()
    grpo_train = metrics(root, "train")
    assert grpo_train["policy_loss_function"] == "ppo_clip"
    with warm_server("stage", root, ["--warm", str(root / "artifacts/prepare/model")]):
        for name, updates in VARIANTS.items():
            check_variant(root, base, name, updates)
        served = lifecycle.status("stage", root).detail["served"]
    assert served >= 2 * len(VARIANTS), served  # train and evaluate of every variant at least, in the server


def check_variant(root, base: str, name: str, updates: dict) -> None:
    (root / "params.yaml").write_text(base)
    edit_params(root / "params.yaml", updates)
    out = run(["dvc", "repro"], root).stdout
    ran = ran_stages(out)
    assert not {"prepare", "generate", "reference_logprob"} & set(ran), (name, ran)
    # only the RLHF variant trains the reward model (reward_model.train) and scores with it
    assert ("train_reward_model" in ran) == ("score" in ran) == (name == "ppo_reward_model"), (name, ran)
    # advantage may come from DVC's run cache (gspo, deepseek_v32 keep GRPO's advantage params)
    assert {"train", "evaluate"} <= set(ran), (name, ran)
    train, adv = metrics(root, "train"), metrics(root, "advantage")
    assert train["optimizer_steps"] > 0 and train["skipped_steps"] == 0, name
    assert adv["estimator"] == updates.get("advantage.estimator", "grpo"), name
    assert read_json(root / "artifacts/train/checkpoint/rlpipe.json")["policy_version"] == 1
    if name == "gspo":
        assert train["policy_loss_function"] == "gspo"
    if name == "dapo":
        assert adv["filtered"]["zero_variance_group"] == adv["num_samples"] - adv["num_trained"]
    if name.split("_")[0] in ("cispo", "sapo", "gmpo"):
        assert train["policy_loss_function"] == name.split("_")[0], name
    if name == "cispo_batch_std_token_sum_80_20":
        assert "high_entropy_threshold" in train and 0 < train["high_entropy_kept_fraction"] < 0.5
    if name in ("gdpo_verl_profile", "normalize_then_sum_ratio_cap"):
        assert adv["reward_components"] == 2  # exact_answer and digit_match
    if name == "normalize_then_sum_ratio_cap":  # no reward of the tiny task is NaN: nothing is left out
        assert adv.get("unscorable", 0) == 0 and adv["num_trained"] == adv["num_samples"]
    if name == "deepseek_v32":
        assert {"off_policy_masked_fraction", "tis_weight_mean"} <= set(train)
    if name in ("reinforce_plus_plus", "ppo", "ppo_reward_model"):
        assert adv["kl_reward_beta"] == 0.01 and "kl_reward_observed" in adv
    table = read_artifact(root / "artifacts/advantage/advantages.parquet", ADVANTAGES).frame
    ppo = name.startswith("ppo")
    assert table["returns"].is_null().all() == (not ppo), name
    critic_info = read_json(root / "artifacts/train/critic/rlpipe.json")
    assert critic_info["kind"] == ("scalar_head" if ppo else "none"), name
    if name == "ppo_reward_model":  # the reward is the model's score, not the rule's
        scores = metrics(root, "score")
        assert "reward_model" in json.dumps(scores) and scores["reward_mean"] != 0.0
        assert metrics(root, "train_reward_model")["kind"] == "bradley_terry"
    if ppo:
        assert {"value_loss", "explained_variance", "value_clip_fraction"} <= set(train)
        assert metrics(root, "values")["critic"] is True


def test_switching_grpo_to_ppo_adds_the_critic_work_and_back_removes_it(project_copy):
    root = project_copy
    # GRPO: the values stage wrote an empty table without loading a model; no critic was trained
    assert metrics(root, "values")["critic"] is False
    assert read_artifact(root / "artifacts/values/values.parquet", VALUES).frame.height == 0
    assert sorted(p.name for p in (root / "artifacts/train/critic").iterdir()) == ["rlpipe.json"]
    edit_params(root / "params.yaml", {"advantage.estimator": "gae"})
    status = run(["dvc", "status"], root).stdout
    for stage in ("values", "advantage", "train"):  # evaluate follows through train's new checkpoint
        assert f"{stage}:" in status, status
    for stage in ("generate", "score", "reference_logprob", "train_reward_model"):
        assert f"{stage}:" not in status, status
    out = run(["dvc", "repro"], root).stdout
    assert ran_stages(out) == DOWNSTREAM
    values = read_artifact(root / "artifacts/values/values.parquet", VALUES)
    assert values.frame.height == metrics(root, "generate")["num_samples"]
    assert values.metadata["critic"]["fresh_head"] is True
    assert (root / "artifacts/train/critic/scalar_head.safetensors").is_file()
    edit_params(root / "params.yaml", {"advantage.estimator": "grpo"})
    run(["dvc", "repro"], root)
    assert metrics(root, "values")["critic"] is False
    assert sorted(p.name for p in (root / "artifacts/train/critic").iterdir()) == ["rlpipe.json"]


def test_ppo_carries_its_critic_and_adaptive_beta_to_the_next_iteration(project_copy):
    root = project_copy
    edit_params(root / "params.yaml", {"advantage.estimator": "gae", "advantage.kl_in_reward.adaptive": True,
                                       "advantage.kl_in_reward.target": 1.0e-3,
                                       "advantage.kl_in_reward.horizon": 100})
    run(["git", "commit", "-qam", "ppo"], root)
    run(["rlpipe", "run", "--until", "2"], root)
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["iteration"] == 2 and params["critic"]["path"] == "state/critic"
    record = read_json(root / "artifacts/advantage/kl_controller.json")
    # the beta iteration 1 used is the one iteration 0's controller chose, and iteration 1's choice is in params
    history = [json.loads(line) for line in (root / "history/iterations.jsonl").read_text().splitlines()][1:]
    assert history[0]["kl_reward_beta"] == 0.01  # [1:]: after the baseline row (the starting model's eval)
    assert history[1]["kl_reward_beta"] == record["beta"] != 0.01
    assert params["advantage"]["kl_in_reward"]["beta"] == pytest.approx(record["next_beta"])
    # iteration 1's values came from the critic iteration 0 trained
    values = read_artifact(root / "artifacts/values/values.parquet", VALUES)
    assert values.metadata["critic"] == {"path": "state/critic", "fresh_head": False, "critic_version": 1}
    assert read_json(root / "state/critic/rlpipe.json")["critic_version"] == 2
    assert (root / "state/critic.dvc").is_file()


def test_top_p_sampling_with_the_keep_sampling_mask(project_copy):
    """generate.top_p 0.9: the trainer truncates pi_old to the sampler's support, so the sampler-trainer
    mismatch stays float noise (DeepSeek-V3.2's keep sampling mask; docs/off-policy.md)."""
    root = project_copy
    edit_params(root / "params.yaml", {"generate.top_p": 0.9})
    ran = ran_stages(run(["dvc", "repro"], root).stdout)
    assert {"generate", "score", "reference_logprob", "advantage", "train", "evaluate"} <= set(ran), ran
    train = metrics(root, "train")
    assert train["keep_sampling_mask"] is True and 0.5 < train["sampling_kept_mass_mean"] < 1.0
    assert train["sampler_mismatch_max_abs"] < 1e-5
    assert train["optimizer_steps"] > 0 and train["skipped_steps"] == 0
    edit_params(root / "params.yaml", {"train.keep_sampling_mask": False})  # the peers' full softmax
    assert ran_stages(run(["dvc", "repro"], root).stdout) == ["train", "evaluate"]
    assert metrics(root, "train")["sampler_mismatch_mean_abs"] > 1e-3
