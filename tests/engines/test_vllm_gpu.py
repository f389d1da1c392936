"""VLLMEngine on a real GPU with a tiny Llama: structure, seeding, greedy and log-probs against the HF path.

Skipped without CUDA or vllm. On the device machine (see benchmarks/vllm_generate.md for the recipe):
    python -m pytest tests/engines/test_vllm_gpu.py -m gpu -s
Set RLPIPE_GPU_REPORT=path.json to get the measured differences as JSON.

The reference is rlpipe's own CPU float32 path on the same weights rounded to bfloat16 (vLLM runs
them in bfloat16), so the differences left are those of bf16 activations and other kernels.
No process here touches CUDA before vLLM starts: every torch computation in this file runs on the CPU.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.varied_tiny import reference_logprobs as _reference_logprobs
from tests.varied_tiny import varied_tiny_llama

pytestmark = pytest.mark.gpu

# |vLLM - reference| of a sampled token's log-prob. Measured on an H200 (vLLM 0.26.0): mean ~0.02, p99 ~0.07,
# max ~0.10 -- bf16 activations against fp32 ones, on weights of std 0.15 (larger activations than a trained model's).
LOGPROB_MEAN_TOL = 0.04
LOGPROB_TOL = 0.15
GREEDY_TIE = 0.1  # greedy may diverge only where the reference's top two log-probs are closer than this
MAX_NEW = 16
REPORT: dict[str, float | int | str] = {}


def _needs_gpu_and_vllm() -> None:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model_dir, tokenizer, cpu reference model with bf16-rounded weights, prompt token ids)."""
    _needs_gpu_and_vllm()
    tokenizer, model = varied_tiny_llama(seed=0)
    path = tmp_path_factory.mktemp("tiny_vllm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+34=", "7+8=", "99+1=", "40+55=", "3+", "1")]
    return path, tokenizer, model.eval(), prompts


@pytest.fixture(scope="module")
def engine(tiny):
    from rlpipe.engines.vllm import VLLMEngine

    path, tokenizer, _, _ = tiny
    with VLLMEngine(path, dtype="bfloat16", eos_token_ids=[tokenizer.eos_token_id], gpu_memory_utilization=0.3,
                    enable_prefix_caching=True, enforce_eager=True, max_model_len=64) as eng:
        yield eng
    if path := os.environ.get("RLPIPE_GPU_REPORT"):
        Path(path).write_text(json.dumps(REPORT, indent=1, sort_keys=True) + "\n")


def _requests(prompts, *, n, salt=0):
    from rlpipe.engines.base import PromptRequest, derive_seed

    return [PromptRequest(prompt_token_ids=tuple(p), seed=derive_seed(salt, i), n=n) for i, p in enumerate(prompts)]


def _flat(groups):
    return [c for g in groups for c in g]


def test_structure_n_samples_aligned_lists_and_finish_reasons(engine, tiny):
    from rlpipe.engines.base import SamplingParams

    _, tokenizer, _, prompts = tiny
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)
    groups = engine.generate(_requests(prompts, n=6), params)
    assert len(groups) == len(prompts) and all(len(g) == 6 for g in groups)
    for c in _flat(groups):
        assert 1 <= len(c.token_ids) == len(c.sampler_logprobs) <= MAX_NEW
        assert all(math.isfinite(x) and x <= 1e-6 for x in c.sampler_logprobs)
        assert eos not in c.token_ids[:-1]
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == MAX_NEW
    reasons = [c.finish_reason for c in _flat(groups)]
    REPORT["stop_share"] = reasons.count("stop") / len(reasons)
    assert any(len({tuple(c.token_ids) for c in g}) > 1 for g in groups)  # the n samples of a prompt differ


