"""End to end: `dvc repro` of the (shrunk) embedded default, caching, iteration, restore."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.data.io import read_artifact, read_json
from rlpipe.data.schema import (ADVANTAGES, EVAL_ROLLOUTS, PREFERENCES, PROMPTS, REF_LOGPROBS, ROLLOUTS, SCORES,
                           TRAIN_TOKEN_STATS, VALUES)
from tests.e2e.conftest import edit_params, run

pytestmark = pytest.mark.slow

STAGES = ["prepare", "generate", "train_reward_model", "score", "reference_logprob", "values", "advantage", "train",
          "evaluate"]
# dvc.yaml's stages in its order: also the params check (runs whenever params.yaml changes) and the baseline (once)
ALL_STAGES = ["check_params", *STAGES, "baseline"]
ARTIFACTS = {
    "artifacts/prepare/train_prompts.parquet": PROMPTS,
    "artifacts/prepare/eval_prompts.parquet": PROMPTS,
    "artifacts/prepare/preferences.parquet": PREFERENCES,
    "artifacts/generate/rollouts.parquet": ROLLOUTS,
    "artifacts/score/scores.parquet": SCORES,
    "artifacts/reference_logprob/ref_logprobs.parquet": REF_LOGPROBS,
    "artifacts/values/values.parquet": VALUES,
    "artifacts/advantage/advantages.parquet": ADVANTAGES,
    "artifacts/train/token_stats.parquet": TRAIN_TOKEN_STATS,
    "artifacts/evaluate/eval_rollouts.parquet": EVAL_ROLLOUTS,
}


def ran_stages(output: str) -> list[str]:
    return [s for s in STAGES if f"Running stage '{s}'" in output]


def finite_numbers(obj) -> bool:
    if isinstance(obj, dict):
        return all(finite_numbers(v) for v in obj.values())
    if isinstance(obj, list):
        return all(finite_numbers(v) for v in obj)
    if isinstance(obj, float):
        return math.isfinite(obj)
    return True


def test_first_repro_runs_every_stage_and_writes_valid_artifacts(reproduced):
    log = (reproduced / "first_repro.log").read_text()
    assert ran_stages(log) == STAGES
    assert log.index("Running stage 'check_params'") < log.index("Running stage 'prepare'")
    assert "Running stage 'baseline'" in log  # the starting model's eval (prepare's model), version 0
    baseline = read_json(reproduced / "metrics/baseline.json")
    assert (baseline["policy_version"], baseline["num_prompts"]) == (0, 24)
    assert "the starting model evaluated" in log and "iteration 0 trained and evaluated" in log
    for rel, schema in ARTIFACTS.items():
        art = read_artifact(reproduced / rel, schema)
        assert (art.frame.height > 0) == (schema is not VALUES), rel  # GRPO: no critic, an empty values table
    rollouts = read_artifact(reproduced / "artifacts/generate/rollouts.parquet", ROLLOUTS).frame
    assert rollouts.height == 16 * 4  # prompts_per_iteration x group_size
    assert rollouts["prompt_id"].n_unique() == 16
    assert sorted(rollouts["sample_idx"].unique().to_list()) == [0, 1, 2, 3]


def test_metrics_are_finite_and_consistent(reproduced):
    for stage in STAGES:
        metrics = read_json(reproduced / "metrics" / f"{stage}.json")
        assert metrics["stage"] == stage
        assert finite_numbers(metrics), stage
    train = read_json(reproduced / "metrics/train.json")
    assert train["optimizer_steps"] == 2 * 2  # epochs x (64 sequences / minibatch 32)
    assert train["trained_sequences"] + read_json(reproduced / "metrics/advantage.json")["filtered"][
        "zero_variance_group"] == 64
    evaluate = read_json(reproduced / "metrics/evaluate.json")
    assert 0.0 <= evaluate["accuracy"] <= 1.0
    assert evaluate["num_prompts"] == 24
    steps = (reproduced / "plots/train_steps.csv").read_text().splitlines()
    assert len(steps) == 1 + train["optimizer_steps"]


def test_training_changed_the_weights(reproduced):
    before = load_file(str(reproduced / "artifacts/prepare/model/model.safetensors"))
    after = load_file(str(reproduced / "artifacts/train/checkpoint/model.safetensors"))
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), "every weight tensor should move"
    assert json.loads((reproduced / "artifacts/train/checkpoint/rlpipe.json").read_text()) == {"policy_version": 1, "dtype": "float32", "master_weights": False}


def test_a_bf16_checkpoint_carries_the_exact_float32_weights(project_copy):
    """train.save_dtype bfloat16: the top-level weights are bf16, and the master low bits beside them give
    back, bit for bit, the float32 weights that the same training saves with save_dtype float32."""
    float32 = load_file(str(project_copy / "artifacts/train/checkpoint/model.safetensors"))
    edit_params(project_copy / "params.yaml", {"train.save_dtype": "bfloat16"})
    assert ran_stages(run(["dvc", "repro", "--single-item", "train"], project_copy).stdout) == ["train"]
    ckpt = project_copy / "artifacts/train/checkpoint"
    assert json.loads((ckpt / "rlpipe.json").read_text()) == {"policy_version": 1, "dtype": "bfloat16",
                                                            "master_weights": True}
    assert sorted(p.name for p in (ckpt / "master").iterdir()) == ["low_bits.safetensors"]
    bf16 = load_file(str(ckpt / "model.safetensors"))
    assert bf16.keys() == float32.keys() and all(t.dtype == torch.bfloat16 for t in bf16.values())
    from rlpipe.models.loading import load_trainable_model

    exact, loaded_master = load_trainable_model(ckpt, device="cpu")
    assert loaded_master
    state = exact.state_dict()
    for name, value in float32.items():
        assert torch.equal(state[name].view(torch.int32), value.view(torch.int32)), name
        assert torch.equal(bf16[name], value.to(torch.bfloat16)), name
    metrics = json.loads((project_copy / "metrics/train.json").read_text())
    assert metrics["master_weights"] == {"loaded": False, "saved": True}


def test_first_update_starts_on_policy(reproduced):
    """The trainer recomputes pi_old before updating, so its log-probs match the sampler's (fp32 CPU)."""
    stats = read_artifact(reproduced / "artifacts/train/token_stats.parquet", TRAIN_TOKEN_STATS).frame
    rollouts = read_artifact(reproduced / "artifacts/generate/rollouts.parquet", ROLLOUTS).frame
    old = torch.tensor(stats["old_logprobs"].explode().to_numpy())
    sampler = torch.tensor(rollouts["sampler_logprobs"].explode().to_numpy())
    assert torch.allclose(old, sampler, atol=1e-4)
    train = read_json(reproduced / "metrics/train.json")
    assert train["sampler_mismatch_max_abs"] == pytest.approx(float((old - sampler).abs().max()), abs=1e-6)
    assert train["sampler_mismatch_mean_abs"] < 1e-5
    steps = (reproduced / "plots/train_steps.csv").read_text().splitlines()
    header, first = steps[0].split(","), steps[1].split(",")
    assert float(first[header.index("ratio_max")]) == pytest.approx(1.0, abs=1e-5)


