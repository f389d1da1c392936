"""Overlapped iterations (docs/overlap.md): the sampling schedule, its params, the staleness checks, the
importance-weight statistics and the store of recent policies, each on small hand-made inputs."""
from __future__ import annotations

import dataclasses
import json
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml

from rlpipe.config import load_params
from rlpipe.data.io import Artifact
from rlpipe.errors import ArtifactError, ConfigError, RlpipeError
from rlpipe.run import policies
from rlpipe.run.ahead import next_sampling_params, prefetchable, sampled_ahead, scratch_configs
from rlpipe.training.data import check_policy_version
from rlpipe.training.report import importance_weights
from rlpipe.worker import lifecycle
from tests.test_config import dump
from tests.shipped import shipped_params

REPO_PARAMS = shipped_params()


@pytest.mark.parametrize("staleness, versions", [(0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])])
def test_each_iteration_samples_with_the_oldest_version_the_staleness_allows(staleness, versions):
    assert [policies.sampler_version(k, staleness) for k in range(5)] == versions


def params_with(tmp_path, **policy) -> object:
    data = yaml.safe_load(REPO_PARAMS.read_text())
    data["iteration"] = policy.pop("iteration", data["iteration"])
    data["policy"].update(policy)
    return load_params(dump(tmp_path, data))


