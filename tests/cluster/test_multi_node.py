"""One stage across two nodes: the executor starts one Ray task per node in a STRICT_SPREAD placement group,
rank 0's node picks the rendezvous, and each process gets torchrun's variables (gloo on CPU).
reference_logprob (data parallel) must write the same bytes as one process; train (FSDP2) the same
checkpoint to float32 rounding; generate (an engine per node) the same samples, log-probs to float32 rounding. The single-process outputs are the one-machine run's iteration 0."""
from __future__ import annotations

import io
import os
import shlex

import pytest
from safetensors.torch import load_file

from rlpipe.cluster.executor import ClusterExecutor
from rlpipe.config import ClusterConfig, StageResourcesConfig
from rlpipe.run.commands import stage_commands
from tests.cluster.conftest import cluster_env, restored
from tests.e2e.conftest import assert_same_samples, edit_params

pytestmark = pytest.mark.slow
TWO_NODES = StageResourcesConfig(num_cpus=1, resources={"ddp": 1}, nodes=2)  # ddp: score-node and train-node


@pytest.fixture(scope="module")
def iteration_0(one_machine, tmp_path_factory):
    return restored(one_machine, "iteration-0", tmp_path_factory.mktemp("multi_node") / "project")


def on_two_nodes(project, stage: str, outputs: dict[str, str]) -> str:
    """Run ``stage``'s dvc.yaml command on two nodes, with the options in ``outputs`` pointed elsewhere;
    returns what it printed."""
    words = shlex.split(stage_commands(project / "dvc.yaml", project / "params.yaml")[stage])
    for option, path in outputs.items():
        words[words.index(option) + 1] = path
    out, err = io.StringIO(), io.StringIO()
    executor = ClusterExecutor(ClusterConfig(stages={stage: TWO_NODES}), out=out, err=err)
    try:
        executor.run(stage, [shlex.join(words)], str(project), {**os.environ, **cluster_env()})
    finally:
        print(out.getvalue() + err.getvalue())  # shown when the test fails
    assert sorted(executor.ran[stage].split(",")) == ["score-node", "train-node"]
    return out.getvalue() + err.getvalue()


def test_reference_logprob_across_two_nodes_is_byte_identical(driver, iteration_0, tmp_path):
    out = tmp_path / "ref_logprobs.parquet"
    printed = on_two_nodes(iteration_0, "reference_logprob", {"--out": str(out), "--metrics": str(tmp_path / "m.json")})
    assert out.read_bytes() == (iteration_0 / "artifacts/reference_logprob/ref_logprobs.parquet").read_bytes()
    assert "[reference_logprob r0@" in printed  # rank 0 reports; each line names its rank and node


def test_generate_across_two_nodes_samples_what_one_machine_sampled(driver, iteration_0, tmp_path):
    """Two engines, one per node, each sampling its block of the prompts; rank 0 writes the table."""
    out = tmp_path / "rollouts.parquet"
    printed = on_two_nodes(iteration_0, "generate", {"--out": str(out), "--metrics": str(tmp_path / "m.json")})
    assert_same_samples(iteration_0 / "artifacts/generate/rollouts.parquet", out)
    assert "[generate r0@" in printed  # rank 0 writes and reports; rank 1 sent its rows


def test_train_across_two_nodes_matches_one_process(driver, iteration_0, tmp_path):
    new = {"--checkpoint": str(tmp_path / "checkpoint"), "--critic-checkpoint": str(tmp_path / "critic"),
           "--token-stats": str(tmp_path / "token_stats.parquet"), "--metrics": str(tmp_path / "train.json"),
           "--steps": str(tmp_path / "steps.csv")}
    edit_params(iteration_0 / "params.yaml", {"train.checkpoint_every_steps": 1})  # rank 0 saves full states
    on_two_nodes(iteration_0, "train", new)
    ckpt = iteration_0 / "artifacts/train/checkpoint"
    for name in ("config.json", "rlpipe.json", "tokenizer.json"):
        assert (tmp_path / "checkpoint" / name).read_bytes() == (ckpt / name).read_bytes(), name
    single, two = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "checkpoint/model.safetensors")
    start = load_file(iteration_0 / "artifacts/prepare/model/model.safetensors")
    assert single.keys() == two.keys()
    for key, w in single.items():
        assert not (w == start[key]).all() or key.endswith("norm.weight"), f"{key} did not move"
        assert (two[key] - w).abs().max() < 1e-5, key
