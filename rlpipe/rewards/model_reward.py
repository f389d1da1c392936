"""The `reward_model` reward: a trained Bradley-Terry model's score of each completion, in batches.

The model is what the train_reward_model stage writes (rlpipe/stages/train_reward_model.py): a scalar head on
a transformer body, read at the last token of prompt + completion. It scores the exact token ids
the sampler produced (``prompt_token_ids`` + ``completion_token_ids``), never re-tokenized text,
so it must share the policy's tokenizer (it does when trained from the policy or SFT model).

Imports torch only when called, so configs without it keep a torch-free score stage.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rlpipe.errors import ArtifactError, ConfigError
from rlpipe.rewards.base import Sample, batch_reward

PLACEHOLDER_KIND = "none"  # rlpipe.json kind of train_reward_model's output when there was no preference data
MODEL_KIND = "scalar_head"  # rlpipe.models.value_model.KIND, repeated here to check a directory without importing torch
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_reward_model_dir(path: str | Path) -> Path:
    """``path`` if it holds a trained reward model, else an ArtifactError saying what is there instead."""
    from rlpipe.data.io import CHECKPOINT_INFO  # here, not at the top: `import rlpipe.rewards` stays light

    p = Path(path)
    info_file = p / CHECKPOINT_INFO
    if not p.is_dir():
        raise ArtifactError(f"{p}: reward model directory not found; run the train_reward_model stage "
                            "(dvc repro train_reward_model) or point the reward_model reward's path option at one")
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    if info.get("kind") == PLACEHOLDER_KIND:
        raise ArtifactError(f"{p}: no reward model was trained ({info.get('reason', 'no reason given')}); give "
                            "prepare.files.preferences a (prompt, chosen, rejected) file, or remove reward_model "
                            "from score.rewards")
    if info.get("kind") != MODEL_KIND or not (p / "scalar_head.safetensors").is_file():  # value_model.HEAD_FILE
        raise ArtifactError(f"{p}: not a reward model written by train_reward_model (no rlpipe.json of kind "
                            f"{MODEL_KIND!r} and scalar_head.safetensors)")
    return p


@batch_reward
def reward_model(samples: Sequence[Sample], *, path: str, device: str, dtype: str,
                 max_tokens_per_batch: int) -> list[float]:
    """The reward model's score of every sample, in input order (floats with no fixed zero).

    ``path``: the model directory (``paths.reward_model``); ``device``/``dtype``: where and in what
    precision the body runs (the head is float32); ``max_tokens_per_batch``: rows x longest
    sequence per forward pass. Each score depends only on its own tokens, so the values do not
    depend on which other rows are scored alongside (up to float rounding of padded shapes) and
    are identical for any ``score.workers``.
    """
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"reward_model: dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    if max_tokens_per_batch < 1:
        raise ConfigError(f"reward_model: max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    if not samples:
        return []
    check_reward_model_dir(path)
    for i, s in enumerate(samples):
        if s.prompt_token_ids is None or s.completion_token_ids is None:
            raise ArtifactError(f"reward_model scores token ids, but row {i} has no prompt_token_ids / "
                                "completion_token_ids (the rows must come from a rollout table)")
    from rlpipe.engines.scalar_head import batched_scores
    from rlpipe.models.value_model import load_scalar_model

    model = load_scalar_model(path, seed=0, device=device, dtype=dtype)  # seed unused: the head is loaded
    prompts = [list(s.prompt_token_ids) for s in samples]
    completions = [list(s.completion_token_ids) for s in samples]
    vocab = model.body.get_input_embeddings().num_embeddings
    top = max(max(ids, default=-1) for ids in prompts + completions)
    if top >= vocab:
        raise ArtifactError(f"{path}: the rollouts hold token id {top} but the reward model's vocabulary has "
                            f"{vocab} entries; train the reward model from a model with the policy's tokenizer")
    # Padding sits after each row's last token and is masked: any id in the vocabulary works.
    scores = batched_scores(model, prompts, completions, pad_token_id=0, max_tokens_per_batch=max_tokens_per_batch)
    return [float(x) for x in scores]
