"""On a GPU the train loop reads back to the host a fixed number of times per optimizer step.

Why it matters: every read-back (`float(t)`, `t.item()`, `if t.any()`, boolean indexing) makes the
CPU wait for the GPU to drain, and the GPU then idles while the CPU prepares the next launches. A
loop that reads its health statistics after every micro-batch pays that once per micro-batch.
"""
import warnings

import numpy as np
import pytest
import torch

from rlpipe.algorithms.losses import health_to_host
from rlpipe.training.loop import _optimizer_step
from tests.training.test_loop import PAD, config, data, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def syncs_of_one_step(micro_batch_size: int, **over) -> tuple[int, dict]:
    """(host syncs seen by torch's sync debug mode, the step's record) for one step over 8 sequences."""
    cfg = config(device="cuda", dtype="bfloat16", micro_batch_size=micro_batch_size, **over)
    model = tiny_model(0).cuda()
    d = data(8)
    d.old_logprobs = [r - 0.1 for r in d.ref_logprobs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    args = dict(temperature=0.7, pad_token_id=PAD, max_length=6, step=0, epoch=0)
    _optimizer_step(model, None, (optimizer, None), d, np.arange(8), cfg, **args)  # warm-up: lazy inits sync
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            record = _optimizer_step(model, None, (optimizer, None), d, np.arange(8), cfg, **args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen), record


@pytest.mark.parametrize("over", [{}, {"off_policy_mask_delta": 0.5, "tis_cap": 2.0}])
def test_host_syncs_do_not_grow_with_the_number_of_micro_batches(over):
    one, record_one = syncs_of_one_step(8, **over)
    eight, record_eight = syncs_of_one_step(1, **over)
    # the health read-back and the gradient norm, plus at most one from the allocators: 2-3 on an H200
    # (torch 2.11) whether the 8 sequences run as one micro-batch or as eight; 4+ per micro-batch before
    assert max(one, eight) <= 3, (one, eight)
    assert record_one is not None and record_eight is not None
    assert record_one["loss"] == pytest.approx(record_eight["loss"], rel=1e-2, abs=1e-3)


def test_health_to_host_reads_cuda_tensors_in_one_go():
    parts = [{"a": torch.tensor(0.1, device="cuda"), "num_valid_tokens": torch.tensor(7, device="cuda"), "b": 2.5}]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            host = health_to_host(parts * 3)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchronizing" in str(w.message) for w in seen) == 1
    assert host[2] == {"a": float(torch.tensor(0.1)), "num_valid_tokens": 7, "b": 2.5}
