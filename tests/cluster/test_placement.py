"""The placement rules without a cluster: addresses, per-stage plans, torchrun variables, what fits where,
vLLM engines on GPU nodes, and the cluster section's errors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from rlpipe.cluster.placement import (StagePlan, check_engines, check_feasible, check_stages,
                                      resolve_address, stage_plan)
from rlpipe.config import ClusterConfig, StageResourcesConfig, load_params
from rlpipe.errors import ConfigError
from tests.e2e.conftest import REPO


@pytest.mark.parametrize("flag, setting, environ, expected", [
    (None, None, {"RAY_ADDRESS": "head:6379"}, None),  # RAY_ADDRESS alone never turns the cluster on
    ("ray", None, {"RAY_ADDRESS": "head:6379"}, "head:6379"),
    ("ray", None, {}, "auto"),
    (None, "ray://head:10001", {}, "ray://head:10001"),
    ("off", "head:6379", {}, None),  # the flag wins over params.yaml
    ("10.0.0.5:6379", None, {}, "10.0.0.5:6379"),
])
def test_the_address_comes_from_the_flag_then_params_then_ray_address(flag, setting, environ, expected):
    assert resolve_address(flag, setting, environ) == expected


@pytest.mark.parametrize("flag, setting, environ, source", [
    ("ray:/head", None, {}, "--cluster"), (None, "head", {}, "cluster.address"),
    ("ray", None, {"RAY_ADDRESS": "head:99999"}, "RAY_ADDRESS")])
def test_a_bad_address_names_where_it_came_from(flag, setting, environ, source):
    with pytest.raises(ConfigError, match=f"^{source}: .* is not a Ray address"):
        resolve_address(flag, setting, environ)


def test_a_plan_multiplies_per_process_resources_by_the_processes_of_a_node():
    cluster = ClusterConfig(stages={"train": StageResourcesConfig(num_cpus=2, num_gpus=1, resources={"h200": 1},
                                                                  nodes=2, processes_per_node=4)})
    plan = stage_plan(cluster, "train")
    assert plan.per_node == {"CPU": 8.0, "GPU": 4.0, "h200": 4.0} and plan.world_size == 8
    assert plan.task_options() == {"num_cpus": 8.0, "num_gpus": 4.0, "resources": {"h200": 4.0}}
    assert [e["RANK"] for e in plan.rank_envs(1)] == ["4", "5", "6", "7"]
    assert plan.rank_envs(1)[2] == {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                                    "GROUP_RANK": "1", "NODE_RANK": "1"}
    assert stage_plan(cluster, "advantage") is None  # not named: runs on the driver


def test_a_one_process_stage_gets_no_torchrun_variables():
    assert StagePlan("score", 1, 1, {"CPU": 1.0}).rank_envs(0) == [{}]


def test_a_stage_no_node_can_hold_fails_naming_what_it_asks_and_what_there_is():
    plan = StagePlan("train", nodes=2, processes_per_node=1, per_node={"CPU": 1.0, "trainer": 1.0})
    nodes = [{"CPU": 2.0, "trainer": 1.0, "node:127.0.0.1": 1.0}, {"CPU": 2.0, "gen": 1.0}]
    with pytest.raises(ConfigError) as e:
        check_feasible(plan, nodes)
    assert str(e.value) == ("cluster.stages.train: asks for 2 node(s) with CPU=1, trainer=1 each (1 process(es) per "
                            "node), but 1 alive node(s) have that; the nodes have: CPU=2, trainer=1; CPU=2, gen=1")
    check_feasible(plan, nodes + [{"CPU": 1.0, "trainer": 2.0}])  # a second node with it: fine


def test_each_generate_process_is_one_engine_on_its_own_gpus():
    def cluster(stage="generate", **kw):
        return ClusterConfig(stages={stage: StageResourcesConfig(**kw)})

    check_engines(cluster(num_gpus=4), tensor_parallel_size=2, data_parallel_size=2, generation_on_gpu=True)
    check_engines(cluster(num_gpus=0), tensor_parallel_size=2, data_parallel_size=2, generation_on_gpu=False)
    # 2 nodes x 4 processes: 8 engines of 2 GPUs each; `engines` may say so
    check_engines(cluster(num_gpus=2, nodes=2, processes_per_node=4), tensor_parallel_size=2, data_parallel_size=1,
                  generation_on_gpu=True)
    check_engines(cluster(num_gpus=2, nodes=2, processes_per_node=4, engines=8), tensor_parallel_size=2,
                  data_parallel_size=1, generation_on_gpu=True)
    with pytest.raises(ConfigError, match=r"^cluster.stages.generate.num_gpus: 2 GPU\(s\) per process, but "
                                          r"generate.vllm.tensor_parallel_size x data_parallel_size needs 4"):
        check_engines(cluster(num_gpus=2, processes_per_node=2), tensor_parallel_size=2, data_parallel_size=2,
                      generation_on_gpu=True)
    with pytest.raises(ConfigError, match=r"^cluster.stages.generate.engines: 2, but nodes x processes_per_node = 1"):
        check_engines(cluster(num_gpus=1, engines=2), tensor_parallel_size=1, data_parallel_size=1,
                      generation_on_gpu=True)
    with pytest.raises(ConfigError, match=r"^cluster.stages.evaluate: nodes x processes_per_node = 2, but evaluate"):
        check_engines(cluster("evaluate", num_gpus=1, nodes=2), tensor_parallel_size=1, data_parallel_size=1,
                      generation_on_gpu=True)


def test_stage_names_are_checked_against_dvc_yaml():
    stages = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    check_stages(load_params(REPO / "params.yaml").cluster, stages)
    with pytest.raises(ConfigError, match=r"cluster.stages: \['trian'\] not a stage of dvc.yaml"):
        check_stages(ClusterConfig(stages={"trian": StageResourcesConfig()}), stages)


@pytest.mark.parametrize("section, message", [
    ({"stages": {"train": {"num_gpu": 1}}}, "unknown key(s) ['cluster.stages.train.num_gpu']"),
    ({"stages": {"train": {"nodes": 0}}}, "cluster.stages.train.nodes, .processes_per_node and .engines must be >= 1"),
    ({"data": "nfs"}, "cluster.data: 'nfs' is not one of ['shared', 'remote']"),
    ({"stages": {"train": {"resources": {"h200": "one"}}}}, "cluster.stages.train.resources.h200: expected a number"),
])
def test_the_cluster_section_is_checked_like_every_other(tmp_path, section, message):
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["cluster"] = {**data["cluster"], **section}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_params(tmp_path / "params.yaml")
    assert message in str(e.value)


def test_a_params_file_without_the_section_runs_on_one_machine(tmp_path):
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    del data["cluster"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    assert load_params(tmp_path / "params.yaml").cluster == ClusterConfig()


def test_importing_rlpipe_and_running_its_loop_does_not_import_ray():
    code = ("import sys, rlpipe.cli, rlpipe.run.loop, rlpipe.stages.runner, rlpipe.cluster.executor; "
            "print('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