def test_same_seeds_same_samples_other_seeds_other_samples(engine, tiny):
    from rlpipe.engines.base import SamplingParams

    prompts = tiny[3]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)
    first = engine.generate(_requests(prompts, n=4), params)
    second = engine.generate(_requests(prompts, n=4), params)  # prompts now come from the prefix cache
    assert [c.token_ids for c in _flat(first)] == [c.token_ids for c in _flat(second)]
    # Alone in a batch, a prompt gives the same samples: nothing depends on its neighbours.
    alone = engine.generate(_requests(prompts, n=4)[2:3], params)
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in first[2]]
    other = engine.generate(_requests(prompts, n=4, salt=1), params)
    assert [c.token_ids for c in _flat(other)] != [c.token_ids for c in _flat(first)]
    REPORT["reruns_identical"] = 1


def test_greedy_matches_the_hf_engine(engine, tiny):
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.hf import HFEngine

    _, tokenizer, model, prompts = tiny
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)
    got = _flat(engine.generate(_requests(prompts, n=1), params))
    hf = HFEngine.from_model(model, batch_size=16, eos_token_ids=[tokenizer.eos_token_id],
                             pad_token_id=tokenizer.pad_token_id)
    want = _flat(hf.generate(_requests(prompts, n=1), params))
    diverged = 0
    for prompt, g, w in zip(prompts, got, want):
        if g.token_ids == w.token_ids:
            continue
        t = next(i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([list(prompt) + w.token_ids[:t]])).logits[0, -1].float(), -1)
        gap = float(lp[w.token_ids[t]] - lp[g.token_ids[t]])
        assert gap < GREEDY_TIE, f"greedy diverged at token {t} with a top-2 gap of {gap:.3f}"
        diverged += 1
    REPORT["greedy_completions"] = len(got)
    REPORT["greedy_diverged_at_near_ties"] = diverged
    # Greedy log-probs are the untempered softmax, as in the HF engine.
    same = [(g, w) for g, w in zip(got, want) if g.token_ids == w.token_ids]
    diff = max(abs(a - b) for g, w in same for a, b in zip(g.sampler_logprobs, w.sampler_logprobs))
    REPORT["greedy_logprob_max_abs_diff"] = diff
    assert diff < LOGPROB_TOL


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.8)])
def test_sampled_logprobs_are_those_of_the_distribution_sampled_from(engine, tiny, temperature, top_k, top_p):
    from rlpipe.engines.base import SamplingParams

    _, _, model, prompts = tiny
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=MAX_NEW)
    groups = engine.generate(_requests(prompts, n=4, salt=7), params)
    flat_prompts = [p for p, g in zip(prompts, groups) for _ in g]
    completions = _flat(groups)
    ref = _reference_logprobs(model, flat_prompts, [c.token_ids for c in completions],
                              temperature=temperature, top_k=top_k, top_p=top_p)
    diffs = sorted(abs(a - b) for c, r in zip(completions, ref) for a, b in zip(c.sampler_logprobs, r))
    finite = [d for d in diffs if math.isfinite(d)]
    key = f"T{temperature}_k{top_k}_p{top_p}"
    REPORT[f"tokens_{key}"] = len(diffs)
    REPORT[f"logprob_mean_abs_diff_{key}"] = sum(finite) / len(finite)
    REPORT[f"logprob_p99_abs_diff_{key}"] = diffs[int(0.99 * (len(diffs) - 1))]
    REPORT[f"logprob_max_abs_diff_{key}"] = diffs[-1]
    assert sum(finite) / len(finite) < LOGPROB_MEAN_TOL
    # A top-p boundary can fall differently in bf16 for a rare position (the reference then gives the
    # token -inf): allow one in a hundred.
    assert diffs[int(0.99 * (len(diffs) - 1))] < LOGPROB_TOL
    if top_p == 1.0:
        assert diffs[-1] < LOGPROB_TOL
    # Processed, not raw: temperature and truncation are in the numbers, far beyond the bf16 noise.
    raw = _reference_logprobs(model, flat_prompts, [c.token_ids for c in completions], temperature=1.0)
    off = sum(abs(a - b) for c, r in zip(completions, raw) for a, b in zip(c.sampler_logprobs, r)) / len(diffs)
    REPORT[f"mean_abs_diff_to_raw_logprobs_{key}"] = off
    assert off > 4 * sum(finite) / len(finite)


