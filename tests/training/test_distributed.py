"""FSDP2 on 2 processes (gloo, CPU) gives one process's numbers: gradients, step metrics, log-probs, weights.

One spawn of 2 ranks runs every scenario (process start-up dominates); the test process runs the
same scenarios without `dist` and compares. Sequence lengths differ within and across ranks.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.config import LoraConfig
from rlpipe.distributed import Dist, finish, start
from rlpipe.models.value_model import ScalarHeadModel
from rlpipe.training import loop
from rlpipe.training.loop import cut_micro_batches, train_policy
from rlpipe.training.objective import Normalisers, micro_batch_loss
from rlpipe.training.share import share_bounds, take_share
from tests.training.test_loop import PAD, config, data

WORLD = 2
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", train_lm_head=False,
                  train_embeddings=False)
ATOL = 1e-5  # fp32: the ranks' gradient sums are added in another order than one process adds them

# name -> (model options, train config overrides); minibatch 8 of 8 sequences: one step per epoch
SCENARIOS = {
    "seq-mean-token-mean": ({}, dict(loss_aggregation="seq-mean-token-mean", micro_batch_size=2)),
    "token-mean, tied embeddings": ({"tied": True}, dict(loss_aggregation="token-mean", micro_batch_size=2)),
    # each rank cuts its own 4 rows by a token cap: 3 micro-batches on one rank, 2 and a zero-weighted pass
    # on the other
    "token cap, uneven micro-batch counts": ({}, dict(micro_batch_size=3, max_tokens_per_micro_batch=16)),
    # scope micro_batch: each micro-batch normalised by its own counts; compared with one process that cuts
    # the same per-rank micro-batches (`per_rank_plan`)
    "micro_batch scope, odd micro-batch count": ({}, dict(token_mean_scope="micro_batch", micro_batch_size=3)),
    "ppo critic": ({"critic": True}, dict(micro_batch_size=2)),
    "bf16 autocast, gradient checkpointing": ({"tied": True, "checkpointing": True},
                                              dict(micro_batch_size=4, dtype="bfloat16")),
    # frozen base weights and trainable adapters in the same FSDP groups (docs/lora.md)
    "lora, tied embeddings": ({"tied": True, "lora": True}, dict(micro_batch_size=2, lora=LORA)),
    # DeepSeek-V3.2's keep sampling mask: kept sets, truncated log-probs and their gradient through the FSDP root
    "keep sampling mask (top-k 5)": ({"truncation": (5, 1.0)}, dict(micro_batch_size=2, kl_beta=0.05)),
}
MULTI_STEP = dict(epochs=2, minibatch_size=4, micro_batch_size=1, max_grad_norm=0.1)  # 4 steps, clipped


def tiny(*, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).float()


def tiny_critic() -> ScalarHeadModel:
    head = torch.nn.Linear(32, 1)
    torch.nn.init.normal_(head.weight, std=0.1, generator=torch.Generator().manual_seed(5))
    torch.nn.init.zeros_(head.bias)
    return ScalarHeadModel(tiny(seed=5).model, head)


def scenario_data(with_critic: bool, poisoned: bool = False):
    d = data()
    if poisoned:  # the minibatch holding row 0 is skipped in each epoch
        d.token_advantages[0][:] = np.nan
    if with_critic:
        d.returns = [np.full(len(c), 1.0 + 0.1 * i, dtype=np.float32) for i, c in enumerate(d.completion_token_ids)]
        d.old_values = [np.full(len(c), 0.2, dtype=np.float32) for c in d.completion_token_ids]
    return d


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def build(options: dict, dist: Dist | None):
    from rlpipe.engines.logprobs import enable_gradient_checkpointing

    model = tiny(tied=options.get("tied", False))
    if options.get("lora"):  # the adapter's A is drawn from the seeded generator: the same on every rank
        from rlpipe.models.lora.peft_model import wrap_for_training

        peft_model = wrap_for_training(model, LORA)
        with torch.no_grad():  # B = 0 would give A no gradient: start from a non-zero adapter
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        model = peft_model.get_base_model()
    critic = tiny_critic() if options.get("critic") else None
    if options.get("checkpointing"):
        enable_gradient_checkpointing(model)
    sharded = None
    if dist is not None:
        from rlpipe.training.distributed import shard_for_training

        sharded = shard_for_training(model, dist, critic)
    return model, critic, sharded


def step_gradients(options: dict, overrides: dict, dist: Dist | None) -> dict[str, torch.Tensor]:
    """The gradient of one step over all 8 sequences, accumulated over micro-batches (each rank: its share)."""
    cfg = config(**overrides)
    model, critic, sharded = build(options, dist)
    model.eval()
    d = scenario_data(critic is not None)
    d.old_logprobs = [lp - 0.1 * (i % 3) for i, lp in enumerate(d.ref_logprobs)]  # some ratios clip
    if options.get("truncation"):  # pi_old's kept sets, from an unsharded copy of the same weights
        from rlpipe.engines.truncation import batched_kept_sets

        top_k, top_p = options["truncation"]
        truncated, d.kept, old_full, _ = batched_kept_sets(tiny(tied=options.get("tied", False)), d.prompt_token_ids,
                                                           d.completion_token_ids, temperature=0.7, top_k=top_k,
                                                           top_p=top_p, max_tokens_per_batch=64, chunk_size=3)
        d.old_logprobs = [lp - 0.1 * (i % 3) for i, lp in enumerate(truncated)]
        d.old_logprobs_full = [lp - 0.1 * (i % 3) for i, lp in enumerate(old_full)]
    n = len(d.completion_token_ids)
    norm = Normalisers(sum(len(c) for c in d.completion_token_ids), n, 6)
    micro = [list(range(s, min(s + cfg.micro_batch_size, n))) for s in range(0, n, cfg.micro_batch_size)]
    for idx in (micro if sharded is None else sharded.share(micro)):
        loss, _ = micro_batch_loss(model, critic, d, micro[0][:1] if idx is None else idx, cfg, temperature=0.7,
                                   pad_token_id=PAD, norm_for=lambda mask: norm, dist=sharded)
        (loss * 0.0 if idx is None else loss).backward()
    named = list(model.named_parameters()) + ([(f"critic.{k}", p) for k, p in critic.named_parameters()]
                                              if critic is not None else [])
    return {name: full(p.grad) for name, p in named if p.requires_grad}


def per_rank_plan(minibatch, data, cfg, dist):
    """One process's stand-in for `loop.micro_batch_plan` under WORLD ranks: each rank's own rows, cut."""
    cuts = []
    for rank in range(WORLD):
        start, stop = share_bounds(len(data.prompt_token_ids), rank, WORLD)
        cuts += cut_micro_batches([i for i in minibatch if start <= i < stop], data, cfg)
    return cuts, len(cuts)


def trained(options: dict, overrides: dict, dist: Dist | None, *, resume=None, save_state=None,
            poisoned: bool = False) -> dict:
    """train_policy on the scenario; under ``dist`` each rank holds only its share of the rows."""
    cfg = config(**overrides)
    model, critic, sharded = build(options, dist)
    d = scenario_data(critic is not None, poisoned)
    if dist is not None:
        d = take_share(d, dist.rank, dist.world_size, dist.gather)
    elif cfg.token_mean_scope == "micro_batch":
        loop.micro_batch_plan, plan = per_rank_plan, loop.micro_batch_plan
    try:
        result = train_policy(model, d, cfg, temperature=0.7, pad_token_id=PAD, seed=3, iteration=0, max_length=6,
                              critic=critic, dist=sharded, resume=resume, save_state=save_state,
                              truncation=options.get("truncation"))
    finally:
        if dist is None and cfg.token_mean_scope == "micro_batch":
            loop.micro_batch_plan = plan
    weights = model.state_dict() if sharded is None else sharded.state(model)[0]
    every = (lambda rows: rows) if sharded is None else sharded.concat  # each rank returns its own rows
    return {"steps": result.steps, "metrics": result.metrics, "old": every(result.old_logprobs),
            "entropy": every(result.old_entropy), "new": every(result.new_logprobs),
            "weights": {k: v.detach().clone() for k, v in weights.items()}}


def run_all(dist: Dist | None, tmp: Path) -> dict:
    out = {}
    for name, (options, overrides) in SCENARIOS.items():
        out[name] = {"grads": step_gradients(options, overrides, dist), "one_step": trained(options, overrides, dist)}
    out["multi-step"] = trained({}, MULTI_STEP, dist)
    out["resumed"] = resumed(dist, tmp)
    out["poisoned"] = trained({}, dict(MULTI_STEP, max_skipped_steps=2), dist, poisoned=True)
    return out


def resumed(dist: Dist | None, tmp: Path) -> dict:
    """MULTI_STEP killed after step 2 and resumed from its saved state (rank 0 writes it, every rank reads it)."""
    path = tmp / f"state-{dist is not None}.pt"

    def save(state):
        if state["step"] == 2 and (dist is None or dist.is_main):
            torch.save(state, path)

    trained({}, dict(MULTI_STEP, checkpoint_every_steps=1), dist, save_state=save)
    if dist is not None:
        dist.gather(None)  # a barrier: rank 0 has written the state
    return trained({}, MULTI_STEP, dist, resume=torch.load(path, weights_only=True))


def _rank(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist = start("cpu")
    try:
        results = run_all(dist, Path(tmp))
        if dist.is_main:
            torch.save(results, Path(tmp) / "fsdp.pt")
    finally:
        finish(dist)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_rank, args=(free_port(), str(tmp)), nprocs=WORLD, join=True)
    return run_all(None, tmp), torch.load(tmp / "fsdp.pt", weights_only=False)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= atol, (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_step_gradient_matches_one_process(both, name):
    single, fsdp = both[0][name]["grads"], both[1][name]["grads"]
    assert single.keys() == fsdp.keys()
    assert max(g.abs().max().item() for g in single.values()) > 1e-3
    tol = 1e-3 if dict(SCENARIOS[name][1]).get("dtype") == "bfloat16" else ATOL
    for key in single:
        close(fsdp[key], single[key], tol)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_adamw_step_matches_one_process(both, name):
    single, fsdp = both[0][name]["one_step"], both[1][name]["one_step"]
    (s,), (f,) = single["steps"], fsdp["steps"]
    assert s.keys() == f.keys()
    bf16 = dict(SCENARIOS[name][1]).get("dtype") == "bfloat16"
    for key in s:  # loss and every health stat: the rank's micro-batches, combined rank by rank
        # bf16: the ranks' micro-batches hold other rows than one process's, so bf16 rounds them otherwise
        assert f[key] == pytest.approx(s[key], rel=1e-5 if not bf16 else 1e-3, abs=1e-7 if not bf16 else 1e-4), key
    # the log-probs before training: each rank packs its own rows, so batches differ from one process's
    assert len(single["old"]) == len(fsdp["old"]) == 8
    for a, b in zip(single["old"] + single["entropy"], fsdp["old"] + fsdp["entropy"]):
        np.testing.assert_allclose(a, b, atol=1e-5 if not bf16 else 2e-2)
    # Adam's first step is ~lr * sign(g): compare where the gradient is not negligible (as test_loop does)
    start = build(SCENARIOS[name][0], None)[0].state_dict()  # the same seeded start (adapters included)
    moved_any = False
    for key, w in single["weights"].items():
        if key in start:
            moved = (w - start[key]).abs() > 1e-3
            if moved.any():  # frozen weights (LoRA's base) do not move
                moved_any = True
                if bf16:  # the few entries whose tiny gradient bf16 rounds to the other sign move the other way
                    off = (fsdp["weights"][key][moved] - w[moved]).abs() > ATOL
                    assert off.float().mean().item() <= 0.01, (key, off.sum().item())
                else:
                    close(fsdp["weights"][key][moved], w[moved])
    assert moved_any
    for a, b in zip(single["new"], fsdp["new"]):
        np.testing.assert_allclose(a, b, atol=1e-4 if not bf16 else 2e-2)  # bf16: 1/64 apart near -3


def test_several_clipped_steps_match_one_process(both):
    single, fsdp = both[0]["multi-step"], both[1]["multi-step"]
    assert len(single["steps"]) == len(fsdp["steps"]) == 4
    for s, f in zip(single["steps"], fsdp["steps"]):
        assert f["grad_norm"] > 0.1  # clipping was active
        for key in ("loss", "grad_norm", "approx_kl", "clip_fraction", "ratio_min", "ratio_max", "entropy"):
            assert f[key] == pytest.approx(s[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(single["new"], fsdp["new"]):
        np.testing.assert_allclose(a, b, atol=1e-4)
    assert fsdp["metrics"].keys() == single["metrics"].keys()


def test_a_non_finite_step_is_skipped_on_every_rank(both):
    """Row 0's NaN reaches one rank's loss only: all ranks skip that step (same steps and weights as one process)."""
    single, fsdp = both[0]["poisoned"], both[1]["poisoned"]
    assert single["metrics"]["skipped_steps"] == fsdp["metrics"]["skipped_steps"] == 2
    assert [s["step"] for s in fsdp["steps"]] == [s["step"] for s in single["steps"]]
    for key, w in single["weights"].items():
        close(fsdp["weights"][key], w, 1e-4)


def test_resume_under_fsdp_ends_where_the_uninterrupted_run_ends(both):
    for results in both:
        uninterrupted, resumed = results["multi-step"], results["resumed"]
        assert resumed["steps"] == uninterrupted["steps"]
        for key, w in uninterrupted["weights"].items():
            assert torch.equal(resumed["weights"][key], w), key


def test_one_process_never_imports_fsdp():
    """The dist hooks default to None: one process never imports the FSDP module."""
    import subprocess
    import sys

    code = ("import sys, rlpipe.training.loop, rlpipe.training.objective; "
            "print('rlpipe.training.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
