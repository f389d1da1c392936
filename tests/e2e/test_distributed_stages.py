"""The train and reference_logprob stages under `torchrun --nproc_per_node 2` (gloo, CPU) against `dvc repro`'s.

reference_logprob (data parallel) must write the same bytes; train (FSDP2) the same checkpoint and
token statistics up to float32 rounding (the ranks' gradients are summed in another order).
"""
from __future__ import annotations

import shlex
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from rlpipe.data.io import read_artifact, read_json
from rlpipe.data.schema import TRAIN_TOKEN_STATS
from rlpipe.run.commands import stage_commands
from tests.e2e.conftest import assert_same_samples, edit_params, run

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def torchrun_stage(project, stage: str, outputs: dict[str, str], processes: int = 2):
    """Run ``stage``'s dvc.yaml command under torchrun (``processes`` ranks), with the options in ``outputs``
    pointed elsewhere."""
    words = shlex.split(stage_commands(project / "dvc.yaml", project / "params.yaml")[stage])
    assert words[0] == "python"
    for option, path in outputs.items():
        words[words.index(option) + 1] = path
    return run(TORCHRUN[:-1] + [str(processes)] + words[1:], project)


def test_reference_logprob_data_parallel_is_byte_identical(project_copy, tmp_path):
    out = tmp_path / "ref_logprobs.parquet"
    torchrun_stage(project_copy, "reference_logprob", {"--out": str(out), "--metrics": str(tmp_path / "ref.json")})
    assert out.read_bytes() == (project_copy / "artifacts/reference_logprob/ref_logprobs.parquet").read_bytes()
    single, parallel = read_json(project_copy / "metrics/reference_logprob.json"), read_json(tmp_path / "ref.json")
    for key in ("num_samples", "tokens", "ref_logprob_mean", "kl_sampler_ref_k1"):
        assert parallel[key] == single[key], key
    assert single["compiled_layers"] is parallel["compiled_layers"] is False  # compile_layers: auto, on CPU


def test_generate_on_three_processes_samples_the_single_process_table(project_copy, tmp_path):
    """One engine per process (what `rlpipe run --cluster` runs for generate on several nodes or processes):
    each samples its block of the prompts with each prompt's own seed, rank 0 writes them in prompt order.
    Every sample is the single process's; the log-probs agree to float32 rounding, since the hf engine pads
    a batch to its longest prompt and these blocks batch differently (4.8e-7 measured)."""
    out = tmp_path / "rollouts.parquet"
    torchrun_stage(project_copy, "generate", {"--out": str(out), "--metrics": str(tmp_path / "gen.json")}, processes=3)
    assert_same_samples(project_copy / "artifacts/generate/rollouts.parquet", out)
    m1, m3 = read_json(project_copy / "metrics/generate.json"), read_json(tmp_path / "gen.json")
    for key in ("num_samples", "completion_tokens", "truncation_rate"):
        assert m3[key] == m1[key], key