def test_generate_stage_picks_vllm_and_writes_valid_rollouts(tiny, tmp_path):
    """stages/generate.py end to end with engine auto on a GPU: vLLM chosen, no HF model loaded, valid table."""
    _needs_gpu_and_vllm()
    pl = pytest.importorskip("polars")
    import yaml

    from rlpipe.data.io import read_artifact, read_metadata, write_artifact
    from rlpipe.data.schema import PROMPTS, ROLLOUTS

    path, tokenizer, _, _ = tiny
    repo = Path(__file__).resolve().parents[2]
    texts = [f"{a}+{b}=" for a, b in ((1, 2), (34, 56), (7, 80), (99, 9))]
    prompts = pl.DataFrame({"prompt_id": pl.Series(range(len(texts)), dtype=pl.Int64), "prompt": texts,
                            "prompt_token_ids": [tokenizer(t)["input_ids"] for t in texts],
                            "answer": ["3", "90", "87", "108"], "metadata": ["{}"] * len(texts)})
    write_artifact(prompts, tmp_path / "prompts.parquet", PROMPTS)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["generate"].update(engine="auto", device="cuda", dtype="bfloat16", prompts_per_iteration=0,
                              group_size=4, max_new_tokens=8)
    params["generate"]["vllm"].update(gpu_memory_utilization=0.3, enforce_eager=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [sys.executable, str(repo / "stages/generate.py"), "--params", str(tmp_path / "params.yaml"),
           "--prompts", str(tmp_path / "prompts.parquet"), "--policy", str(path),
           "--out", str(tmp_path / "rollouts.parquet"), "--metrics", str(tmp_path / "generate.json")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "generate.json").read_text())
    assert metrics["engine"] == "vllm" and metrics["num_samples"] == 16
    assert read_metadata(tmp_path / "rollouts.parquet")["engine"] == "vllm"
    table = read_artifact(tmp_path / "rollouts.parquet", ROLLOUTS).frame
    assert table["completion_length"].to_list() == table["sampler_logprobs"].list.len().to_list()
    REPORT["stage_seconds"] = json.dumps(metrics["seconds"])
    if path := os.environ.get("RLPIPE_GPU_REPORT"):
        Path(path).with_suffix(".stage.json").write_text(json.dumps(metrics, indent=1) + "\n")


def _compare_with_one_engine(one, groups, key: str) -> None:
    """Samples of several replicas (4 per request) against one engine's for the same requests: the same tokens
    but for rare bf16 near-ties (batch composition differs), and the same log-probs where the tokens agree."""
    assert [len(g) for g in groups] == [4] * len(groups)
    many = _flat(groups)
    same = [a.token_ids == b.token_ids for a, b in zip(one, many)]
    REPORT[f"{key}_identical_samples"] = f"{sum(same)}/{len(same)}"
    assert len(many) == len(one) and sum(same) >= 0.9 * len(same)
    diffs = [abs(x - y) for a, b, s in zip(one, many, same) if s for x, y in zip(a.sampler_logprobs, b.sampler_logprobs)]
    REPORT[f"{key}_max_logprob_diff"] = max(diffs)
    assert max(diffs) < 0.05


def test_two_data_parallel_replicas_sample_what_one_engine_samples(engine, tiny):
    """data_parallel_size 2: one replica process per GPU, prompts split in two contiguous shards, results
    back in request order; each request's own seed makes the samples those of one engine."""
    _needs_gpu_and_vllm()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.vllm import VLLMEngine

    path, tokenizer, _, prompts = tiny
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)
    requests = _requests(prompts * 5, n=4, salt=11)  # 30 requests: shards of 15
    one = _flat(engine.generate(requests, params))
    with VLLMEngine(path, dtype="bfloat16", eos_token_ids=[tokenizer.eos_token_id], data_parallel_size=2,
                    gpu_memory_utilization=0.3, enable_prefix_caching=True, enforce_eager=True,
                    max_model_len=64) as replicas:
        groups = replicas.generate(requests, params)
    _compare_with_one_engine(one, groups, "data_parallel")


