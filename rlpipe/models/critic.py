"""The PPO critic on disk: loading it for the values stage and the trainer, and saving it.

The critic is a `rlpipe.models.value_model.ScalarHeadModel`. In the first PPO iteration ``critic.path``
is a causal-LM directory (usually the policy's start), so the critic gets that body and a fresh
head; train writes the updated critic, and `rlpipe iterate` points ``critic.path`` at it.
"""
from __future__ import annotations

import json
from typing import Any

from rlpipe.data.io import CHECKPOINT_INFO, atomic_path, read_json

# The fresh head's seed is derived from the run seed, so two runs with one seed start the same critic.
HEAD_SEED_OFFSET = 17


def critic_info(path: str) -> dict[str, Any]:
    """Where a critic came from: a trained one (with the iteration that wrote it) or a fresh head."""
    from rlpipe.models.value_model import is_scalar_model_dir

    if is_scalar_model_dir(path):
        info = read_json(f"{path}/rlpipe.json")
        return {"path": path, "fresh_head": False, "critic_version": info.get("critic_version")}
    return {"path": path, "fresh_head": True, "critic_version": 0}


def load_critic(path: str, *, seed: int, device: str, dtype: str = "float32"):
    from rlpipe.models.value_model import load_scalar_model

    return load_scalar_model(path, seed=seed + HEAD_SEED_OFFSET, device=device, dtype=dtype)


def save_critic(critic_model, tokenizer: Any, out_dir: str, *, version: int, estimator: str) -> None:
    """The trained critic; without one (``critic_model`` None: every estimator but gae) a directory whose
    rlpipe.json says why it holds no model (DVC needs the train stage's declared output either way)."""
    if critic_model is not None:
        from rlpipe.models.value_model import save_scalar_model

        save_scalar_model(critic_model, tokenizer, out_dir, info={"critic_version": version})
        return
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        (tmp / CHECKPOINT_INFO).write_text(json.dumps(
            {"kind": "none", "reason": f"advantage.estimator {estimator!r} trains no critic"}, sort_keys=True) + "\n")
