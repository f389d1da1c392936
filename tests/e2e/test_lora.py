"""End to end with train.lora: `dvc repro` writes an adapter checkpoint, `rlpipe iterate` carries it into
state/policy (and, on a refresh, state/reference), and the next iteration samples, references and trains
through it; a LoRA variant of a finished full fine-tuning iteration re-runs only train and evaluate."""
from __future__ import annotations

import json

import pytest

from rlpipe.data.io import read_json
from tests.e2e.conftest import make_project, metrics_at, run
from tests.e2e.test_pipeline import ran_stages
from tests.e2e.test_stage_errors import ws  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

LORA = {"train.lora.rank": 4, "train.lora.alpha": 8.0, "train.lr": 1.0e-3, "reference.refresh_every": 1}
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "rlpipe.json"]


@pytest.fixture(scope="module")
def lora_project(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("lora"), LORA)
    first = run(["dvc", "repro"], root)
    (root / "first_repro.log").write_text(first.stdout + first.stderr)
    return root


def test_repro_writes_an_adapter_checkpoint_over_the_prepared_base(lora_project):
    root = lora_project
    assert "Running stage 'evaluate'" in (root / "first_repro.log").read_text()
    ckpt = root / "artifacts/train/checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ADAPTER_FILES
    info = json.loads((ckpt / "rlpipe.json").read_text())
    assert (info["kind"], info["policy_version"], info["base_model_path"]) == ("lora", 1, "artifacts/prepare/model")
    base_bytes = (root / "artifacts/prepare/model/model.safetensors").stat().st_size
    assert (ckpt / "adapter_model.safetensors").stat().st_size < base_bytes / 2
    train = read_json(root / "metrics/train.json")
    assert train["lora"]["continued"] is False and 0 < train["lora"]["trainable_parameters"] < train["lora"][
        "total_parameters"]
    assert train["sampler_check"] == "passed" and train["checkpoint_dtype"] == "float32"
    assert train["logprob_change_mean"] != 0.0  # the adapter moved
    assert 0.0 <= read_json(root / "metrics/evaluate.json")["accuracy"] <= 1.0


def test_iterate_carries_the_adapter_and_the_next_iteration_runs_through_it(lora_project):
    root = lora_project
    run(["rlpipe", "iterate"], root)
    from rlpipe.config import load_params

    params = load_params(root / "params.yaml")
    assert (params.policy.path, params.reference.path) == ("state/policy", "state/reference")
    for state in ("state/policy", "state/reference"):
        assert sorted(p.name for p in (root / state).iterdir()) == ADAPTER_FILES, state
    proc = run(["dvc", "repro"], root)
    assert ran_stages(proc.stdout) == ["generate", "score", "reference_logprob", "values", "advantage", "train",
                                       "evaluate"]
    # the adapter reached the sampler: the trainer's log pi_old (base + adapter v1) equals the sampler's
    train = read_json(root / "metrics/train.json")
    assert train["sampler_check"] == "passed" and train["sampler_mismatch_max_abs"] < 1e-4
    assert train["lora"]["continued"] is True and train["policy_version_out"] == 2
    # ... and the reference: after the refresh it is the same adapter, so its log-probs are the sampler's
    assert read_json(root / "metrics/reference_logprob.json")["kl_sampler_ref_k1"] == pytest.approx(0.0, abs=1e-5)
    assert json.loads((root / "artifacts/train/checkpoint/rlpipe.json").read_text())["policy_version"] == 2


def test_a_lora_variant_reruns_only_train_and_evaluate(project_copy):
    """`dvc exp run -S train.lora.rank=4` on a finished full fine-tuning iteration: generation and the
    reference come from the cache; train writes an adapter over the same start model."""
    proc = run(["dvc", "exp", "run", "-S", "train.lora.rank=4"], project_copy)
    assert ran_stages(proc.stdout) == ["train", "evaluate"]
    assert (project_copy / "artifacts/train/checkpoint/adapter_config.json").is_file()