def test_two_engines_on_one_gpu_sample_what_one_engine_samples(engine, tiny):
    """engines_per_gpu 2: two replica processes share the GPU, each with half of gpu_memory_utilization,
    the second started once the first is ready; each request's own seed makes the samples those of one engine."""
    _needs_gpu_and_vllm()
    from rlpipe.engines.base import SamplingParams
    from rlpipe.engines.vllm import VLLMEngine, replica_gpu_ids, visible_gpu_ids

    path, tokenizer, _, prompts = tiny
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)
    requests = _requests(prompts * 5, n=4, salt=13)
    first_gpu = replica_gpu_ids(0, 1, visible_gpu_ids())
    one = _flat(engine.generate(requests, params))
    with VLLMEngine(path, dtype="bfloat16", eos_token_ids=[tokenizer.eos_token_id], engines_per_gpu=2,
                    gpu_memory_utilization=0.3, enable_prefix_caching=True, enforce_eager=True,
                    max_model_len=64) as shared:
        assert [r.gpu_ids for r in shared._replicas] == [first_gpu, first_gpu]
        groups = shared.generate(requests, params)
    _compare_with_one_engine(one, groups, "engines_per_gpu")


# ---------------------------------------------------------------------------------------------
# Multi-turn (rlpipe/environments): every turn continues the sample's whole prefix with its own seed

# A chat template for the tiny character tokenizer: an assistant turn ends with <eos>, any other message
# is its content then "=" (the observation suffix after an assistant turn is "<digits>=").
TINY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
                 "{% else %}{{ m['content'] + '=' }}{% endif %}{% endfor %}")


def test_multi_turn_rollouts_on_vllm_are_token_exact(engine, tiny):
    """The ids vLLM was asked to continue are the table's prefixes, and the CPU reference's log-probs of the
    table's policy tokens match vLLM's own (bf16 noise); observation tokens carry none."""
    import copy

    import polars as pl

    from rlpipe.config import EnvironmentConfig
    from rlpipe.engines.base import SamplingParams
    from rlpipe.environments.driver import Driver
    from rlpipe.environments.template import ChatRenderer
    from tests.environments.echo import Echo

    _, tokenizer, model, _ = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TINY_TEMPLATE
    asked = []

    class Recording:
        name = "vllm"

        def generate(self, requests, params, *, progress=None):
            asked.extend(tuple(r.prompt_token_ids) for r in requests)
            return engine.generate(requests, params)

    eos = [tokenizer.eos_token_id]
    env = EnvironmentConfig(name="echo", options={}, max_turns=3, max_total_tokens=48, tool_timeout_s=10.0,
                            step_timeout_s=60.0, workers=4, prompts_per_chunk=3, chunks_in_flight=2)
    driver = Driver(Recording(), sampling=SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW),
                    group_size=8, env=env, env_cls=Echo, tokenizer=tokenizer,
                    renderer=ChatRenderer(tokenizer, eos_token_ids=eos, source="tiny"), eos_token_ids=eos,
                    tokenizer_hash="")
    texts = ["12+34=", "7+8=", "99+1=", "40+55=", "3+3=", "1+1="]
    prompts = pl.DataFrame({"prompt_id": list(range(6)), "prompt": texts,
                            "prompt_token_ids": [tokenizer(t)["input_ids"] for t in texts],
                            "answer": [None] * 6, "metadata": ["{}"] * 6}, schema_overrides={"answer": pl.String})
    out = driver.run(prompts, [11 * i for i in range(6)])
    rows = list(out.iter_rows(named=True))
    prefixes = {tuple(r["prompt_token_ids"] + r["completion_token_ids"][:s]) for r in rows for s in r["turn_starts"]}
    assert set(asked) <= prefixes
    REPORT["multi_turn_rollouts"] = len(rows)
    REPORT["multi_turn_rows_with_2_plus_turns"] = sum(r["num_turns"] > 1 for r in rows)
    assert REPORT["multi_turn_rows_with_2_plus_turns"] >= 4
    ref = _reference_logprobs(model, [r["prompt_token_ids"] for r in rows], [r["completion_token_ids"] for r in rows],
                              temperature=0.8)
    diffs = sorted(abs(a - b) for r, lp in zip(rows, ref) for a, b, m in
                   zip(r["sampler_logprobs"], lp, r["policy_mask"]) if m)
    REPORT["multi_turn_logprob_mean_abs_diff"] = sum(diffs) / len(diffs)
    REPORT["multi_turn_logprob_max_abs_diff"] = diffs[-1]
    assert sum(diffs) / len(diffs) < LOGPROB_MEAN_TOL and diffs[-1] < LOGPROB_TOL
    assert all(x == 0.0 for r in rows for x, m in zip(r["sampler_logprobs"], r["policy_mask"]) if not m)


