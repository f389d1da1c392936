"""Per-token log-probs (and entropies) of completions under a causal LM, without full-vocab logits.

Used by the reference_logprob stage (no grad) and by training (with grad). A [batch, seq, vocab]
float32 logits tensor is the largest thing a naive implementation builds (8 x 2048 x 152k x 4 B
= 10 GB), so this module never makes one:

1. run the transformer body once over the batch -> final hidden states;
2. keep only the hidden states at positions that predict a completion token (prompt positions
   never need the LM head);
3. apply the output embedding to `chunk_size` of those positions at a time, in float32:
   log p(target) = z_target - logsumexp(z) (and the full-vocab entropy if asked). With autograd on,
   each chunk is a custom autograd Function that keeps no [chunk, vocab] tensor: backward
   recomputes the chunk's logits and forms their gradient directly (onehot - softmax). On CUDA
   this element-wise work is torch.compile'd (one pass over the bf16 logits instead of ~8 over a
   float32 copy: +37% reference throughput on Qwen2.5-0.5B), falling back to eager if compiling fails.

Two batch layouts, same results (to float rounding) and the same [B, C] output:
- `TokenBatch` (`make_token_batch`): B right-padded rows, the model's own attention (SDPA) with a
  padding mask. Padding costs compute in proportion to the length spread of the batch.
- `PackedBatch` (`make_packed_batch`): the B sequences concatenated into ONE row of sum(lengths)
  tokens, `position_ids` restarting at 0 at each sequence, no padding at all. Attention must not
  cross sequences; the body runs with attention implementation "rlpipe_packed" (PACKED_ATTENTION),
  registered in transformers' AttentionInterface by rlpipe/engines/packed_attention.py and switched on only for that forward:
    * CUDA with bf16/fp16 weights or autocast: `torch.nn.attention.varlen.varlen_attn`, PyTorch's
      own FlashAttention-2 varlen kernel over `cu_seqlens` (torch >= 2.10; rlpipe runs on 2.11 and
      2.13, whose signatures differ: `_flash_varlen` adapts). No mask tensor, no work on masked-out
      blocks: attention costs sum(L_i^2), not (sum L_i)^2. GQA, forward and backward checked on
      an H200 with torch 2.11 against float32 SDPA (benchmarks/gpu_throughput.py --check).
    * otherwise (CPU, CI, float32 on CUDA): exact causal `scaled_dot_product_attention` within each
      sequence, one batched call per distinct sequence length.
  Why not the alternatives: transformers' `flash_attention_2` needs the flash-attn package (absent
  from the GPU image, no CPU); its SDPA path detects packing from position_ids but builds a dense
  [T, T] block-diagonal mask, which sends SDPA to a kernel that computes every masked block ((sum
  L_i)^2 work; 256 MB of mask for a 16k-token row); FlexAttention skips masked blocks but needs
  torch.compile (a C++ toolchain on CPU) and a new block mask per row. Models with sliding-window
  attention or attention softcapping are refused on the packed path.

`batched_completion_logprobs` sorts sequences by length, cuts them into token-budget batches
(`token_budget_batches`), packs each (default) and returns results in input order. bf16: pass
`autocast_dtype=torch.bfloat16` (or call inside `torch.autocast`); the head's logits are upcast to
float32 per chunk. Opt-in for training and large models: `enable_gradient_checkpointing(model)`
(recompute each decoder layer in backward, in any train/eval mode) and `compile_decoder_layers(model)`
(fuse each layer's element-wise ops: +26-54% throughput on an H200, see BENCHMARKS.md).

All log-probs are of softmax(logits / temperature), the temperature used for sampling (ALGORITHMS.md).
The body runs through the causal-LM wrapper's own forward (with an empty `logits_to_keep`; a hook
on `model.base_model` takes the hidden states) and the head is then called directly as
`model.get_output_embeddings()`. So what acts in the root forward still works: FSDP2 `fully_shard`
on the decoder layers and the root (tied or untied head; checked on CPU/gloo with 2 processes:
gradients equal to one process to 5e-7, also with gradient checkpointing), accelerate hooks.
Models that rescale logits in that forward (softcapping, logit_scale) are refused. For a PEFT
model pass `peft_model.get_base_model()` (the adapters live inside its layers).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlpipe.config import compile_layers_wanted  # noqa: F401  (re-exported: the stages import it from here)
from rlpipe.engines.base import eval_mode
from rlpipe.engines.chunked_head import ChunkLogprobs, check_plain_lm_head, fused_on_cuda, logit_stats
from rlpipe.engines.packed_attention import (PACKED_ATTENTION, attention_configs, attention_implementation,
                                             register_packed_attention)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> GPU through pinned memory, asynchronously: a pageable copy would wait for the GPU to go idle."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class TokenBatch:
    """Right-padded prompt+completion sequences, B rows of T tokens.

    completion_mask_BT is True exactly at the positions that hold completion tokens.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    completion_mask_BT: torch.Tensor
    prompt_lengths: list[int]
    completion_lengths: list[int]

    @property
    def max_completion_length(self) -> int:
        return max(self.completion_lengths, default=0)

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            input_ids_BT=to_device(self.input_ids_BT, device),
            attention_mask_BT=to_device(self.attention_mask_BT, device),
            completion_mask_BT=to_device(self.completion_mask_BT, device),
            prompt_lengths=list(self.prompt_lengths),
            completion_lengths=list(self.completion_lengths),
        )


