"""The engine server's reload path on the CPU (HF engine): a policy directory rewritten in place, one tensor
at a time, is served with the new weights' log-probs, exactly; the GPU test (test_vllm_reload_gpu.py) runs
the same checks through vLLM's in-place reload, its sleep levels and LoRA adapters."""
from __future__ import annotations

from tests.engines.reload_checks import (
    REPORT,
    check,
    checkpoints,
    params,
    place,
    requests_of,
)


def test_a_policy_rewritten_in_place_is_served_with_every_new_tensor(tmp_path):
    from rlpipe.worker.engine_server import EngineHost

    kind = "qwen2-tied"
    tokenizer, steps = checkpoints(tmp_path, kind)
    policy = place(steps[0][1], tmp_path / "policy")
    settings = {"engine": "hf", "device": "cpu", "dtype": "float32", "batch_size": 32,
                "eos_token_ids": [tokenizer.eos_token_id], "pad_token_id": tokenizer.pad_token_id}
    host = EngineHost(settings, str(policy), sleep=False)
    before = steps[0][2]
    for salt, (label, model_dir, now) in enumerate(steps):
        requests = requests_of(tokenizer, salt)
        groups, timings = host.generate(str(place(model_dir, policy)), requests, params())
        assert timings["reload"] > 0  # for the HF engine: a fresh model from the directory's new files
        # fp32 on both sides: only the padding of a batch differs from the one-row reference
        check(kind + " (hf)", label, requests, groups, now, before, mean_tol=1e-5, p99_tol=1e-4)
        before = now
    assert len(REPORT[kind + " (hf)"]) == len(steps)  # every step checked
    print({label: row["new_vs_old"] for label, row in REPORT[kind + " (hf)"].items()})
