"""Generation and log-prob engines behind one signature.

`rlpipe.engines.base` (types, `derive_seed`) imports no torch. The torch-based parts are loaded on
first use, so `from rlpipe.engines import HFEngine` works without slowing down light imports:
    HFEngine                      rlpipe.engines.hf
    VLLMEngine                    rlpipe.engines.vllm (imports vllm only when an engine is built)
    TokenBatch, make_token_batch, PackedBatch, make_packed_batch, completion_logprobs,
    batched_completion_logprobs, token_budget_batches, unpad, enable_gradient_checkpointing,
    compile_decoder_layers        rlpipe.engines.logprobs
    compile_layers_wanted         rlpipe.engines.logprobs
The keep sampling mask's kept sets and truncated log-probs (`batched_kept_sets`,
`completion_logprobs_truncated`, ...) are imported from `rlpipe.engines.truncation` itself.
"""
from importlib import import_module

from rlpipe.engines.base import (
    Completion,
    GenerationEngine,
    PromptRequest,
    SamplingParams,
    derive_seed,
    eval_mode,
)

_LAZY = {
    "HFEngine": "rlpipe.engines.hf",
    "load_causal_lm": "rlpipe.engines.hf",
    "VLLMEngine": "rlpipe.engines.vllm",
    "TokenBatch": "rlpipe.engines.logprobs",
    "make_token_batch": "rlpipe.engines.logprobs",
    "completion_logprobs": "rlpipe.engines.logprobs",
    "batched_completion_logprobs": "rlpipe.engines.logprobs",
    "unpad": "rlpipe.engines.logprobs",
    "PackedBatch": "rlpipe.engines.logprobs",
    "make_packed_batch": "rlpipe.engines.logprobs",
    "token_budget_batches": "rlpipe.engines.logprobs",
    "enable_gradient_checkpointing": "rlpipe.engines.logprobs",
    "compile_decoder_layers": "rlpipe.engines.logprobs",
    "compile_layers_wanted": "rlpipe.engines.logprobs",
}

__all__ = [
    "Completion",
    "GenerationEngine",
    "PromptRequest",
    "SamplingParams",
    "derive_seed",
    "eval_mode",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlpipe.engines' has no attribute {name!r}")