@dataclass
class PackedBatch:
    """B prompt+completion sequences concatenated into one row of T = sum(lengths) tokens, no padding.

    Sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1]; position_ids_1T restarts at 0 there.
    """

    input_ids_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    cu_seqlens: torch.Tensor  # [B + 1] int32 (the dtype the flash kernels take)
    prompt_lengths: list[int]
    completion_lengths: list[int]

    @property
    def max_completion_length(self) -> int:
        return max(self.completion_lengths, default=0)

    @property
    def max_length(self) -> int:
        return max(p + c for p, c in zip(self.prompt_lengths, self.completion_lengths))

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            input_ids_1T=to_device(self.input_ids_1T, device),
            position_ids_1T=to_device(self.position_ids_1T, device),
            cu_seqlens=to_device(self.cu_seqlens, device),
            prompt_lengths=list(self.prompt_lengths),
            completion_lengths=list(self.completion_lengths),
        )


def _check_pairs(prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]]) -> None:
    if len(prompt_token_ids) != len(completion_token_ids):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(completion_token_ids)} completions")
    if not prompt_token_ids:
        raise ValueError("empty batch")
    for index, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")


def make_token_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    completion_token_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
) -> TokenBatch:
    """Concatenate each prompt with its completion and right-pad to the longest (CPU tensors).

    Every prompt needs at least one token: the first completion token is predicted from the last prompt position.
    """
    _check_pairs(prompt_token_ids, completion_token_ids)
    prompt_lengths = [len(p) for p in prompt_token_ids]
    completion_lengths = [len(c) for c in completion_token_ids]
    total = max(p + c for p, c in zip(prompt_lengths, completion_lengths))
    rows = [list(p) + list(c) for p, c in zip(prompt_token_ids, completion_token_ids)]
    input_ids_BT = torch.tensor([row + [pad_token_id] * (total - len(row)) for row in rows], dtype=torch.long)
    col_T = torch.arange(total)
    prompt_len_B1 = torch.tensor(prompt_lengths).unsqueeze(-1)
    seq_len_B1 = prompt_len_B1 + torch.tensor(completion_lengths).unsqueeze(-1)
    return TokenBatch(
        input_ids_BT=input_ids_BT,
        attention_mask_BT=(col_T < seq_len_B1).long(),
        completion_mask_BT=(col_T >= prompt_len_B1) & (col_T < seq_len_B1),
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
    )


def make_packed_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    completion_token_ids: Sequence[Sequence[int]],
) -> PackedBatch:
    """Concatenate every prompt+completion into one unpadded row (CPU tensors); see PackedBatch.

    Every prompt needs at least one token: the first completion token is predicted from the last prompt position.
    """
    _check_pairs(prompt_token_ids, completion_token_ids)
    prompt_lengths = [len(p) for p in prompt_token_ids]
    completion_lengths = [len(c) for c in completion_token_ids]
    lengths_B = np.asarray(prompt_lengths, dtype=np.int64) + np.asarray(completion_lengths, dtype=np.int64)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths_B)])
    tokens = np.fromiter(
        (t for p, c in zip(prompt_token_ids, completion_token_ids) for part in (p, c) for t in part),
        dtype=np.int64, count=int(cu_seqlens[-1]),
    )
    positions_T = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1], lengths_B)
    return PackedBatch(
        input_ids_1T=torch.from_numpy(tokens).unsqueeze(0),
        position_ids_1T=torch.from_numpy(positions_T).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
    )


