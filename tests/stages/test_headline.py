"""The headline metrics (rlpipe/stages/headline.py): what `dvc metrics show` prints, and how dvc.yaml declares it."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlpipe.stages.headline import HEADLINE_KEYS, headline, headline_path

REPO = Path(__file__).resolve().parents[2]
CHECKS = {"check_params"}  # stages that only refuse bad input: they write nothing, no metrics either


def test_the_headline_keeps_the_named_numbers_and_the_total_seconds():
    train = {"stage": "train", "kl_ref": 0.02, "approx_kl_old": 0.001, "clip_fraction": 0.1, "entropy_old": 1.3,
             "grad_norm_mean": 0.5, "seconds": {"total": 12.5, "compute": 9.0, "fixed": 3.5}}
    assert headline("train", train) == {"kl_ref": 0.02, "approx_kl_old": 0.001, "clip_fraction": 0.1,
                                        "seconds": 12.5}
    # a key the stage did not write (or wrote as text) is left out; a stage with no headline keys keeps its time
    assert headline("evaluate", {"accuracy": 0.5, "reward_mean": "n/a", "seconds": {"total": 2.0}}) == {
        "accuracy": 0.5, "seconds": 2.0}
    assert headline("prepare", {"build_seconds": 800.0, "seconds": {"total": 3.0}}) == {"seconds": 3.0}
    assert headline_path("metrics/train.json") == Path("metrics/headline/train.json")


def test_stage_write_metrics_writes_the_full_file_and_its_headline(tmp_path):
    from rlpipe.stages.runner import PhaseTimer, write_metrics

    write_metrics(tmp_path / "m" / "score.json", "score", {"accuracy": 0.25, "reward_mean": -0.0, "errors": 0},
                  PhaseTimer())
    full = json.loads((tmp_path / "m" / "score.json").read_text())
    short = json.loads((tmp_path / "m" / "headline" / "score.json").read_text())
    assert set(full) == {"stage", "accuracy", "reward_mean", "errors", "seconds"}
    assert short == {"accuracy": 0.25, "reward_mean": 0.0, "seconds": full["seconds"]["total"]}


def test_dvc_yaml_declares_each_headline_as_metrics_and_each_full_file_as_a_cached_output():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert set(HEADLINE_KEYS) <= set(stages)
    for name, stage in stages.items():
        if name in CHECKS:
            assert "outs" not in stage and "metrics" not in stage, name
            continue
        full = f"${{paths.metrics_dir}}/{name}.json"
        assert f"--metrics {full}" in stage["cmd"], name
        assert full in stage["outs"], name  # cached: DVC's run cache needs every plain output cached
        assert stage["metrics"] == [{str(headline_path(full)): {"cache": False}}], name


def test_only_the_pipelines_metrics_files_get_a_headline(tmp_path):
    """A stage script run by hand with --metrics elsewhere writes no stray headline/ beside it; the pipeline's
    names are exactly dvc.yaml's stages."""
    from rlpipe.stages.headline import PIPELINE_METRICS
    from rlpipe.stages.runner import PhaseTimer, write_metrics

    assert PIPELINE_METRICS == set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]) - CHECKS
    write_metrics(tmp_path / "base.json", "evaluate", {"accuracy": 0.4}, PhaseTimer())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.json"]
    write_metrics(tmp_path / "baseline.json", "evaluate", {"accuracy": 0.4, "accuracy_by": {"d": {"hard": 0.1}}},
                  PhaseTimer())
    assert json.loads((tmp_path / "headline" / "baseline.json").read_text())["accuracy_by"] == {"d": {"hard": 0.1}}