def test_second_repro_does_nothing(project_copy):
    status = run(["dvc", "status", "--json"], project_copy).stdout.strip()
    assert status in ("{}", "")
    proc = run(["dvc", "repro"], project_copy)
    assert ran_stages(proc.stdout) == [] and "Running stage" not in proc.stdout
    # a top-level key no stage declares re-runs the check, which refuses it before any stage
    params = project_copy / "params.yaml"
    params.write_text(params.read_text() + "learning_rate: 1.0e-5\n")
    refused = run(["dvc", "repro"], project_copy, check=False)
    assert refused.returncode != 0 and ran_stages(refused.stdout) == []
    assert "unknown key(s) ['learning_rate']" in refused.stderr
    assert "did you mean: learning_rate -> train.lr?" in refused.stderr


def test_reward_change_reruns_only_score_and_downstream(project_copy):
    rollouts = (project_copy / "artifacts/generate/rollouts.parquet").read_bytes()
    ref = (project_copy / "artifacts/reference_logprob/ref_logprobs.parquet").read_bytes()
    scores = (project_copy / "artifacts/score/scores.parquet").read_bytes()
    edit_params(project_copy / "params.yaml", {"score.rewards": [
        {"name": "exact_answer", "weight": 1.0,
         "options": {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True}},
        {"name": "digit_match", "weight": 0.1, "options": {"answer_prefix": None}},
    ]})
    stale = json.loads(run(["dvc", "status", "--json"], project_copy).stdout)
    assert "score" in stale and "generate" not in stale and "reference_logprob" not in stale
    proc = run(["dvc", "repro"], project_copy)
    assert ran_stages(proc.stdout) == ["score", "advantage", "train", "evaluate"]
    assert "Running stage 'baseline'" in proc.stdout  # the starting model's reward, under the new rewards
    assert (project_copy / "artifacts/generate/rollouts.parquet").read_bytes() == rollouts
    assert (project_copy / "artifacts/reference_logprob/ref_logprobs.parquet").read_bytes() == ref
    assert (project_copy / "artifacts/score/scores.parquet").read_bytes() != scores


