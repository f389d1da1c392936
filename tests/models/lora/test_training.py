"""train with train.lora: only the adapter moves, the saved adapter is what was trained, resume ends where an
uninterrupted run ends, and the sampler check passes for the adapter's own samples and fails for the base's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rlpipe.engines.base import PromptRequest, SamplingParams, derive_seed
from rlpipe.engines.hf import HFEngine
from rlpipe.errors import TrainingError
from rlpipe.models.loading import load_model, lora_for_training
from rlpipe.models.lora.adapter import model_hash
from rlpipe.models.lora.peft_model import save_adapter
from rlpipe.training.loop import train_policy
from rlpipe.training.objective import TrainingData
from rlpipe.training.resume import host_copy

from tests.models.lora.conftest import lora
from tests.training.test_loop import config

BASE = "artifacts/prepare/model"


def lora_config(**over):
    return config(lr=5e-2, kl_beta=0.0, entropy_coef=0.0, minibatch_size=4, micro_batch_size=2, epochs=2,
                  lora=lora(**over))


def sampled_data(model, *, n_prompts=4, group=4, seed=0) -> TrainingData:
    """Rollouts sampled from ``model`` with the HF engine at temperature 1 (their sampler log-probs are its own)."""
    engine = HFEngine.from_model(model, batch_size=8, eos_token_ids=[2], pad_token_id=0)
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(3, 14, size=3)) for _ in range(n_prompts)]
    groups = engine.generate([PromptRequest(p, seed=derive_seed(seed, i), n=group) for i, p in enumerate(prompts)],
                             SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5))
    rows = [(list(p), c) for p, g in zip(prompts, groups) for c in g]
    adv = [np.full(len(c.token_ids), rng.normal(), dtype=np.float32) for _, c in rows]
    return TrainingData([p for p, _ in rows], [c.token_ids for _, c in rows], adv,
                        [np.asarray(c.sampler_logprobs, dtype=np.float32) for _, c in rows],
                        sampler_logprobs=[np.asarray(c.sampler_logprobs, dtype=np.float32) for _, c in rows],
                        sequence_advantages=np.array([a[0] for a in adv], dtype=np.float32),
                        trainable=np.ones(len(rows), dtype=bool))


def logprobs_of(model, d: TrainingData) -> list[np.ndarray]:
    from rlpipe.engines.logprobs import batched_completion_logprobs

    with torch.no_grad():
        out, _ = batched_completion_logprobs(model, d.prompt_token_ids, d.completion_token_ids, pad_token_id=0,
                                             temperature=1.0, max_tokens_per_batch=256, chunk_size=8,
                                             with_entropy=False, device="cpu")
    return out


def run(cfg, d, start, **kw):
    return train_policy(start.peft_model.get_base_model(), d, cfg, temperature=1.0, pad_token_id=0, seed=3,
                        iteration=0, max_length=5, **kw)


def test_only_the_adapter_moves_and_the_saved_adapter_is_what_was_trained(project):
    cfg = lora_config()
    start = lora_for_training(BASE, cfg.lora, device="cpu", replaced=["state"])
    base_before = {n: p.detach().clone() for n, p in start.peft_model.named_parameters() if not p.requires_grad}
    d = sampled_data(load_model(BASE, device="cpu", dtype="float32"))
    result = run(cfg, d, start)
    assert result.metrics["optimizer_steps"] == 8 and result.metrics["logprob_change_mean"] != 0.0
    for n, p in start.peft_model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    save_adapter(start.peft_model, "ckpt", policy_version=1, base_path=BASE, base_hash=model_hash(BASE))
    for a, b in zip(logprobs_of(load_model("ckpt", device="cpu", dtype="float32"), d), result.new_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_continued_adapter_keeps_training_the_same_adapter(project):
    cfg = lora_config()
    first = lora_for_training(BASE, cfg.lora, device="cpu", replaced=["state"])
    run(cfg, sampled_data(load_model(BASE, device="cpu", dtype="float32")), first)
    save_adapter(first.peft_model, "state/policy", policy_version=1, base_path=BASE, base_hash=model_hash(BASE))
    second = lora_for_training("state/policy", cfg.lora, device="cpu", replaced=["state"])
    assert second.continued and str(second.base_path) == BASE and second.base_hash == model_hash(BASE)
    assert all(p.requires_grad == ("lora_" in n) for n, p in second.peft_model.named_parameters())


def test_a_base_that_the_pipeline_replaces_is_refused(project):
    import shutil

    shutil.copytree(BASE, "state/policy")
    with pytest.raises(Exception, match=r"train.lora: the start model state/policy \(policy.latest_path\) would "
                                        "become the adapter's base, but state is replaced every iteration"):
        lora_for_training("state/policy", lora(), device="cpu", replaced=["artifacts/train/checkpoint", "state"])


def test_resume_of_a_lora_run_ends_where_an_uninterrupted_run_ends(project):
    cfg = lora_config(dropout=0.1)
    d = sampled_data(load_model(BASE, device="cpu", dtype="float32"))

    def fresh():
        torch.manual_seed(0)
        return lora_for_training(BASE, cfg.lora, device="cpu", replaced=[])

    whole = fresh()
    run(cfg, d, whole)
    saved = []
    interrupted = fresh()
    run(dataclasses.replace(cfg, checkpoint_every_steps=3), d, interrupted,
        save_state=lambda s: saved.append(host_copy(s)))
    state = saved[0]
    assert state["step"] == 3
    assert not any("base_layer" in k for k in state["model"]), "frozen base weights stay out of the resume state"
    torch.manual_seed(123)  # another start: everything that matters comes from the state
    resumed = lora_for_training(BASE, cfg.lora, device="cpu", replaced=[])
    run(cfg, d, resumed, resume=state)
    for (n, a), (_, b) in zip(whole.peft_model.named_parameters(), resumed.peft_model.named_parameters()):
        assert torch.equal(a, b), n


def test_dropout_acts_in_the_steps_only(project):
    """With dropout the first step's ratio is still exactly 1 where no dropout acts: pi_old is taken without it."""
    cfg = lora_config(dropout=0.5)
    start = lora_for_training(BASE, cfg.lora, device="cpu", replaced=[])
    d = sampled_data(load_model(BASE, device="cpu", dtype="float32"))
    result = run(dataclasses.replace(cfg, lr=0.0, epochs=1), d, start)
    for a, b in zip(result.old_logprobs, result.new_logprobs):
        np.testing.assert_array_equal(a, b)
    assert all(not m.training for m in start.peft_model.get_base_model().modules())

    def trained_with(dropout):
        torch.manual_seed(0)
        start = lora_for_training(BASE, lora(dropout=dropout), device="cpu", replaced=[])
        run(lora_config(dropout=dropout), d, start)
        return [p.detach().clone() for p in start.peft_model.parameters() if p.requires_grad]

    assert any(not torch.equal(a, b) for a, b in zip(trained_with(0.5), trained_with(0.0)))  # it did act in the steps