def test_train_under_fsdp_matches_the_single_process_stage(project_copy, tmp_path):
    new = {"--checkpoint": str(tmp_path / "checkpoint"), "--critic-checkpoint": str(tmp_path / "critic"),
           "--token-stats": str(tmp_path / "token_stats.parquet"), "--metrics": str(tmp_path / "train.json"),
           "--steps": str(tmp_path / "steps.csv")}
    edit_params(project_copy / "params.yaml", {"train.checkpoint_every_steps": 1})  # rank 0 saves full states
    torchrun_stage(project_copy, "train", new)

    ckpt = project_copy / "artifacts/train/checkpoint"
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == sorted(p.name for p in ckpt.iterdir())
    for name in ("config.json", "rlpipe.json", "tokenizer.json"):
        assert (tmp_path / "checkpoint" / name).read_bytes() == (ckpt / name).read_bytes(), name
    single, fsdp = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "checkpoint/model.safetensors")
    assert single.keys() == fsdp.keys()
    start = load_file(project_copy / "artifacts/prepare/model/model.safetensors")
    for key, w in single.items():
        assert not (w == start[key]).all() or key.endswith("norm.weight"), f"{key} did not move"
        assert (fsdp[key] - w).abs().max() < 1e-5, key

    a = read_artifact(project_copy / "artifacts/train/token_stats.parquet", TRAIN_TOKEN_STATS).frame
    b = read_artifact(tmp_path / "token_stats.parquet", TRAIN_TOKEN_STATS).frame
    assert a.select("prompt_id", "sample_idx").equals(b.select("prompt_id", "sample_idx"))
    for column, atol in (("old_logprobs", 0.0), ("entropy", 0.0), ("new_logprobs", 1e-4)):
        np.testing.assert_allclose(np.concatenate(b[column].to_list()), np.concatenate(a[column].to_list()),
                                   atol=atol, rtol=0, err_msg=column)

    m1, m2 = read_json(project_copy / "metrics/train.json"), read_json(tmp_path / "train.json")
    assert m2["optimizer_steps"] == m1["optimizer_steps"] > 1
    assert m1["compiled_layers"] is m2["compiled_layers"] is False  # compile_layers: auto, on CPU
    for key in ("loss_mean", "grad_norm_mean", "clip_fraction", "approx_kl_old", "entropy_old", "kl_ref"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    assert not list((project_copy / ".rlpipe/resume").glob("train-*"))  # rank 0 cleared its resume state


def test_each_rank_reads_only_its_share_of_the_rows(project_copy):
    """Under torchrun read_inputs takes rows [start, stop) of every table: the ranks' frames are disjoint
    blocks that together are the single process's frame, and each rank's trainer data is its block plus the
    per-row numbers (trainable, policy tokens, length) of every row."""
    from rlpipe.config import load_params
    from rlpipe.distributed import Dist
    from rlpipe.stages.train import TrainPaths, read_inputs, trainer_data

    p = load_params(project_copy / "params.yaml")
    a = lambda path: str(project_copy / path)  # noqa: E731
    paths = TrainPaths(a(p.paths.rollouts), a(p.paths.scores), a(p.paths.ref_logprobs), a(p.paths.advantages), None,
                       a(p.policy.latest_path), None, "unused", None, "unused", "unused", "unused")
    whole = read_inputs(p, paths)
    world = 3
    shares = [read_inputs(p, paths, Dist(rank, world, rank)) for rank in range(world)]
    heights = [s.frame.height for s in shares]
    assert sum(heights) == whole.frame.height and max(heights) - min(heights) <= 1 and min(heights) > 0
    assert [s.rows for s in shares] == [(0, heights[0]), (heights[0], heights[0] + heights[1]),
                                        (heights[0] + heights[1], whole.frame.height)]
    import polars as pl
    assert pl.concat([s.frame for s in shares]).equals(whole.frame)

    class Gathering(Dist):  # every rank's local per-row numbers, as torch's all_gather_object returns them
        def gather(self, obj):
            return [trainer_locals[r] for r in range(world)] if len(trainer_locals) == world else [obj]

    single, single_steps = trainer_data(whole, p)
    trainer_locals = [(single.trainable[s.rows[0]:s.rows[1]],
                       np.array([single.policy_tokens(i) for i in range(*s.rows)]),
                       np.array([len(single.prompt_token_ids[i]) + len(single.completion_token_ids[i])
                                 for i in range(*s.rows)])) for s in shares]
    data, steps = trainer_data(shares[1], p, Gathering(1, world, 1))
    assert steps == single_steps
    assert len(data.completion_token_ids) == heights[1]
    np.testing.assert_array_equal(data.rows.trainable, single.trainable)
    assert data.rows.lengths.sum() == sum(len(x) + len(y) for x, y in zip(single.prompt_token_ids,
                                                                          single.completion_token_ids))
    for mine, theirs in zip(data.completion_token_ids, single.completion_token_ids[heights[0]:]):
        np.testing.assert_array_equal(mine, theirs)