# ---------------------------------------------------------------------------------------------
# The body: hidden states at the positions that predict completion tokens.


def _final_hidden(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """The body's last hidden states (after the final norm), computed through the causal-LM wrapper's forward.

    Calling model(...) rather than model.base_model(...) keeps what acts in the root module's
    forward working: FSDP2 `fully_shard(model)` gathers the root's parameters (embedding, final
    norm, head) there, accelerate hooks move inputs there. An empty logits_to_keep makes the wrapper
    apply its own head to no position; a forward hook on model.base_model takes the hidden states.
    """
    captured: list[torch.Tensor] = []
    handle = model.base_model.register_forward_hook(lambda module, args, out: captured.append(out.last_hidden_state))
    no_position = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
    try:
        model(**inputs, use_cache=False, logits_to_keep=no_position)
    finally:
        handle.remove()
    return captured[-1]


def _padded_body(model, batch: TokenBatch) -> tuple[torch.Tensor, ...]:
    """hidden_NH, target_N, row_N, col_N for the N completion tokens of a right-padded batch."""
    positions_BT = (batch.attention_mask_BT.cumsum(-1) - 1).clamp(min=0)
    hidden_BTH = _final_hidden(model, input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT,
                               position_ids=positions_BT)
    # Position p predicts token p+1; keep the positions whose next token is a completion token.
    row_N, pos_N = batch.completion_mask_BT[:, 1:].nonzero(as_tuple=True)
    target_N = batch.input_ids_BT[row_N, pos_N + 1]
    prompt_len_B = torch.tensor(batch.prompt_lengths, dtype=torch.long, device=row_N.device)
    return hidden_BTH[row_N, pos_N], target_N, row_N, pos_N + 1 - prompt_len_B[row_N]


def _packed_targets(batch: PackedBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pred_N (row position predicting each completion token), row_N, col_N; computed on the host."""
    prompt_B = np.asarray(batch.prompt_lengths, dtype=np.int64)
    completion_B = np.asarray(batch.completion_lengths, dtype=np.int64)
    starts_B = np.concatenate([[0], np.cumsum(prompt_B + completion_B)[:-1]])
    first_col_B = np.concatenate([[0], np.cumsum(completion_B)[:-1]])
    row_N = np.repeat(np.arange(len(prompt_B)), completion_B)
    col_N = np.arange(int(completion_B.sum())) - np.repeat(first_col_B, completion_B)
    pred_N = np.repeat(starts_B + prompt_B - 1, completion_B) + col_N
    return pred_N, row_N, col_N


def _packed_body(model, batch: PackedBatch) -> tuple[torch.Tensor, ...]:
    """hidden_NH, target_N, row_N, col_N for the N completion tokens of a packed batch."""
    device = batch.input_ids_1T.device
    pred_N, row_N, col_N = (to_device(torch.from_numpy(a), device) for a in _packed_targets(batch))
    register_packed_attention()
    with attention_implementation(attention_configs(model), PACKED_ATTENTION):
        hidden_1TH = _final_hidden(
            model, input_ids=batch.input_ids_1T, attention_mask=None, position_ids=batch.position_ids_1T,
            cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens, max_length_q=batch.max_length,
            max_length_k=batch.max_length,
        )
    return hidden_1TH[0, pred_N], batch.input_ids_1T[0, pred_N + 1], row_N, col_N


def completion_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch | PackedBatch,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the completion tokens of `batch`, as [B, C] float32, zero-padded.

    Row b, column t is completion token t of sequence b: log softmax(logits / temperature) of that
    token at the position before it; C is the longest completion. Entropy is the full-vocabulary
    entropy of the same distribution. `batch` is padded (TokenBatch) or packed (PackedBatch); both
    give the same numbers. Differentiable when grad is enabled; the caller picks the model's
    train/eval mode and any autocast. chunk_size: completion positions per LM-head call (memory ~
    chunk_size x vocab).
    """
    hidden_NH, target_N, row_N, col_N, head = completion_hidden(model, batch, temperature=temperature,
                                                                chunk_size=chunk_size)
    device = hidden_NH.device
    params = list(head.parameters())
    with_grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or any(p.requires_grad for p in params))
    pieces: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        chunk = (hidden_NH[start:start + chunk_size], target_N[start:start + chunk_size])
        if with_grad:
            pieces.append(ChunkLogprobs.apply(*chunk, head, temperature, with_entropy, *params))
        else:
            logprob_N, _, entropy_N = fused_on_cuda(logit_stats, device)(head(chunk[0]), chunk[1], temperature,
                                                                  with_entropy)
            pieces.append((logprob_N, entropy_N))

    shape = (len(batch.completion_lengths), batch.max_completion_length)

    def to_grid(stat_index: int) -> torch.Tensor:
        return completion_grid([piece[stat_index] for piece in pieces], row_N, col_N, shape, device)

    return to_grid(0), (to_grid(1) if with_entropy else None)


def completion_hidden(model: torch.nn.Module, batch: TokenBatch | PackedBatch, *, temperature: float,
                      chunk_size: int) -> tuple[torch.Tensor, ...]:
    """(hidden_NH, target_N, row_N, col_N, head): the body's hidden states at the N positions that predict a
    completion token, the token, its (row, column) in the [B, C] grid, and the LM head; checks the arguments."""
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (use 1.0 for greedy rollouts), got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    check_plain_lm_head(model)
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embedding (LM head)")
    device = next(model.parameters()).device
    batch = batch.to(device)
    body = _packed_body if isinstance(batch, PackedBatch) else _padded_body
    return (*body(model, batch), head)


def completion_grid(values: list[torch.Tensor], row_N: torch.Tensor, col_N: torch.Tensor, shape: tuple[int, int],
                    device: torch.device) -> torch.Tensor:
    """Per-position values (in N order, possibly in chunks) as a zero-padded [B, C] float32 grid."""
    grid_BC = torch.zeros(shape, dtype=torch.float32, device=device)
    if not values:
        return grid_BC
    return grid_BC.index_put((row_N, col_N), torch.cat(values))


def unpad(values_BC: torch.Tensor, lengths: Sequence[int]) -> list[np.ndarray]:
    """Split a zero-padded [B, C] grid into B float32 arrays of the given lengths."""
    grid = values_BC.detach().to(device="cpu", dtype=torch.float32).numpy()
    if len(lengths) != grid.shape[0]:
        raise ValueError(f"{len(lengths)} lengths for {grid.shape[0]} rows")
    return [grid[row, :length].copy() for row, length in enumerate(lengths)]


# ---------------------------------------------------------------------------------------------
# Many sequences: token-budget batches, results back in input order.


def token_budget_batches(lengths: Sequence[int], max_tokens_per_batch: int, *, packed: bool = False
                          ) -> list[list[int]]:
    """Group indices, longest first (ties by index), so that each batch stays within the token budget.

    Padded: rows x longest length <= budget. Packed: sum of lengths <= budget. Consecutive lengths
    in sorted order fill each batch (next fit), so a batch holds sequences of similar length and
    the grouping depends only on the lengths. A sequence longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cost = 0  # of the last batch: its token count (packed) or rows x its first, longest, length (padded)
    for index in order:
        if batches:
            grown = cost + lengths[index] if packed else (len(batches[-1]) + 1) * lengths[batches[-1][0]]
            if grown <= max_tokens_per_batch:
                batches[-1].append(index)
                cost = grown
                continue
        batches.append([index])
        cost = lengths[index]
    return batches


def batched_completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    temperature: float,
    max_tokens_per_batch: int,
    chunk_size: int,
    with_entropy: bool,
    device: torch.device | str | None = None,
    progress: Callable[[int], None] | None = None,
    packed: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Log-probs (and entropies) of every completion, one float32 array per completion, in input order.

    Runs without grad and in eval mode. packed=True (default): each batch is one unpadded row of at
    most max_tokens_per_batch prompt+completion tokens (PackedBatch); packed=False: right-padded
    rows, max_tokens_per_batch counting rows x longest prompt+completion (TokenBatch). Either way
    sequences are grouped by length, longest first, deterministically. autocast_dtype: e.g.
    torch.bfloat16 to run the model's matmuls under autocast (GPU). device: where the model lives
    (default: its own). progress: optional callback, called with the number of sequences finished after each batch.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    have = next(model.parameters()).device
    if device is not None:
        want = torch.device(device)
        if want.type != have.type or (want.index is not None and want.index != have.index):
            raise ValueError(f"model is on {have}, not on {want}: move it first")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    logprobs: list[np.ndarray | None] = [None] * len(prompts)
    entropies: list[np.ndarray | None] = [None] * len(prompts)
    autocast = (torch.autocast(device_type=have.type, dtype=autocast_dtype) if autocast_dtype is not None
                else nullcontext())
    with torch.inference_mode(), eval_mode(model), autocast:
        for indices in token_budget_batches(lengths, max_tokens_per_batch, packed=packed):
            pairs = ([prompts[i] for i in indices], [completions[i] for i in indices])
            batch = make_packed_batch(*pairs) if packed else make_token_batch(*pairs, pad_token_id=pad_token_id)
            logprobs_BC, entropy_BC = completion_logprobs(
                model, batch, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
            )
            for i, values in zip(indices, unpad(logprobs_BC, batch.completion_lengths)):
                logprobs[i] = values
            if entropy_BC is not None:
                for i, values in zip(indices, unpad(entropy_BC, batch.completion_lengths)):
                    entropies[i] = values
            if progress is not None:
                progress(len(indices))
    return logprobs, (entropies if with_entropy else None)  # type: ignore[return-value]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no transformers decoder layers")
    return layers


def compile_decoder_layers(model: torch.nn.Module, *, backend: str = "inductor") -> int:
    """torch.compile each decoder layer in place ("regional" compilation); returns the layer count.

    Why: in eager mode the small element-wise ops of a decoder layer (RMSNorm, RoPE, SwiGLU, casts
    and residual adds in float32 under autocast) move as many bytes as the matmuls take time on a
    0.5B-1.5B model; compiled, they fuse. All layers share one compiled graph (dynamic sequence
    length), so compiling costs tens of seconds once per process, not per layer. Parameter names
    are unchanged. The stages call it where `compile_layers_wanted` says so.
    """
    layers = _decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        embeddings.register_forward_hook(_hidden_states_require_grad)
    return len(layers)


def _hidden_states_require_grad(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
    """Make a frozen embedding's output require grad while gradients are on.

    Why: with frozen embeddings (LoRA) the first layer's input needs no grad and every other
    layer's does; the compiled layer then holds two training graphs, and on a GPU the first one
    compiled for 40-67 s of LoRA's 46-90 s (H100, 2026-11-28). The extra backward through the
    first layer's input is one layer's input gradient; the parameters' gradients are unchanged.
    """
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)


def compile_seconds() -> float:
    """Wall seconds torch.compile has spent in this process so far (tracing, inductor, the backward's
    compile at the first backward); 0.0 when nothing was compiled.

    Why: a stage's metrics name compilation on its own (it is fixed cost, paid once per process,
    smaller with a warm inductor cache), apart from the compute that follows.
    """
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(times) for key, times in compilation_time_metrics.items()
                     if key == "_compile.compile_inner" or key.endswith("bw_compiler")))


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each decoder layer's activations in backward instead of storing them; returns the layer count.

    Uses PyTorch's composable (hook-based, non-reentrant) checkpoint on every transformers decoder
    layer (GradientCheckpointingLayer): unlike `model.gradient_checkpointing_enable()` it also acts
    in eval mode (rlpipe trains in eval mode: no dropout), keeps parameter names (checkpoints load
    unchanged), and composes with FSDP2 `fully_shard` on the same layers. The recomputation in
    backward runs outside the forward's `with` blocks, so it re-enters the attention implementation
    the forward used (the packed path switches it only for its forward). Idempotent.
    """
    from torch.distributed._composable import checkpoint as composable_checkpoint

    layers = _decoder_layers(model)
    configs = attention_configs(model)

    def context_fn():
        used: list[str] = []

        @contextmanager
        def record() -> Iterator[None]:
            used[:] = [config._attn_implementation for config in configs]
            yield

        @contextmanager
        def replay() -> Iterator[None]:
            with attention_implementation(configs, used):
                yield

        return record(), replay()

    for layer in layers:
        if not getattr(layer, "_rlpipe_checkpointed", False):
            composable_checkpoint(layer, context_fn=context_fn)
            layer._rlpipe_checkpointed = True
    return len(layers)