def test_sampler_log_probs_of_the_adapter_match_the_trainer_to_float_noise(project):
    """The adapter reaches the sampler: the HF engine over base+adapter gives the trainer's log pi_old (CPU, fp32)."""
    from rlpipe.training.report import check_sampler, sampler_mismatch
    import polars as pl

    cfg = lora_config()
    start = lora_for_training(BASE, cfg.lora, device="cpu", replaced=[])
    run(cfg, sampled_data(load_model(BASE, device="cpu", dtype="float32")), start)
    save_adapter(start.peft_model, "ckpt", policy_version=1, base_path=BASE, base_hash=model_hash(BASE))

    def mismatch(sampler_dir):
        d = sampled_data(load_model(sampler_dir, device="cpu", dtype="float32"), seed=1)
        frame = pl.DataFrame({"sampler_logprobs": [x.tolist() for x in d.sampler_logprobs],
                              "policy_mask": [[True] * len(x) for x in d.sampler_logprobs]})
        checked = []
        trainer = lora_for_training("ckpt", cfg.lora, device="cpu", replaced=[])  # what train starts from
        result = run(dataclasses.replace(cfg, epochs=1, lr=0.0), d, trainer,
                     check_old=lambda old: checked.append(check_sampler(frame, old, tolerance=0.02, policy="ckpt")))
        return sampler_mismatch(frame, result.old_logprobs), checked

    same, checked = mismatch("ckpt")
    assert checked == [None] and same["sampler_mismatch_max_abs"] < 1e-5
    with pytest.raises(TrainingError, match=r"train.max_sampler_mismatch: the rollouts' sampler log-probs differ "
                                            r"from the trainer's log pi_old by [\d.e-]+ on average"):
        mismatch(BASE)  # the adapter never reached the sampler: it sampled the base


