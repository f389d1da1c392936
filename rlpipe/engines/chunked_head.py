"""The chunked LM head: log-probs (and entropies) from chunks of hidden states, no [N, V] float32 tensor.

With autograd on, each chunk is `ChunkLogprobs`, whose backward recomputes the chunk's logits and
forms their gradient directly; on CUDA the element-wise work is compiled (`fused_on_cuda`). Used by
`rlpipe.engines.logprobs.completion_logprobs`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

def check_plain_lm_head(model: torch.nn.Module) -> None:
    """Refuse models whose causal-LM forward rescales logits after the head (we apply the head ourselves)."""
    config = getattr(model, "config", None)
    for name, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0)):
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise NotImplementedError(
                f"{type(model).__name__} post-processes logits (config.{name}={value}); "
                "chunked log-probs support plain linear LM heads only"
            )


def logit_stats(
    logits_NV: torch.Tensor, target_N: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """log p(target), logsumexp and (optionally) entropy of softmax(logits / temperature), in float32.

    log p(target) = z_target - logsumexp(z) needs no [N, V] log-softmax; entropy = logsumexp(z) -
    sum_v p_v z_v. A pure function: compiled on CUDA into one pass over the bf16 logits (see fused_on_cuda).
    """
    z_NV = logits_NV.float() / temperature
    lse_N = torch.logsumexp(z_NV, dim=-1)
    target_logprob_N = z_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1) - lse_N
    if not with_entropy:
        return target_logprob_N, lse_N, None
    entropy_N = lse_N - (torch.exp(z_NV - lse_N.unsqueeze(-1)) * z_NV).sum(dim=-1)
    return target_logprob_N, lse_N, entropy_N


def _logit_grad(
    logits_NV: torch.Tensor, target_N: torch.Tensor, lse_N: torch.Tensor, entropy_N: torch.Tensor | None,
    grad_logprob_N: torch.Tensor, grad_entropy_N: torch.Tensor | None, temperature: float,
) -> torch.Tensor:
    """d/d logits of sum(g * log p(target) + g_H * entropy), in the logits' dtype.

    With z = logits / T and log p = z - lse: d log p(target)/dz = onehot - p and dH/dz = -p (log p + H),
    so dz = -p (g + g_H (log p + H)) + g onehot, and d logits = dz / T. Pure, like logit_stats.
    """
    logp_NV = logits_NV.float() / temperature - lse_N.unsqueeze(-1)
    coeff_NV = grad_logprob_N.unsqueeze(-1)
    if entropy_N is not None and grad_entropy_N is not None:
        coeff_NV = coeff_NV + grad_entropy_N.unsqueeze(-1) * (logp_NV + entropy_N.unsqueeze(-1))
    grad_NV = (-torch.exp(logp_NV) * coeff_NV).scatter_add(-1, target_N.unsqueeze(-1), grad_logprob_N.unsqueeze(-1))
    return (grad_NV / temperature).to(logits_NV.dtype)


_FUSED: dict[Callable, Callable] = {}


def fused_on_cuda(fn: Callable, device: torch.device) -> Callable:
    """`fn` compiled with torch.compile on CUDA, `fn` itself elsewhere or if compiling fails.

    Eager, the head's element-wise work (float32 cast, logsumexp, exp, gather; and in backward the
    softmax gradient) makes ~6-10 passes over a [chunk, V] float32 buffer: as slow as the head's
    matmul itself. Compiled, it is one or two passes over the bf16 logits. Compilation happens on the
    first chunk of a process (tens of seconds), again once for the first chunk of another size.
    """
    if device.type != "cuda":
        return fn
    if fn not in _FUSED:
        compiled = torch.compile(fn)

        def run(*args):
            if _FUSED[fn] is fn:
                return fn(*args)
            try:
                return compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # no Triton, an unsupported GPU, ...: stay correct, just slower
                warnings.warn(f"torch.compile of {fn.__name__} failed, using eager: {error}", stacklevel=2)
                _FUSED[fn] = fn
                return fn(*args)

        _FUSED[fn] = run
    return _FUSED[fn]


class ChunkLogprobs(torch.autograd.Function):
    """One chunk's log-probs (and entropies) with a hand-written backward that recomputes the chunk's logits.

    Saves only the chunk's hidden states and per-row scalars; backward recomputes head(hidden)
    (same autocast state as forward), forms d logits directly (_logit_grad, fused_on_cuda, instead
    of autograd's graph through cast, logsumexp, gather and softmax), then back-propagates it through
    the head. Extra inputs: the head's parameters, so that autograd returns their gradients.
    """

    @staticmethod
    def forward(ctx, hidden_NH, target_N, head, temperature, with_entropy, *params):
        device_type = hidden_NH.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.head, ctx.temperature, ctx.n_params = head, temperature, len(params)
        with torch.no_grad():
            stats = fused_on_cuda(logit_stats, hidden_NH.device)
            logprob_N, lse_N, entropy_N = stats(head(hidden_NH), target_N, temperature, with_entropy)
        if entropy_N is None:
            entropy_N = lse_N.new_zeros(0)
            ctx.mark_non_differentiable(entropy_N)
        ctx.save_for_backward(hidden_NH, target_N, lse_N, entropy_N if with_entropy else None)
        return logprob_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N):
        hidden_NH, target_N, lse_N, entropy_N = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        params = [p for p in ctx.head.parameters() if p.requires_grad]
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            hidden = hidden_NH.detach().requires_grad_(ctx.needs_input_grad[0])
            logits_NV = ctx.head(hidden)
        if grad_logprob_N is None:
            grad_logprob_N = torch.zeros_like(lse_N)
        if entropy_N is None or grad_entropy_N is None:
            entropy_N = grad_entropy_N = None
        grad_NV = fused_on_cuda(_logit_grad, lse_N.device)(logits_NV.detach(), target_N, lse_N, entropy_N,
                                                           grad_logprob_N, grad_entropy_N, ctx.temperature)
        inputs = ([hidden] if ctx.needs_input_grad[0] else []) + params
        grads = list(torch.autograd.grad(logits_NV, inputs, grad_NV, allow_unused=True)) if inputs else []
        grad_hidden = grads.pop(0) if ctx.needs_input_grad[0] else None
        by_param = {id(p): g for p, g in zip(params, grads)}
        grad_params = [by_param.get(id(p)) for p in ctx.head.parameters()]
        return (grad_hidden, None, None, None, None, *grad_params[:ctx.n_params])