def test_iterate_advances_and_every_iteration_stays_retrievable(project_copy):
    root = project_copy
    it0_rollouts = (root / "artifacts/generate/rollouts.parquet").read_bytes()
    out = run(["rlpipe", "iterate"], root).stdout
    assert "iteration 0 done" in out
    from rlpipe.config import load_params

    params = load_params(root / "params.yaml")
    assert (params.iteration, params.policy.path) == (1, "state/policy")
    assert (params.reference.path, params.reference.version) == ("artifacts/prepare/model", 0)
    assert json.loads((root / "state/policy/rlpipe.json").read_text()) == {"policy_version": 1, "dtype": "float32", "master_weights": False}
    history = [json.loads(x) for x in (root / "history/iterations.jsonl").read_text().splitlines()]
    baseline = read_json(root / "metrics/baseline.json")
    assert history[0] == {"iteration": -1, "baseline": True, "policy_version": 0,
                          "eval_accuracy": baseline["accuracy"], "eval_reward_mean": baseline["reward_mean"]}
    assert [h["iteration"] for h in history] == [-1, 0]
    eval_series = (root / "plots/eval.csv").read_text().splitlines()
    assert eval_series[0] == "iteration,eval_accuracy,eval_reward_mean" and eval_series[1].startswith("-1,")

    proc = run(["dvc", "repro"], root)
    # prepare, the reward model (trained on prepare's preferences) and the baseline are cached
    assert ran_stages(proc.stdout) == [s for s in STAGES if s not in ("prepare", "train_reward_model")]
    assert "Running stage 'baseline'" not in proc.stdout
    rollouts = read_artifact(root / "artifacts/generate/rollouts.parquet", ROLLOUTS)
    assert rollouts.frame["policy_version"].unique().to_list() == [1]
    assert (root / "artifacts/generate/rollouts.parquet").read_bytes() != it0_rollouts
    run(["rlpipe", "iterate"], root)
    assert "iteration-1" in run(["git", "tag"], root).stdout

    run(["git", "checkout", "-q", "iteration-0"], root)
    run(["dvc", "checkout", "-q"], root)
    assert (root / "artifacts/generate/rollouts.parquet").read_bytes() == it0_rollouts


def test_reference_refresh_every_k_iterations(project_copy):
    root = project_copy
    edit_params(root / "params.yaml", {"reference.refresh_every": 1})
    run(["dvc", "repro"], root)  # only the params file changed: nothing reads refresh_every
    run(["rlpipe", "iterate", "--no-commit"], root)
    from rlpipe.config import load_params

    params = load_params(root / "params.yaml")
    assert (params.reference.path, params.reference.version) == ("state/reference", 1)
    stale = json.loads(run(["dvc", "status", "--json"], root).stdout)
    assert "reference_logprob" in stale


def test_iterate_refuses_an_unfinished_iteration(project_copy):
    edit_params(project_copy / "params.yaml", {"train.lr": 1e-5})
    proc = run(["rlpipe", "iterate"], project_copy, check=False)
    assert proc.returncode == 2
    assert "not up to date" in proc.stderr


@pytest.mark.parametrize("stage", ["generate", "score", "reference_logprob", "advantage", "train"])
def test_stage_output_is_byte_identical_on_rerun(project_copy, stage):
    """Same params and inputs give the same bytes: force the stage to run again and compare."""
    outs = {
        "generate": ["artifacts/generate/rollouts.parquet"],
        "score": ["artifacts/score/scores.parquet"],
        "reference_logprob": ["artifacts/reference_logprob/ref_logprobs.parquet"],
        "advantage": ["artifacts/advantage/advantages.parquet"],
        "train": ["artifacts/train/token_stats.parquet", "artifacts/train/checkpoint/model.safetensors"],
    }[stage]
    before = {p: (project_copy / p).read_bytes() for p in outs}
    proc = run(["dvc", "repro", "--force", "--single-item", stage], project_copy)
    assert ran_stages(proc.stdout) == [stage]
    for p in outs:
        assert (project_copy / p).read_bytes() == before[p], p


def test_clean_copy_reproduces_identical_prepare_outputs(reproduced, tmp_path):
    """prepare (model build + warm start) is deterministic from the seed: rerun it elsewhere, compare bytes."""
    dest = tmp_path / "again"
    shutil.copytree(reproduced, dest, symlinks=True)
    run(["dvc", "repro", "--force", "--single-item", "prepare"], dest)
    for rel in ("artifacts/prepare/model/model.safetensors", "artifacts/prepare/train_prompts.parquet",
                "artifacts/prepare/eval_prompts.parquet"):
        assert (dest / rel).read_bytes() == (reproduced / rel).read_bytes(), rel


def test_run_command_runs_n_iterations_and_resumes(project_copy):
    root = project_copy
    out = run(["rlpipe", "run", "--iterations", "1"], root).stdout
    # iteration 0 was already reproduced (`dvc repro`): it is recorded, then -n 1 trains one new iteration
    assert "iteration 0 is already reproduced" in out
    assert "iteration 0:" in out and "iteration 1:" in out
    history = [json.loads(x) for x in (root / "history/iterations.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [-1, 0, 1]  # the starting model's eval (baseline stage) first
    assert all(0.0 <= h["eval_accuracy"] <= 1.0 for h in history)
    tags = run(["git", "tag"], root).stdout.split()
    assert tags == ["iteration-0", "iteration-1"]
    from rlpipe.config import load_params

    assert load_params(root / "params.yaml").iteration == 2
    assert json.loads((root / "state/policy/rlpipe.json").read_text()) == {"policy_version": 2, "dtype": "float32", "master_weights": False}
