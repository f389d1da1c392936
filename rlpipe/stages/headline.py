"""The headline of a stage's metrics: the few numbers `dvc metrics show` prints by default.

Every stage writes two files: ``metrics/<stage>.json`` with everything it measured (a cached DVC
output, read by `rlpipe diff`, `rlpipe iterate` and scripts), and ``metrics/headline/<stage>.json``
with the numbers below and its wall time, declared as DVC ``metrics``. DVC prints one column per key
of every metrics file, so declaring the full files gave a table of ~100 columns (issue 15); the
headline keeps it to nine, under 200 characters wide. The full files cannot be plain uncached
outputs: DVC then skips its run cache, which overlapped runs rely on (rlpipe/run/ahead.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

HEADLINE_DIR = "headline"
# stage -> keys of metrics/<stage>.json in its headline (docs/metrics-and-plots.md, "Where to look first")
HEADLINE_KEYS: dict[str, tuple[str, ...]] = {
    "generate": ("length_mean", "truncation_rate"),
    "score": ("accuracy", "reward_mean"),
    "advantage": ("zero_variance_fraction",),
    "train": ("kl_ref", "approx_kl_old", "clip_fraction"),
    "evaluate": ("accuracy", "reward_mean", "length_mean", "accuracy_by"),  # accuracy_by: evaluate.metrics_by's
}
HEADLINE_KEYS["baseline"] = HEADLINE_KEYS["evaluate"]  # the evaluate script on the starting model (dvc.yaml)


# The full metrics files dvc.yaml's stages write, by name (a test keeps them in step with dvc.yaml): only these get
# a headline beside them, so that a stage script run by hand with ``--metrics /tmp/base.json`` leaves no stray
# ``/tmp/headline/base.json``.
PIPELINE_METRICS = frozenset({"prepare", "generate", "train_reward_model", "score", "reference_logprob", "values",
                              "advantage", "train", "evaluate", "baseline"})


def writes_headline(metrics_path: str | Path) -> bool:
    return Path(metrics_path).suffix == ".json" and Path(metrics_path).stem in PIPELINE_METRICS


def headline_path(metrics_path: str | Path) -> Path:
    """metrics/<stage>.json -> metrics/headline/<stage>.json (dvc.yaml declares the latter as metrics)."""
    path = Path(metrics_path)
    return path.parent / HEADLINE_DIR / path.name


def headline(stage: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """The stage's headline numbers that it measured (a key it did not write is left out) and its seconds."""
    out = {k: metrics[k] for k in HEADLINE_KEYS.get(stage, ()) if isinstance(metrics.get(k), (int, float, dict))}
    seconds = metrics.get("seconds")
    if isinstance(seconds, dict) and "total" in seconds:
        out["seconds"] = seconds["total"]
    return out