def test_lora_train_under_fsdp_matches_the_single_process_stage(project_copy, tmp_path):
    """torchrun --nproc_per_node 2 (FSDP2, gloo) trains the same adapter as one process."""
    import shlex
    import sys

    import torch
    from safetensors.torch import load_file

    from rlpipe.run.commands import stage_commands
    from tests.e2e.conftest import edit_params

    edit_params(project_copy / "params.yaml", {"train.lora.rank": 4, "train.lora.alpha": 8.0, "train.lr": 1.0e-3})
    words = shlex.split(stage_commands(project_copy / "dvc.yaml", project_copy / "params.yaml")["train"])

    def train(out, launcher):
        args = list(words[1:])
        for option, name in (("--checkpoint", "checkpoint"), ("--critic-checkpoint", "critic"),
                             ("--token-stats", "token_stats.parquet"), ("--metrics", "train.json"),
                             ("--steps", "steps.csv")):
            args[args.index(option) + 1] = str(out / name)
        run(launcher + args, project_copy)
        return load_file(out / "checkpoint/adapter_model.safetensors"), read_json(out / "train.json")

    single, m1 = train(tmp_path / "one", [sys.executable])
    fsdp, m2 = train(tmp_path / "two", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc_per_node", "2"])
    assert single.keys() == fsdp.keys() and any("lora_B" in k for k in single)
    for key, w in single.items():
        assert (fsdp[key] - w).abs().max() < 1e-5, key
    assert not all(torch.equal(w, torch.zeros_like(w)) for k, w in single.items() if "lora_B" in k)
    assert m2["optimizer_steps"] == m1["optimizer_steps"] and m2["lora"] == m1["lora"]
    assert sorted(p.name for p in (tmp_path / "two/checkpoint").iterdir()) == ADAPTER_FILES


def test_overlapped_lora_iterations_sample_with_the_older_adapter(tmp_path):
    """`rlpipe run --max-staleness 1` with LoRA: iteration k+1 samples with adapter k (state/sampler) while k
    trains; the sampler check runs where sampler and trainer are one version and is skipped where they are not."""
    from tests.e2e.test_long_runs import git

    root = make_project(tmp_path / "overlap", {"train.lora.rank": 4, "train.lora.alpha": 8.0, "train.lr": 1.0e-3})
    run(["rlpipe", "run", "-n", "3", "--max-staleness", "1"], root)
    checks = []
    for k in range(3):
        train = metrics_at(root, f"iteration-{k}", "train")
        checks.append((train["sampler_policy_version"], train["staleness"], train["sampler_check"]))
        assert train["lora"]["continued"] is (k > 0)
    assert checks == [(0, 0, "passed"), (0, 1, "sampled 1 version(s) behind the trainer (overlapped)"),
                      (1, 1, "sampled 1 version(s) behind the trainer (overlapped)")]
    for state in ("state/policy", "state/sampler"):
        assert sorted(p.name for p in (root / state).iterdir()) == ADAPTER_FILES, state


def test_a_killed_lora_train_resumes_and_writes_the_same_adapter(ws):  # noqa: F811
    """SIGKILL after the first resume state (adapter weights only, with dropout's generator); the rerun writes
    the adapter an uninterrupted run writes, byte for byte."""
    import torch

    from tests.e2e.test_fault_injection import kill_train_at_its_first_resume_state_and_rerun

    killed_state = kill_train_at_its_first_resume_state_and_rerun(ws, {
        "train.epochs": 4, "train.minibatch_size": 2, "train.micro_batch_size": 2, "train.checkpoint_every_steps": 10,
        "train.lora.rank": 4, "train.lora.alpha": 8.0, "train.lora.dropout": 0.1, "train.lr": 1.0e-3})
    state = torch.load(killed_state, weights_only=True)
    assert state["model"] and all("lora_" in k for k in state["model"]), "only the adapter is in the state"
    assert json.loads((ws / "out/train.json").read_text())["resumed_from_step"] > 0
    for name in ("checkpoint/adapter_model.safetensors", "checkpoint/adapter_config.json", "checkpoint/rlpipe.json",
                 "token_stats.parquet", "train_steps.csv"):
        assert (ws / "out" / name).read_bytes() == (ws / "full" / name).read_bytes(), name


def test_ppo_with_a_lora_actor_and_a_full_critic(tmp_path):
    """advantage.estimator gae: the actor trains an adapter, the critic (started from the adapter's base) in full."""
    root = make_project(tmp_path / "ppo", {"train.lora.rank": 4, "train.lora.alpha": 8.0, "train.lr": 1.0e-3,
                                           "advantage.estimator": "gae", "train.loss_aggregation": "token-mean"})
    run(["dvc", "repro"], root)
    assert sorted(p.name for p in (root / "artifacts/train/checkpoint").iterdir()) == ADAPTER_FILES
    assert (root / "artifacts/train/critic/scalar_head.safetensors").is_file()
    train = read_json(root / "metrics/train.json")
    assert train["sampler_check"] == "passed" and train["value_loss"] > 0 and train["lora"]["continued"] is False