def lora_grads(cfg, d, *, checkpointing: bool, compiled: bool = False, device: str = "cpu", backend="inductor"):
    """The adapter's gradient of one micro-batch loss on ``d`` (old log-probs = ref, so ratios start at 1)."""
    from rlpipe.engines.logprobs import compile_decoder_layers, enable_gradient_checkpointing
    from rlpipe.training.objective import Normalisers, micro_batch_loss

    torch.manual_seed(0)
    start = lora_for_training(BASE, cfg.lora, device=device, replaced=[])
    model = start.peft_model.get_base_model()
    if checkpointing:
        enable_gradient_checkpointing(model)
    if compiled:
        compile_decoder_layers(model, backend=backend)
    model.eval()
    d.old_logprobs = [x - 0.05 for x in d.ref_logprobs]
    lengths = [len(c) for c in d.completion_token_ids]
    loss, _ = micro_batch_loss(model, None, d, list(range(len(lengths))), dataclasses.replace(cfg, device=device),
                               temperature=1.0, pad_token_id=0,
                               norm_for=lambda mask: Normalisers(sum(lengths), len(lengths), 5))
    loss.backward()
    return {n: p.grad.detach().cpu() for n, p in start.peft_model.named_parameters() if p.requires_grad}


def test_gradient_checkpointing_gives_the_same_adapter_gradients(project):
    cfg = lora_config()
    d = sampled_data(load_model(BASE, device="cpu", dtype="float32"))
    plain = lora_grads(cfg, d, checkpointing=False)
    checkpointed = lora_grads(cfg, d, checkpointing=True)
    assert plain.keys() == checkpointed.keys() and any(g.abs().sum() > 0 for g in plain.values())
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], atol=1e-6, rtol=1e-5)


def test_compiled_lora_layers_hold_one_training_graph_like_full_fine_tuning(project):
    """Frozen embeddings leave the first layer's input without grad and every other layer's with it.
    Compiled layers would then hold two training graphs (the extra one compiled for 40-67 s on an H100);
    they hold one, as in full fine-tuning, and the adapter's gradients equal the eager ones."""
    from rlpipe.engines.logprobs import compile_decoder_layers

    def graphs_of(compile_model):
        graphs = []
        compile_model(lambda gm, example_inputs: graphs.append(gm.code) or gm.forward)
        torch._dynamo.reset()
        return graphs

    cfg = lora_config()
    d = sampled_data(load_model(BASE, device="cpu", dtype="float32"))
    eager = lora_grads(cfg, d, checkpointing=False)
    compiled: dict = {}
    lora_graphs = graphs_of(lambda backend: compiled.update(lora_grads(cfg, d, checkpointing=False, compiled=True,
                                                                       backend=backend)))

    def full_step(backend):
        model = load_model(BASE, device="cpu", dtype="float32")
        compile_decoder_layers(model, backend=backend)
        lora_grads_free = dataclasses.replace(cfg, lora=config().lora)
        from rlpipe.training.objective import Normalisers, micro_batch_loss
        lengths = [len(c) for c in d.completion_token_ids]
        loss, _ = micro_batch_loss(model, None, d, list(range(len(lengths))), lora_grads_free, temperature=1.0,
                                   pad_token_id=0, norm_for=lambda mask: Normalisers(sum(lengths), len(lengths), 5))
        loss.backward()

    full_graphs = graphs_of(full_step)
    lora_layer_graphs = [g for g in lora_graphs if "lora_A" in g]
    full_layer_graphs = [g for g in full_graphs if "_proj_" in g]
    assert len(full_layer_graphs) >= 1 and len(lora_layer_graphs) == len(full_layer_graphs)  # 5 against 3 without the hook
    assert len(lora_graphs) == len(full_graphs)
    assert compiled.keys() == eager.keys()
    for n in eager:
        torch.testing.assert_close(compiled[n], eager[n], atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_compiled_layers_and_checkpointing_with_lora_on_cuda(project):
    """Packed log-probs, compiled decoder layers and gradient checkpointing on a LoRA model (CUDA) give the
    eager CPU gradients of the adapter to float32 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = lora_config()
    d = sampled_data(load_model(BASE, device="cpu", dtype="float32"))
    cpu = lora_grads(cfg, d, checkpointing=False)
    cuda = lora_grads(cfg, d, checkpointing=True, compiled=True, device="cuda")
    for n in cpu:
        torch.testing.assert_close(cuda[n], cpu[n], atol=1e-4, rtol=1e-3)
