"""A LoRA policy reaches every engine: vLLM (a fake of its API) runs the base with a LoRARequest per request and a
new adapter id for new weights; the engine server's fingerprint includes the adapter and its base."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from collections import namedtuple

import pytest

from rlpipe.config import load_params
from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
from rlpipe.engines.hf import HFEngine
from rlpipe.engines.vllm import vllm_lora_rank
from rlpipe.errors import ConfigError
from rlpipe.models.loading import load_model
from rlpipe.models.lora.adapter import model_hash
from rlpipe.models.lora.peft_model import save_adapter, wrap_for_training
from rlpipe.stages.generate import make_engine
from rlpipe.worker.engine_server import EngineHost, weights_fingerprint

from tests.engines.test_vllm_adapter import REPO_PARAMS, FakeLLM, fake_vllm  # noqa: F401  (fixture)
from tests.models.lora.conftest import lora, perturb_adapter

BASE = "artifacts/prepare/model"
LoRARequest = namedtuple("LoRARequest", "lora_name lora_int_id lora_path")
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4)
REQUESTS = [PromptRequest((3, 4, 12), seed=derive_seed(1, i), n=3) for i in range(3)]
VLLM_SERVER_SETTINGS = {"engine": "vllm", "dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1,
                        "gpu_memory_utilization": 0.5, "enable_prefix_caching": True, "enforce_eager": True,
                        "max_model_len": None}


class LoraFakeLLM(FakeLLM):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lora_requests: list = []
        self.reloads: list = []
        self.sleeps: list = []

    def generate(self, prompts, sampling_params, *, use_tqdm=True, lora_request=None):
        self.lora_requests.append(lora_request)
        return super().generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def collective_rpc(self, method, kwargs):
        self.reloads.append((method, kwargs))

    def sleep(self, level):
        self.sleeps.append(level)

    def wake_up(self):
        pass

    def reset_prefix_cache(self):
        pass


@pytest.fixture
def lora_vllm(fake_vllm, monkeypatch):  # noqa: F811
    fake_vllm.LLM = LoraFakeLLM
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    return fake_vllm


def adapter(out="ckpt", seed=1, **over):
    peft_model = wrap_for_training(load_model(BASE, device="cpu", dtype="float32"), lora(**over))
    perturb_adapter(peft_model, seed=seed)
    save_adapter(peft_model, out, policy_version=1, base_path=BASE, base_hash=model_hash(BASE))
    return out


def vllm_cfg():
    g = load_params(REPO_PARAMS).generate
    return dataclasses.replace(g, engine="vllm", device="cuda", dtype="bfloat16")


def test_vllm_lora_ranks_round_up_to_what_vllm_compiles():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 33)] == [1, 8, 8, 16, 16, 64]
    with pytest.raises(ValueError):
        vllm_lora_rank(1000)


def test_vllm_serves_an_adapter_over_its_base_with_a_lora_request(project, lora_vllm):
    engine = make_engine(vllm_cfg(), engine="vllm", model_dir=adapter(), eos_token_ids=[2], pad_token_id=0)
    (llm,) = FakeLLM.instances
    assert llm.kwargs["model"] == BASE  # the base, unmerged; the adapter goes with each request
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"], llm.kwargs["max_loras"]) == (True, 8, 1)
    engine.generate(REQUESTS, PARAMS)
    (req,) = llm.lora_requests
    assert req.lora_int_id == 1 and req.lora_path == str((project / "ckpt").resolve())
    engine.use_adapter("ckpt")  # new weights in the same directory: a new id, never vLLM's cached adapter
    engine.generate(REQUESTS, PARAMS)
    assert llm.lora_requests[-1].lora_int_id == 2


def test_vllm_refuses_an_adapter_that_trains_the_head_in_full(project, lora_vllm):
    path = adapter(train_lm_head=True, train_embeddings=True)
    with pytest.raises(ConfigError, match=r"generate.engine: .*vLLM cannot serve as LoRA; use the hf engine"):
        make_engine(vllm_cfg(), engine="vllm", model_dir=path, eos_token_ids=[2], pad_token_id=0)


def test_vllm_engine_server_swaps_adapters_without_reloading_the_base(project, lora_vllm):
    host = EngineHost(VLLM_SERVER_SETTINGS, BASE, sleep=False, max_lora_rank=16)  # a LoRA run's server starts on the base
    (llm,) = FakeLLM.instances
    assert llm.kwargs["max_lora_rank"] == 16
    host.generate(BASE, REQUESTS, PARAMS)
    assert llm.lora_requests == [None]
    host.generate(adapter(), REQUESTS, PARAMS)
    adapter("ckpt", seed=2)  # the next iteration's adapter, same directory
    host.generate("ckpt", REQUESTS, PARAMS)
    assert len(FakeLLM.instances) == 1 and llm.reloads == []  # no rebuild, the base never reloaded
    assert [r.lora_int_id for r in llm.lora_requests[1:]] == [1, 2]


def test_a_sleeping_lora_engine_keeps_its_base_and_a_new_base_gets_a_new_engine(project, lora_vllm, tmp_path):
    """vLLM cannot load a checkpoint's plain names into LoRA-wrapped layers (`embed_tokens.weight` against
    `embed_tokens.base_layer.weight`, seen on an H200): asleep, the base waits in CPU memory (level 1)."""
    host = EngineHost(VLLM_SERVER_SETTINGS, BASE, sleep=True, max_lora_rank=16)
    (llm,) = FakeLLM.instances
    for policy in (BASE, adapter(), adapter("ckpt", seed=2)):
        _, timings = host.generate(policy, REQUESTS, PARAMS)
        assert timings["rebuild"] == 0.0
    assert llm.reloads == [] and llm.sleeps == [1, 1, 1, 1]  # after the build, then after each request
    assert [r and r.lora_int_id for r in llm.lora_requests] == [None, 1, 2]
    with pytest.raises(ValueError, match="cannot reload base weights"):
        host.engine.reload_weights(BASE)

    shutil.copytree(BASE, tmp_path / "other_base")  # the same architecture, other files: another base
    _, timings = host.generate(str(tmp_path / "other_base"), REQUESTS, PARAMS)
    assert timings["rebuild"] > 0 and len(FakeLLM.instances) == 2 and FakeLLM.instances[1].reloads == []


def test_a_sleeping_engine_without_lora_drops_its_weights_and_reloads_them(project, lora_vllm):
    host = EngineHost(VLLM_SERVER_SETTINGS, BASE, sleep=True)
    (llm,) = FakeLLM.instances
    host.generate(BASE, REQUESTS, PARAMS)
    assert llm.sleeps == [2, 2] and [m for m, _ in llm.reloads] == ["reload_weights"]


def test_engine_server_fingerprint_covers_adapter_and_base(project):
    before = weights_fingerprint(adapter())
    assert weights_fingerprint("ckpt") == before
    info = json.loads((project / "ckpt/rlpipe.json").read_text())
    adapter("ckpt", seed=3)
    assert weights_fingerprint("ckpt") != before
    assert json.loads((project / "ckpt/rlpipe.json").read_text())["base_model_hash"] == info["base_model_hash"]


def test_hf_engine_server_samples_the_adapter(project):
    settings = {"engine": "hf", "device": "cpu", "dtype": "float32", "batch_size": 8}
    host = EngineHost(settings, BASE, sleep=False)
    on_base, _ = host.generate(BASE, REQUESTS, PARAMS)
    on_adapter, timings = host.generate(adapter(), REQUESTS, PARAMS)
    direct = HFEngine.from_model(load_model("ckpt", device="cpu", dtype="float32"), batch_size=8,
                                 eos_token_ids=host.settings["eos_token_ids"], pad_token_id=0).generate(REQUESTS, PARAMS)
    assert on_adapter == direct and on_adapter != on_base and timings["reload"] > 0
