"""VLLMEngine's adapter logic against a small fake of the vLLM API (no vllm, no GPU).

The fake mimics what rlpipe reads from vLLM 0.26: `LLM(**engine_args).generate(prompts, params, use_tqdm=)`
returns one RequestOutput per prompt, in prompt order, whose `outputs` hold n CompletionOutputs
(`index`, `token_ids` with the EOS included, `logprobs` as FlatLogprobs or a list of {id: Logprob},
`finish_reason`, `stop_reason`). Sample j of a request is a function of (prompt, seed + j) only, as
vLLM seeds its child requests. Switches reproduce the variations the adapter must survive.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import types
from pathlib import Path

import polars as pl
import pytest

from rlpipe.config import load_params
from rlpipe.data.io import read_artifact, validate_frame, write_artifact
from rlpipe.data.schema import ROLLOUTS
from rlpipe.engines import vllm as vllm_engine
from rlpipe.engines.base import Completion, GenerationEngine, PromptRequest, SamplingParams, derive_seed
from rlpipe.distributed import contiguous_blocks
from rlpipe.engines.vllm import VLLMEngine, replica_gpu_ids, to_completion, vllm_sampling_kwargs
from rlpipe.errors import ConfigError
from rlpipe.stages.generate import choose_engine, generate_rollouts, make_engine, rollout_frame
from tests.shipped import shipped_params

EOS = 2
VOCAB = 20
PARAMS = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=6)
REPO_PARAMS = shipped_params()


# ---------------------------------------------------------------------------------------------
# The fake vLLM


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class FlatLogprobs:
    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: object
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class FakeSamplingParams:
    FIELDS = {"n", "seed", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs",
              "flat_logprobs", "detokenize"}

    def __init__(self, **kwargs):
        unknown = set(kwargs) - self.FIELDS
        assert not unknown, f"not a SamplingParams field rlpipe should use: {unknown}"
        self.__dict__.update(kwargs)


def fake_sample(prompt: list[int], seed: int, max_tokens: int, stop: set[int]) -> tuple[list[int], list[float]]:
    """The tokens and log-probs vLLM would give for (prompt, child seed): a function of those alone."""
    rng = random.Random(f"{seed}:{prompt}")
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        token = EOS if rng.random() < 0.25 else rng.randrange(3, VOCAB)
        tokens.append(token)
        logprobs.append(-rng.random() * 3)
        if token in stop:
            break
    return tokens, logprobs


class FakeLLM:
    instances: list[FakeLLM] = []
    drop_eos = False  # a vLLM that leaves the stop token out of token_ids (log-prob kept)
    drop_eos_logprob = False  # ... and its log-prob too
    length_on_eos_at_cap = False  # reports "length" when the EOS is also the max_tokens-th token
    abort = False

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[list, list]] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        assert use_tqdm is False
        self.calls.append((prompts, sampling_params))
        results = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            outputs = [self._complete(j, prompt["prompt_token_ids"], sp) for j in range(sp.n)]
            random.Random(i).shuffle(outputs)  # vLLM aggregates children as they finish
            results.append(RequestOutput(str(i), prompt["prompt_token_ids"], outputs))
        return results

    def _complete(self, j, prompt, sp) -> CompletionOutput:
        tokens, logprobs = fake_sample(prompt, sp.seed + j, sp.max_tokens, set(sp.stop_token_ids))
        stopped = tokens[-1] in sp.stop_token_ids
        finish = "stop" if stopped and not (self.length_on_eos_at_cap and len(tokens) == sp.max_tokens) else "length"
        stop_reason = tokens[-1] if stopped else None
        if self.abort:
            finish = "abort"
        if stopped and self.drop_eos:
            tokens = tokens[:-1]
            if self.drop_eos_logprob:
                logprobs = logprobs[:-1]
        if sp.flat_logprobs:
            ids = tokens + ([stop_reason] if len(logprobs) > len(tokens) else [])
            lp = FlatLogprobs(list(range(len(logprobs))), list(range(1, len(logprobs) + 1)), ids, logprobs)
        else:
            lp = [{t: Logprob(x, rank=1)} for t, x in zip(tokens, logprobs)]
        return CompletionOutput(j, "", tokens, sum(logprobs), lp, finish, stop_reason)


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__version__ = "0.26.0-fake"
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    module.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", module)
    for switch in ("drop_eos", "drop_eos_logprob", "length_on_eos_at_cap", "abort"):
        monkeypatch.setattr(FakeLLM, switch, False)
    monkeypatch.setattr(FakeLLM, "instances", [])
    return module


def requests(count: int = 5, n: int = 4) -> list[PromptRequest]:
    return [PromptRequest(prompt_token_ids=tuple(range(3, 4 + i)), seed=derive_seed(7, i), n=n) for i in range(count)]


def expected(req: PromptRequest, j: int, max_tokens: int) -> tuple[list[int], list[float]]:
    return fake_sample(list(req.prompt_token_ids), vllm_engine.vllm_seed(req.seed) + j, max_tokens, {EOS})


# ---------------------------------------------------------------------------------------------
# Request building


def test_sampling_kwargs_map_rlpipe_params_to_vllm():
    kw = vllm_sampling_kwargs(PARAMS, n=8, seed=2**63 - 1, eos_token_ids=[2, 5])
    assert kw["n"] == 8 and kw["max_tokens"] == 6 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["top_k"] == -1  # rlpipe's 0 (off) is vLLM's -1
    assert vllm_sampling_kwargs(dataclasses.replace(PARAMS, top_k=5), n=1, seed=0, eos_token_ids=[2])["top_k"] == 5
    assert kw["logprobs"] == 0 and kw["stop_token_ids"] == [2, 5] and kw["detokenize"] is False
    # vLLM seeds child j with seed + j in int64: the seed keeps 62 bits, so + j cannot overflow.
    assert kw["seed"] == 2**62 - 1 and kw["seed"] + 8 < 2**63
    greedy = dataclasses.replace(PARAMS, temperature=0.0)
    assert vllm_sampling_kwargs(greedy, n=1, seed=0, eos_token_ids=[2])["temperature"] == 0.0
    with pytest.raises(ValueError, match="below vLLM's smallest"):
        vllm_sampling_kwargs(dataclasses.replace(PARAMS, temperature=0.005), n=1, seed=0, eos_token_ids=[2])


def test_engine_starts_vllm_with_processed_logprobs_and_the_settings(fake_vllm):
    engine = VLLMEngine("/models/policy", dtype="bfloat16", eos_token_ids=[EOS, EOS], tensor_parallel_size=2,
                        gpu_memory_utilization=0.5, enable_prefix_caching=False, enforce_eager=True, max_model_len=96)
    assert isinstance(engine, GenerationEngine) and engine.name == "vllm"
    (llm,) = FakeLLM.instances
    assert llm.kwargs == {
        "model": "/models/policy", "dtype": "bfloat16", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False, "enforce_eager": True, "max_model_len": 96, "seed": 0,
        "logprobs_mode": "processed_logprobs", "skip_tokenizer_init": True, "generation_config": "vllm",
    }
    assert engine.eos_token_ids == (EOS,)


# ---------------------------------------------------------------------------------------------
# Output mapping


def test_one_request_per_prompt_with_n_samples_seeds_and_order(fake_vllm):
    reqs = requests()
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    groups = engine.generate(reqs, PARAMS)
    (prompts, sampling), = FakeLLM.instances[0].calls
    assert [p["prompt_token_ids"] for p in prompts] == [list(r.prompt_token_ids) for r in reqs]
    assert [sp.n for sp in sampling] == [4] * 5
    assert [sp.seed for sp in sampling] == [vllm_engine.vllm_seed(r.seed) for r in reqs]
    assert len(groups) == len(reqs)
    for req, group in zip(reqs, groups):
        assert len(group) == req.n
        for j, c in enumerate(group):  # sample j in slot j although vLLM returned them shuffled
            tokens, logprobs = expected(req, j, PARAMS.max_new_tokens)
            assert c.token_ids == tokens and c.sampler_logprobs == pytest.approx(logprobs)
            assert c.finish_reason == ("stop" if tokens[-1] == EOS else "length")
    finishes = {c.finish_reason for g in groups for c in g}
    assert finishes == {"stop", "length"}  # the fixture exercises both


def test_same_seeds_give_the_same_samples_and_other_seeds_do_not(fake_vllm):
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    a = engine.generate(requests(), PARAMS)
    b = engine.generate(requests(), PARAMS)
    assert a == b
    other = [dataclasses.replace(r, seed=r.seed + 1) for r in requests()]
    assert engine.generate(other, PARAMS) != a


def test_dict_logprob_layout_gives_the_same_completions(fake_vllm, monkeypatch):
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    flat = engine.generate(requests(), PARAMS)
    real_kwargs = vllm_engine.vllm_sampling_kwargs
    monkeypatch.setattr(vllm_engine, "vllm_sampling_kwargs", lambda *a, **k: {**real_kwargs(*a, **k),
                                                                              "flat_logprobs": False})
    assert engine.generate(requests(), PARAMS) == flat


def test_eos_left_out_of_token_ids_is_put_back_with_its_logprob(fake_vllm):
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    reference = engine.generate(requests(), PARAMS)
    FakeLLM.drop_eos = True
    assert engine.generate(requests(), PARAMS) == reference
    FakeLLM.drop_eos_logprob = True
    with pytest.raises(RuntimeError, match="neither the token nor its log-prob"):
        engine.generate(requests(), PARAMS)


def test_eos_as_the_last_allowed_token_is_a_stop(fake_vllm):
    FakeLLM.length_on_eos_at_cap = True
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    params = dataclasses.replace(PARAMS, max_new_tokens=2)
    groups = engine.generate(requests(count=8), params)
    at_cap = [c for g in groups for c in g if len(c.token_ids) == 2 and c.token_ids[-1] == EOS]
    assert at_cap and all(c.finish_reason == "stop" for c in at_cap)


def test_aborted_or_unknown_stops_fail_loudly(fake_vllm):
    FakeLLM.abort = True
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS])
    with pytest.raises(RuntimeError, match="'abort'"):
        engine.generate(requests(), PARAMS)
    foreign = CompletionOutput(0, "", [5, 6], None, [{5: Logprob(-1.0)}, {6: Logprob(-2.0)}], "stop", "###")
    with pytest.raises(RuntimeError, match="no rlpipe EOS"):
        to_completion(foreign, eos_token_ids=[EOS])


def test_logprob_entries_must_start_with_the_sampled_token():
    bad = CompletionOutput(0, "", [5, 6], None, FlatLogprobs([0, 1], [1, 2], [5, 9], [-1.0, -2.0]), "length")
    with pytest.raises(RuntimeError, match="sampled tokens"):
        to_completion(bad, eos_token_ids=[EOS])
    missing = CompletionOutput(0, "", [5], None, None, "length")
    with pytest.raises(RuntimeError, match="no log-probs"):
        to_completion(missing, eos_token_ids=[EOS])


# ---------------------------------------------------------------------------------------------
# Through rollout_frame to the Parquet contract


def test_vllm_results_make_a_valid_rollout_table(fake_vllm, tmp_path):
    cfg = dataclasses.replace(load_params(REPO_PARAMS).generate, engine="vllm", device="cuda", group_size=3,
                              temperature=PARAMS.temperature, top_p=PARAMS.top_p, top_k=4, max_new_tokens=5)
    engine = make_engine(cfg, engine="vllm", model_dir="m", eos_token_ids=[EOS], pad_token_id=0)
    prompts = pl.DataFrame({"prompt_id": pl.Series([10, 11, 12, 13], dtype=pl.Int64),
                            "prompt_token_ids": [[1, 3], [1, 4, 5], [1, 6], [1, 7, 8, 9]]})
    rollouts = generate_rollouts(engine, prompts, cfg=cfg, seed=1, iteration=0, policy_version=0,
                                 decode=lambda ids: str(ids))
    (_, sampling), = FakeLLM.instances[0].calls
    assert {sp.top_k for sp in sampling} == {4}
    path = write_artifact(rollouts, tmp_path / "rollouts.parquet", ROLLOUTS, metadata={"engine": engine.name})
    table = read_artifact(path, ROLLOUTS).frame
    validate_frame(table, ROLLOUTS)
    assert table.height == 12
    assert table["completion_length"].to_list() == table["completion_token_ids"].list.len().to_list()
    assert table["completion_length"].to_list() == table["sampler_logprobs"].list.len().to_list()
    ends_with_eos = table["completion_token_ids"].list.last() == EOS
    assert (table["finish_reason"] == "stop").to_list() == ends_with_eos.to_list()
    assert table["truncated"].to_list() == (~ends_with_eos).to_list()


def test_rollout_frame_keeps_the_request_order(fake_vllm):
    reqs = requests(count=3, n=2)
    groups = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS]).generate(reqs, PARAMS)
    prompts = pl.DataFrame({"prompt_id": pl.Series([5, 3, 9], dtype=pl.Int64),
                            "prompt_token_ids": [list(r.prompt_token_ids) for r in reqs]})
    frame = rollout_frame(prompts, reqs, groups, policy_version=0, decode=str)
    assert frame["prompt_id"].to_list() == [5, 5, 3, 3, 9, 9]
    assert frame["completion_token_ids"].to_list() == [c.token_ids for g in groups for c in g]


# ---------------------------------------------------------------------------------------------
# Data parallelism: replicas, shards, GPUs


class InProcessReplica(vllm_engine._LocalReplica):
    """Stands in for the child-process replica: same calls, no process."""

    def __init__(self, llm_kwargs, eos_token_ids, gpu_ids):
        super().__init__(llm_kwargs, eos_token_ids)
        self.gpu_ids = gpu_ids

    def wait_ready(self):
        pass


def test_data_parallel_replicas_split_prompts_and_give_the_same_samples(fake_vllm, monkeypatch):
    reqs = requests(count=7)
    single = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS]).generate(reqs, PARAMS)
    monkeypatch.setattr(vllm_engine, "_ProcessReplica", InProcessReplica)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS], tensor_parallel_size=2, data_parallel_size=2)
    assert [r.gpu_ids for r in engine._replicas] == [["4", "5"], ["6", "7"]]
    finished = []
    assert engine.generate(reqs, PARAMS, progress=finished.append) == single
    shard_sizes = [len(llm.calls[0][0]) for llm in FakeLLM.instances[1:]]
    assert shard_sizes == [4, 3] and finished == [16, 12]


class RecordedReplica(InProcessReplica):
    """An in-process replica that logs when it starts and when the engine waits for it to be ready."""
    log: list[tuple[str, tuple[str, ...]]] = []

    def __init__(self, llm_kwargs, eos_token_ids, gpu_ids):
        RecordedReplica.log.append(("start", tuple(gpu_ids)))
        super().__init__(llm_kwargs, eos_token_ids, gpu_ids)

    def wait_ready(self):
        RecordedReplica.log.append(("ready", tuple(self.gpu_ids)))


def test_engines_sharing_a_gpu_start_in_waves_with_a_share_of_its_memory(fake_vllm, monkeypatch):
    reqs = requests(count=7)
    single = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS]).generate(reqs, PARAMS)
    RecordedReplica.log = []
    monkeypatch.setattr(vllm_engine, "_ProcessReplica", RecordedReplica)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    engine = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS], data_parallel_size=2, engines_per_gpu=2,
                        gpu_memory_utilization=0.8)
    # one engine on each GPU, both ready, then the second engine of each GPU: each sizes its KV cache from
    # the memory the first one left
    assert RecordedReplica.log == [("start", ("4",)), ("start", ("5",)), ("ready", ("4",)), ("ready", ("5",)),
                                   ("start", ("4",)), ("start", ("5",)), ("ready", ("4",)), ("ready", ("5",))]
    assert [llm.kwargs["gpu_memory_utilization"] for llm in FakeLLM.instances[1:]] == [0.4] * 4
    assert engine.generate(reqs, PARAMS) == single
    assert [len(llm.calls[0][0]) for llm in FakeLLM.instances[1:]] == [2, 2, 2, 1]


def test_engines_per_gpu_below_one_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="engines_per_gpu must be >= 1, got 1, 1 and 0"):
        VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS], engines_per_gpu=0)


def test_shards_and_gpu_assignment():
    assert contiguous_blocks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert contiguous_blocks(1, 2) == [(0, 1), (1, 1)]
    assert contiguous_blocks(0, 2) == [(0, 0), (0, 0)]
    assert replica_gpu_ids(1, 2, None) == ["2", "3"]
    assert replica_gpu_ids(0, 1, ["3"]) == ["3"]
    with pytest.raises(ValueError, match="must fit the visible GPUs"):
        replica_gpu_ids(1, 2, ["0", "1", "2"])


# ---------------------------------------------------------------------------------------------
# Engine choice


@pytest.fixture
def generate_cfg():
    return load_params(REPO_PARAMS).generate


def test_auto_picks_vllm_only_on_cuda_with_vllm_importable(generate_cfg, fake_vllm, monkeypatch):
    import torch

    auto_cuda = dataclasses.replace(generate_cfg, engine="auto", device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_engine(auto_cuda) == "vllm"
    assert choose_engine(dataclasses.replace(auto_cuda, device="cpu")) == "hf"
    assert choose_engine(dataclasses.replace(auto_cuda, engine="hf")) == "hf"
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    assert choose_engine(auto_cuda) == "hf"
    assert choose_engine(dataclasses.replace(auto_cuda, engine="vllm")) == "vllm"  # named: no fallback
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_engine(auto_cuda) == "hf"


def test_make_engine_refuses_what_vllm_cannot_do(generate_cfg, fake_vllm):
    cfg = dataclasses.replace(generate_cfg, engine="vllm", device="cpu")
    with pytest.raises(ConfigError, match="generate.device"):
        make_engine(cfg, engine="vllm", model_dir="m", eos_token_ids=[EOS], pad_token_id=0)
    cold = dataclasses.replace(cfg, device="cuda", temperature=0.005)
    with pytest.raises(ConfigError, match="generate.temperature"):
        make_engine(cold, engine="vllm", model_dir="m", eos_token_ids=[EOS], pad_token_id=0)
    with pytest.raises(ConfigError, match="unknown engine"):
        make_engine(cfg, engine="sglang", model_dir="m", eos_token_ids=[EOS], pad_token_id=0)
    assert not FakeLLM.instances


def test_make_engine_passes_the_vllm_section(generate_cfg, fake_vllm):
    vcfg = dataclasses.replace(generate_cfg.vllm, gpu_memory_utilization=0.6, max_model_len=128, enforce_eager=True)
    cfg = dataclasses.replace(generate_cfg, engine="vllm", device="cuda", dtype="bfloat16", vllm=vcfg)
    engine = make_engine(cfg, engine="vllm", model_dir="m", eos_token_ids=[EOS], pad_token_id=0)
    assert engine.name == "vllm"
    kwargs = FakeLLM.instances[0].kwargs
    assert (kwargs["gpu_memory_utilization"], kwargs["max_model_len"], kwargs["enforce_eager"]) == (0.6, 128, True)
    assert kwargs["dtype"] == "bfloat16" and kwargs["tensor_parallel_size"] == vcfg.tensor_parallel_size


def test_make_engine_passes_engines_per_gpu(generate_cfg, fake_vllm, monkeypatch):
    monkeypatch.setattr(vllm_engine, "_ProcessReplica", InProcessReplica)
    vcfg = dataclasses.replace(generate_cfg.vllm, gpu_memory_utilization=0.8, engines_per_gpu=4)
    cfg = dataclasses.replace(generate_cfg, engine="vllm", device="cuda", dtype="bfloat16", vllm=vcfg)
    engine = make_engine(cfg, engine="vllm", model_dir="m", eos_token_ids=[EOS], pad_token_id=0)
    assert len(engine._replicas) == 4
    assert [llm.kwargs["gpu_memory_utilization"] for llm in FakeLLM.instances] == [0.2] * 4


def test_completion_contract_holds_for_mapped_outputs(fake_vllm):
    groups = VLLMEngine("m", dtype="bfloat16", eos_token_ids=[EOS]).generate(requests(), PARAMS)
    for c in (c for g in groups for c in g):
        assert isinstance(c, Completion) and 1 <= len(c.token_ids) <= PARAMS.max_new_tokens
        assert EOS not in c.token_ids[:-1]
