"""Packed attention: several sequences in one row, attention kept inside each sequence.

Registered in transformers' AttentionInterface as "rlpipe_packed" (PACKED_ATTENTION) and switched
on only for the packed forward of `rlpipe.engines.logprobs` (the module docstring there says which
kernel runs where and why the alternatives were not used).
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

PACKED_ATTENTION = "rlpipe_packed"  # the transformers attention implementation of the packed path

try:  # torch >= 2.10; its signature changed between 2.11 and 2.13, read once here (not while compiling)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # older torch: the packed path still works, through _sdpa_per_sequence
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()


def _flash_varlen(
    query_THD: torch.Tensor, key_THD: torch.Tensor, value_THD: torch.Tensor,
    cu_seqlens: torch.Tensor, max_length: int, scale: float,
) -> torch.Tensor:
    """Causal FlashAttention over packed sequences through torch.nn.attention.varlen (CUDA, bf16/fp16).

    Its first release (2.10) takes `is_causal` and the default 1/sqrt(D) scale; 2.11 takes a (-1, 0)
    window for causal and `scale`; 2.13 adds `enable_gqa`. The flash kernel handles GQA (fewer
    key/value heads) natively (checked on torch 2.11 by benchmarks/gpu_throughput.py --check).
    """
    kwargs: dict = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    elif abs(scale * query_THD.shape[-1] ** 0.5 - 1.0) > 1e-6:
        query_THD = query_THD * (scale * query_THD.shape[-1] ** 0.5)  # fold a non-default scale into q
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = key_THD.shape[1] != query_THD.shape[1]
    return _varlen_attn(query_THD, key_THD, value_THD, cu_seqlens, cu_seqlens, max_length, max_length, **kwargs)


def _sdpa_per_sequence(
    query_HTD: torch.Tensor, key_HTD: torch.Tensor, value_HTD: torch.Tensor,
    cu_seqlens: list[int], scale: float,
) -> torch.Tensor:
    """Causal SDPA within each packed sequence; [T, H, D] out. Exact; for CPU and fp32.

    Sequences of equal length share one batched SDPA call (token-budget batches hold sequences of
    similar length), so the Python loop runs over distinct lengths, not over sequences.
    """
    starts, lengths = np.asarray(cu_seqlens[:-1]), np.diff(cu_seqlens)
    out_HTD = None  # allocated from the first result: under autocast SDPA returns the autocast dtype
    for length in np.unique(lengths):
        index_nL = torch.from_numpy(starts[lengths == length][:, None] + np.arange(length)).to(query_HTD.device)
        # [H, T, D] -> [H, n, L, D] -> [n, H, L, D]
        q, k, v = (x[:, index_nL].transpose(0, 1) for x in (query_HTD, key_HTD, value_HTD))
        out_nHLD = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        if out_HTD is None:
            out_HTD = out_nHLD.new_empty(query_HTD.shape[:2] + value_HTD.shape[2:])
        out_HTD[:, index_nL] = out_nHLD.transpose(0, 1)
    return out_HTD.transpose(0, 1)


def packed_attention(module, query_BHTD, key_BHTD, value_BHTD, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers attention function `"rlpipe_packed"`: causal attention within each packed sequence.

    Takes the packing from the `cu_seq_lens_q` and `max_length_q` keyword arguments (transformers'
    FlashAttentionKwargs, passed through the model's forward to every attention layer). B must be 1.
    Returns [1, T, H, D] as transformers' attention functions do.
    """
    cu_seqlens, max_length = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu_seqlens is None or max_length is None:
        raise ValueError(f"attention {PACKED_ATTENTION!r} needs cu_seq_lens_q and max_length_q (see make_packed_batch)")
    if query_BHTD.shape[0] != 1:
        raise ValueError(f"attention {PACKED_ATTENTION!r} takes one packed row, got {query_BHTD.shape[0]}")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(f"attention {PACKED_ATTENTION!r} supports neither sliding windows nor softcapping")
    if dropout:
        raise NotImplementedError(f"attention {PACKED_ATTENTION!r} has no attention dropout")
    scale = scaling if scaling is not None else query_BHTD.shape[-1] ** -0.5
    query_HTD, key_HTD, value_HTD = query_BHTD[0], key_BHTD[0], value_BHTD[0]
    # Under autocast, RoPE leaves q and k in float32 (fp32 weights) while v is bf16: attend in the
    # autocast dtype, as SDPA itself does under autocast.
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query_HTD.dtype
    if query_HTD.is_cuda and dtype in (torch.bfloat16, torch.float16) and _varlen_attn is not None:
        out_THD = _flash_varlen(*(x.transpose(0, 1).to(dtype) for x in (query_HTD, key_HTD, value_HTD)),
                                cu_seqlens, max_length, scale)
    else:
        out_THD = _sdpa_per_sequence(query_HTD, key_HTD, value_HTD, cu_seqlens.tolist(), scale)
    return out_THD.unsqueeze(0), None


def register_packed_attention() -> None:
    """Make "rlpipe_packed" a valid transformers attention implementation (idempotent).

    It is deliberately not registered as a mask implementation: transformers then skips building
    an attention mask for it, so no [T, T] tensor is ever made.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def attention_configs(model: torch.nn.Module) -> list:
    """The distinct config objects of `model` and its submodules that name an attention implementation."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}
    return list(configs.values())


@contextmanager
def attention_implementation(configs: list, names: str | list[str]) -> Iterator[None]:
    """Set `configs`' attention implementation(s) to `names` (one for all, or one each), then restore them."""
    names = [names] * len(configs) if isinstance(names, str) else names
    before = [config._attn_implementation for config in configs]
    for config, name in zip(configs, names):
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, name in zip(configs, before):
            config._attn_implementation = name