@pytest.mark.parametrize("policy, message", [
    ({"iteration": 3, "version": 4, "max_staleness": 1}, "policy.version must be within policy.max_staleness=1"),
    ({"iteration": 3, "version": 1, "max_staleness": 1}, "policy.version must be within policy.max_staleness=1"),
    ({"iteration": 3, "version": 3, "max_staleness": 1, "path": "state/sampler", "latest_path": "state/policy"},
     "policy.latest_path must equal policy.path when policy.version == iteration"),
    ({"max_staleness": -1}, "policy.max_staleness must be >= 0"),
])
def test_the_sampler_version_is_checked_against_the_staleness_bound(tmp_path, policy, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        params_with(tmp_path, **policy)


def test_an_overlapped_iteration_loads(tmp_path):
    p = params_with(tmp_path, iteration=3, version=2, max_staleness=1, path="state/sampler", latest_path="state/policy")
    assert (p.policy.version, p.policy.path, p.policy.latest_path) == (2, "state/sampler", "state/policy")


def rollouts_of(version: int | None, tmp_path) -> Artifact:
    return Artifact(frame=pl.DataFrame(), metadata={"policy_version": version}, path=tmp_path / "rollouts.parquet")


def test_train_checks_the_rollouts_sampler_and_its_staleness(tmp_path):
    ok = check_policy_version(rollouts_of(2, tmp_path), sampler_version=2, iteration=3, max_staleness=1,
                              policy_dir="state/policy", stored=3)
    assert ok == 1
    assert check_policy_version(rollouts_of(3, tmp_path), sampler_version=3, iteration=3, max_staleness=0,
                                policy_dir="state/policy", stored=3) == 0
    with pytest.raises(ArtifactError, match=r"sampled by policy version 1, but params policy.version is 2"):
        check_policy_version(rollouts_of(1, tmp_path), sampler_version=2, iteration=3, max_staleness=1,
                             policy_dir="state/policy", stored=3)
    with pytest.raises(ArtifactError, match=r"2 versions behind iteration 3; policy.max_staleness allows 1"):
        check_policy_version(rollouts_of(1, tmp_path), sampler_version=1, iteration=3, max_staleness=1,
                             policy_dir="state/policy", stored=3)
    with pytest.raises(ArtifactError, match=r"state/policy: holds policy version 2, but train starts iteration 3"):
        check_policy_version(rollouts_of(2, tmp_path), sampler_version=2, iteration=3, max_staleness=1,
                             policy_dir="state/policy", stored=2)


def test_importance_weights_are_pi_old_over_pi_sampler_per_token():
    # tokens: log pi_sampler [-1, -2 | -0.5], log pi_old [-1.5, -1 | -0.5]
    # weights exp(-0.5) = 0.606531, exp(1) = 2.718282, exp(0) = 1 -> mean 1.441604; above cap 2: 1 of 3
    frame = pl.DataFrame({"sampler_logprobs": [[-1.0, -2.0], [-0.5]], "policy_mask": [[True, True], [True]]})
    old = [[-1.5, -1.0], [-0.5]]
    w = importance_weights(frame, [np.asarray(x) for x in old], tis_cap=2.0)
    assert math.isclose(w["is_weight_mean"], (math.exp(-0.5) + math.e + 1.0) / 3, rel_tol=1e-12)
    assert math.isclose(w["is_weight_min"], math.exp(-0.5)) and math.isclose(w["is_weight_max"], math.e)
    assert w["is_weight_capped_fraction"] == pytest.approx(1 / 3)
    assert importance_weights(frame, [np.asarray(x) for x in old], tis_cap=None)[
        "is_weight_capped_fraction"] == 0.0
    # multi-turn: an observation token (sampler 0.0, no log-prob of the policy's) is no weight at all
    turns = pl.DataFrame({"sampler_logprobs": [[-1.0, 0.0, -2.0], [-0.5]],
                          "policy_mask": [[True, False, True], [True]]})
    assert importance_weights(turns, [np.asarray(x) for x in ([-1.5, -9.0, -1.0], [-0.5])], tis_cap=2.0) == w


def test_what_runs_ahead_is_what_does_not_wait_for_this_iteration(tmp_path):
    p = params_with(tmp_path)
    assert prefetchable(p) == ["generate", "score", "reference_logprob", "values"]
    data = yaml.safe_load(REPO_PARAMS.read_text())
    data["reference"]["refresh_every"] = 1  # iteration k+1's reference is iteration k's output
    data["advantage"]["estimator"] = "gae"  # its critic too
    assert prefetchable(load_params(dump(tmp_path, data))) == ["generate", "score"]
    # generation on GPUs of its own: the reference and values passes stay with the training GPUs
    split = split_params(tmp_path)
    assert prefetchable(split) == sampled_ahead(split, split.iteration + 1) == ["generate", "score"]
    assert sampled_ahead(params_with(tmp_path), 0) == ["generate", "score", "reference_logprob", "values"]
    # what the loop restores before it starts the next sampling: with shared devices all of sampling, as always
    from rlpipe.run.loop import sampling_targets

    assert sampling_targets(split) == ["generate", "score"]
    assert sampling_targets(params_with(tmp_path)) == ["advantage"]
    data["iteration"], data["policy"]["max_staleness"], data["policy"]["version"] = 4, 2, 3
    data["policy"]["path"], data["policy"]["latest_path"] = "state/sampler", "state/policy"
    assert next_sampling_params(load_params(dump(tmp_path, data))) == {
        "iteration": 5, "policy.version": 3, "policy.path": "state/sampler", "policy.latest_path": "state/policy"}


def model_dir(path: Path, version: int | None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "weights.bin").write_bytes(bytes([version or 0]) * 16)
    if version is not None:
        (path / "rlpipe.json").write_text(json.dumps({"policy_version": version}))
    return path


def test_the_policy_store_keeps_links_and_prunes_what_no_iteration_samples(tmp_path):
    root = tmp_path / "project"
    initial = model_dir(root / "artifacts/model", None)  # version 0: a plain model dir
    policies.keep(root, 0, initial)
    policies.keep(root, 1, model_dir(root / "ckpt1", 1))
    kept = policies.path_of(root, 1) / "weights.bin"
    assert kept.stat().st_ino == (root / "ckpt1/weights.bin").stat().st_ino  # a hard link, not a copy
    with pytest.raises(RlpipeError, match="holds policy version 1, not 2"):
        policies.keep(root, 2, root / "ckpt1")
    policies.prune(root, oldest_needed=1)
    assert sorted(p.name for p in (root / policies.STORE).iterdir()) == ["1"]
    with pytest.raises(RlpipeError, match="policy version 0 is not in"):
        policies.path_of(root, 0)


def test_the_scratch_project_keeps_the_remotes_their_default_and_keys_and_uses_the_projects_cache(tmp_path):
    """`cluster.data: remote` pushes through the default remote from the scratch copy too (it once lost
    `core.remote` and the keys of config.local, and the prefetch failed)."""
    dvc_dir = tmp_path / ".dvc"
    dvc_dir.mkdir()
    (dvc_dir / "config").write_text("[core]\n    autostage = true\n    remote = store\n"
                                    "['remote \"store\"']\n    url = s3://bucket/dvc\n[cache]\n    type = copy\n")
    (dvc_dir / "config.local").write_text("['remote \"store\"']\n    access_key_id = key\n[cache]\n    dir = ../../cache\n")
    configs = scratch_configs(dvc_dir)
    assert configs["config"] == ("['remote \"store\"']\n    url = s3://bucket/dvc\n"
                                 "[core]\n    no_scm = true\n    analytics = false\n    remote = store\n"
                                 f"[cache]\n    dir = {(tmp_path.parent / 'cache').resolve()}\n")
    assert configs["config.local"] == "['remote \"store\"']\n    access_key_id = key\n"
    (dvc_dir / "config.local").write_text("[core]\n    remote = other\n")  # the local default wins
    assert "    remote = other\n[cache]\n    dir = " + str(dvc_dir / "cache") + "\n" in scratch_configs(dvc_dir)["config"]


def split_params(tmp_path, *, staleness=1, generate="0", train="1", engine_server=True):
    data = yaml.safe_load(REPO_PARAMS.read_text())
    data["policy"]["max_staleness"] = staleness
    data["worker"].update(engine_server=engine_server, generate_devices=generate, train_devices=train)
    return load_params(dump(tmp_path, data))


@pytest.mark.parametrize("change, wanted", [({}, True), ({"staleness": 0}, False), ({"train": None}, False),
                                            ({"train": "0"}, False), ({"engine_server": False}, False)])
def test_a_train_engine_only_where_overlapped_generation_has_its_own_gpus(tmp_path, change, wanted):
    from rlpipe.run.servers import wants_train_engine

    assert wants_train_engine(split_params(tmp_path, **change)) is wanted


class FakeLifecycle:
    """What RunServers asked of rlpipe.worker.lifecycle, in order; the train engine's start can fail."""

    def __init__(self, tmp_path, *, train_engine_fails: bool) -> None:
        self.calls: list[tuple] = []
        self.tmp_path = tmp_path
        self.fails = train_engine_fails

    def launch(self, kind, root, args, *, env=None, owner=None):
        self.calls.append(("launch", kind, env["CUDA_VISIBLE_DEVICES"], "--sleep" in args,
                           Path(env["VLLM_CACHE_ROOT"]).name))
        return lifecycle.Launched(kind, Path(root), proc=None, log_path=self.tmp_path / f"{kind}.log")

    def wait_until_serving(self, started, *, timeout=900.0):
        self.calls.append(("wait", started.kind))
        if self.fails:
            raise RlpipeError(f"the {started.kind} server exited with code 1 while starting")
        return lifecycle.ServerInfo(started.kind, "@x", 1, {})

    @contextmanager
    def serving(self, kind, root, args, *, env=None):
        self.calls.append(("serving", kind, env.get("CUDA_VISIBLE_DEVICES")))
        yield

    def stop(self, kind, root, **_):
        self.calls.append(("stop", kind))


def fake_lifecycle(monkeypatch, tmp_path, *, train_engine_fails=False) -> FakeLifecycle:
    from rlpipe.run import servers

    fake = FakeLifecycle(tmp_path, train_engine_fails=train_engine_fails)
    for name in ("launch", "wait_until_serving", "serving", "stop"):
        monkeypatch.setattr(servers.lifecycle, name, getattr(fake, name))
    monkeypatch.setattr(servers, "is_policy_dir", lambda path: True)
    monkeypatch.delenv(servers.ENGINE_SERVER_ENV, raising=False)
    return fake


def test_the_train_engine_starts_beside_the_generation_engine_and_is_awaited_at_first_use(tmp_path, monkeypatch):
    import os

    from rlpipe.run import servers

    params = split_params(tmp_path)
    params = dataclasses.replace(params, worker=dataclasses.replace(params.worker, stage_server=False))
    fake = fake_lifecycle(monkeypatch, tmp_path)
    with servers.RunServers(tmp_path, params) as running:
        # both launched before anything waits: the two starts overlap, on their own GPUs and compile caches
        assert fake.calls == [("launch", "train-engine", "1", True, "vllm-train-engine"),
                              ("serving", "engine", "0")]
        for _ in range(2):
            with running.for_training(params):
                assert os.environ[servers.ENGINE_SERVER_ENV].startswith("@rlpipe-train-engine-")
        assert servers.ENGINE_SERVER_ENV not in os.environ
        assert fake.calls[2:] == [("wait", "train-engine")]  # awaited once
    assert fake.calls[-1] == ("stop", "train-engine")  # started by the run: stopped with it


def test_a_train_engine_that_cannot_start_leaves_evaluate_on_the_generation_engine(tmp_path, monkeypatch, capsys):
    import os

    from rlpipe.run import servers

    params = split_params(tmp_path)
    fake = fake_lifecycle(monkeypatch, tmp_path, train_engine_fails=True)
    running = servers.RunServers(tmp_path, params)
    running.engine_started = True  # as after the generation engine's start
    for _ in range(2):  # one try: no second start in the next iteration
        with running.for_training(params):
            assert servers.ENGINE_SERVER_ENV not in os.environ
    assert fake.calls == [("launch", "train-engine", "1", True, "vllm-train-engine"), ("wait", "train-engine")]
    assert "no train engine on GPUs 1, evaluate uses the generation engine" in capsys.readouterr().err