def test_generate_stage_runs_multi_turn_rollouts_with_vllm(tiny, tmp_path):
    """stages/generate.py with generate.environment on a GPU: the template checked, vLLM started before any
    CUDA use in the stage's process, a valid multi-turn table."""
    _needs_gpu_and_vllm()
    import shutil

    pl = pytest.importorskip("polars")
    import yaml

    from rlpipe.data.io import read_artifact, write_artifact
    from rlpipe.data.schema import PROMPTS, ROLLOUTS

    path, tokenizer, _, _ = tiny
    model_dir = tmp_path / "model"
    shutil.copytree(path, model_dir)
    tokenizer.chat_template = TINY_TEMPLATE
    try:
        tokenizer.save_pretrained(model_dir)
    finally:
        tokenizer.chat_template = None
    repo = Path(__file__).resolve().parents[2]
    texts = [f"{a}+{b}=" for a, b in ((1, 2), (34, 56), (7, 80), (99, 9))]
    prompts = pl.DataFrame({"prompt_id": pl.Series(range(len(texts)), dtype=pl.Int64), "prompt": texts,
                            "prompt_token_ids": [tokenizer(t)["input_ids"] for t in texts],
                            "answer": ["3", "90", "87", "108"], "metadata": ["{}"] * len(texts)})
    write_artifact(prompts, tmp_path / "prompts.parquet", PROMPTS)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["generate"].update(engine="auto", device="cuda", dtype="bfloat16", prompts_per_iteration=0,
                              group_size=4, max_new_tokens=12)
    params["generate"]["vllm"].update(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=64)
    params["generate"]["environment"].update(name="tests.environments.echo:Echo", max_turns=3, max_total_tokens=48)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [sys.executable, str(repo / "stages/generate.py"), "--params", str(tmp_path / "params.yaml"),
           "--prompts", str(tmp_path / "prompts.parquet"), "--policy", str(model_dir),
           "--out", str(tmp_path / "rollouts.parquet"), "--metrics", str(tmp_path / "generate.json"),
           "--resume-root", str(tmp_path / "resume")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "generate.json").read_text())
    assert metrics["engine"] == "vllm" and metrics["num_samples"] == 16 and metrics["turns_max"] >= 2
    table = read_artifact(tmp_path / "rollouts.parquet", ROLLOUTS).frame
    assert (table["num_turns"] > 1).any() and not (table["finish_reason"] == "infra_error").any()
    REPORT["multi_turn_stage_metrics"] = json.dumps({k: metrics[k] for k in ("turns_mean", "finish_reasons",
                                                                             "observation_tokens", "policy_tokens")})
