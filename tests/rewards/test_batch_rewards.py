"""Batch rewards: marked with `batch_reward`, called once with every row, combined with per-row rewards."""
import subprocess
import sys
import textwrap

import pytest

from rlpipe.config import RewardEntry, ScoreConfig
from rlpipe.errors import ScoringError
from rlpipe.rewards import REWARD_FUNCTIONS, is_batch_reward
from rlpipe.rewards.functions import Sample
from rlpipe.rewards.registry import RewardSpec, batch_values, prepare_rewards, score_sample_details
from rlpipe.stages.score import score_rows
from tests.stages.test_score import rows  # the same score-stage rows

USER_MODULE = '''
from rlpipe.rewards import batch_reward

CALLS = []

@batch_reward
def length_rank(samples, *, scale):
    """scale x the completion's rank by length among all rows (needs every row at once)."""
    CALLS.append(len(samples))
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].completion), i))
    rank = {i: r for r, i in enumerate(order)}
    return [scale * rank[i] for i in range(len(samples))]

@batch_reward
def nan_on_second(samples):
    return [float("nan") if i == 1 else 1.0 for i in range(len(samples))]

@batch_reward
def too_short(samples):
    return [1.0]

@batch_reward
def broken(samples):
    raise RuntimeError("model exploded")
'''

EXACT = RewardEntry("exact_answer", 1.0, {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True})


@pytest.fixture
def user_batch(tmp_path, monkeypatch):
    (tmp_path / "my_batch_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("my_batch_rewards")
    module.CALLS.clear()
    yield module
    sys.modules.pop("my_batch_rewards", None)


def cfg(*entries, workers=1, max_error_fraction=0.5):
    return ScoreConfig(rewards=(EXACT, *entries), accuracy_reward="exact_answer", fallback_reward=-1.0,
                       max_error_fraction=max_error_fraction, workers=workers, row_timeout_s=None)


def test_reward_model_is_the_builtin_batch_reward():
    assert is_batch_reward(REWARD_FUNCTIONS["reward_model"])
    assert [n for n, fn in REWARD_FUNCTIONS.items() if is_batch_reward(fn)] == ["reward_model"]


def test_batch_reward_sees_all_rows_once_and_combines_with_per_row(user_batch):
    entry = RewardEntry("my_batch_rewards:length_rank", 0.5, {"scale": 2.0})
    frame, m = score_rows(rows(["123", "1", "12"], ["123", "2", "12"]), cfg(entry))
    assert user_batch.CALLS == [3]  # one call with every row
    assert frame["reward_length_rank"].to_list() == [4.0, 0.0, 2.0]  # ranks 2, 0, 1 times scale 2
    assert frame["reward"].to_list() == [1.0 + 0.5 * 4.0, 0.0 + 0.0, 1.0 + 0.5 * 2.0]
    assert m["components"]["my_batch_rewards:length_rank"] == pytest.approx(2.0)


@pytest.mark.parametrize("workers", [2, 5])
def test_batch_results_are_identical_for_any_workers(user_batch, workers):
    entry = RewardEntry("my_batch_rewards:length_rank", 0.5, {"scale": 1.0})
    data = rows([str(i) * (i % 4 + 1) for i in range(30)], [str(i) for i in range(30)])
    one, m1 = score_rows(data, cfg(entry))
    many, m2 = score_rows(data, cfg(entry, workers=workers))
    assert one.equals(many) and m1 == m2


def test_a_bad_batch_value_marks_only_its_row(user_batch):
    frame, m = score_rows(rows(["1", "2", "3"], ["1", "2", "3"]), cfg(RewardEntry("my_batch_rewards:nan_on_second",
                                                                                  1.0, {})))
    assert frame["reward"].to_list() == [2.0, -1.0, 2.0]
    assert frame["score_error"][1].startswith("ValueError: reward 'my_batch_rewards:nan_on_second' returned nan")
    assert m["errors_by_kind"] == {"ValueError": 1}


@pytest.mark.parametrize(("name", "needle"), [
    ("my_batch_rewards:too_short", "returned 1 values for 3 samples"),
    ("my_batch_rewards:broken", "RuntimeError: model exploded"),
])
def test_a_failing_batch_reward_stops_the_stage_naming_it(user_batch, name, needle):
    with pytest.raises(ScoringError, match=f"batch reward '{name}' failed on the whole batch of 3 rows: .*{needle}"):
        score_rows(rows(["1", "2", "3"], ["1", "2", "3"]), cfg(RewardEntry(name, 1.0, {})))


def test_batch_options_are_checked_up_front(user_batch):
    with pytest.raises(ValueError, match="missing required option"):
        prepare_rewards([RewardSpec("my_batch_rewards:length_rank", 1.0, {})])
    with pytest.raises(ValueError, match="no option 'paht'"):
        prepare_rewards([RewardSpec("reward_model", 1.0, {"paht": "x", "device": "cpu", "dtype": "float32",
                                                          "max_tokens_per_batch": 1})])


def test_score_sample_details_takes_batch_values_as_precomputed(user_batch):
    specs = [RewardSpec("my_batch_rewards:length_rank", 2.0, {"scale": 1.0}), RewardSpec("exact_answer", 1.0,
             {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True})]
    fns = prepare_rewards(specs)
    samples = [Sample("q", "12", "12", {}, 2, False), Sample("q", "7", "8", {}, 1, False)]
    values = batch_values(samples, specs[0], fns[specs[0].name])
    assert values == [1.0, 0.0]
    assert score_sample_details(samples[0], specs, fns, {specs[0].name: values[0]}) == (
        {specs[0].name: 1.0, "exact_answer": 1.0}, 2.0 * 1.0 + 1.0, {})
    with pytest.raises(ValueError, match="scores samples in batches"):
        score_sample_details(samples[0], specs, fns)


def test_scoring_without_a_batch_reward_imports_no_torch():
    code = textwrap.dedent('''
        import sys
        import polars as pl
        from rlpipe.config import RewardEntry, ScoreConfig
        from rlpipe.stages.score import score_rows
        rows = pl.DataFrame({"prompt_id": [0], "sample_idx": pl.Series([0], dtype=pl.Int32), "prompt": ["q"],
                             "completion_text": ["1"], "answer": ["1"], "metadata": ["{}"],
                             "completion_length": pl.Series([1], dtype=pl.Int32), "truncated": [False]})
        entry = RewardEntry("exact_answer", 1.0, {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True})
        cfg = ScoreConfig(rewards=(entry,), accuracy_reward="exact_answer", fallback_reward=0.0,
                          max_error_fraction=0.0, workers=2, row_timeout_s=None)
        score_rows(rows, cfg)
        assert "torch" not in sys.modules, "torch imported"
    ''')
    subprocess.run([sys.executable, "-c", code], check=True)
