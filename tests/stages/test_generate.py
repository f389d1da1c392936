"""Prompt selection and the rollout table built from engine results."""
import polars as pl

from rlpipe.data.io import validate_frame
from rlpipe.data.schema import ROLLOUTS
from rlpipe.engines.base import Completion, PromptRequest, derive_seed
from rlpipe.stages.generate import rollout_frame, sample_seed, select_prompts


def prompts(n):
    return pl.DataFrame({"prompt_id": pl.Series(range(n), dtype=pl.Int64), "prompt_token_ids": [[1, 2]] * n})


def test_selection_is_seeded_per_iteration_and_order_free():
    table = prompts(100)
    a = select_prompts(table, count=10, seed=5, iteration=0)["prompt_id"].to_list()
    assert a == select_prompts(table.reverse(), count=10, seed=5, iteration=0)["prompt_id"].to_list()
    assert len(set(a)) == 10 and a == sorted(a)
    b = select_prompts(table, count=10, seed=5, iteration=1)["prompt_id"].to_list()
    assert a != b
    assert select_prompts(table, count=0, seed=5, iteration=0).height == 100


def test_rollout_frame_matches_schema_and_seeds():
    table = prompts(2)
    reqs = [PromptRequest(prompt_token_ids=(1, 2), seed=sample_seed(1, 0, pid), n=2) for pid in (0, 1)]
    results = [[Completion([5, 2], [-0.5, -0.1], "stop"), Completion([5, 6, 7], [-1.0, -2.0, -3.0], "length")]] * 2
    frame = rollout_frame(table, reqs, results, policy_version=3, decode=lambda ids: "".join(map(str, ids)))
    frame = validate_frame(frame.select(ROLLOUTS.column_names), ROLLOUTS)
    assert frame["completion_text"].to_list() == ["52", "567", "52", "567"]
    assert frame["truncated"].to_list() == [False, True, False, True]
    assert frame["policy_version"].unique().to_list() == [3]
    assert frame["sample_seed"][1] == derive_seed(sample_seed(1, 0, 0), 1)


def test_rollout_metrics_record_the_length_distribution():
    from rlpipe.stages.generate import rollout_metrics

    table = prompts(2)
    reqs = [PromptRequest(prompt_token_ids=(1, 2), seed=sample_seed(1, 0, pid), n=2) for pid in (0, 1)]
    results = [[Completion([5, 2], [-0.5, -0.1], "stop"), Completion([5, 6, 7], [-1.0, -2.0, -3.0], "length")],
               [Completion([5], [-0.5], "stop"), Completion([5, 6, 7, 8, 9], [-1.0] * 5, "length")]]
    frame = rollout_frame(table, reqs, results, policy_version=3, decode=lambda ids: "".join(map(str, ids)))
    m = rollout_metrics(frame)
    # lengths 2, 3, 1, 5 -> sorted 1, 2, 3, 5; index round(q * 3): p10 0.3 -> 0, p25 0.75 -> 1, p50 1.5 -> 2,
    # p75 2.25 -> 2, p90 2.7 -> 3
    assert m["length_quantiles"] == {"p10": 1.0, "p25": 2.0, "p50": 3.0, "p75": 3.0, "p90": 5.0}
    assert (m["length_mean"], m["length_max"]) == (2.75, 5)
