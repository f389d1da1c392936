"""Generation with Hugging Face transformers models, through rlpipe's own decoding loop.

Why not `model.generate`: rlpipe needs each sample's randomness to depend only on its own seed
(never on batch order or batch size) and needs the log-prob of every sampled token under the exact
distribution it was drawn from. Both are easiest to guarantee with a short loop that we own:

    left-pad prompts -> prefill (KV cache) -> repeat: pick tokens, append, one-token forward

Sampling draws one uniform per generated token from a per-sample `torch.Generator` seeded with
`derive_seed(request.seed, j)` and inverts the CDF of the (filtered) next-token distribution.
The uniforms are drawn on the CPU before decoding, so the random stream of a sample is the same
on every device and for every batch layout; only the model's float arithmetic can differ.

Usage:
    engine = HFEngine("models/policy", device="cuda", dtype="bfloat16", batch_size=256,
                      eos_token_ids=[151645], pad_token_id=151643)
    groups = engine.generate([PromptRequest((1, 2, 3), seed=derive_seed(0, 0, 17), n=8)], params)
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rlpipe.engines.base import Completion, PromptRequest, SamplingParams, derive_seed, eval_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Drop finished rows from the KV cache once they are at least this fraction of the rows still in it.
# Dropping copies the cache once (about one decode step of memory traffic); a fraction rather than
# "any row" bounds the number of copies to O(log batch_size) while wasting at most 1/8 of the compute.
_COMPACT_FRACTION = 1 / 8


def resolve_dtype(name: str) -> torch.dtype:
    """Map a config string ("float32" | "bfloat16" | "float16") to a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPES)}") from None


def load_causal_lm(model_dir: str | Path, *, device: str, dtype: str) -> torch.nn.Module:
    """Load a causal LM from a `save_pretrained` directory onto `device`, in eval mode."""
    from transformers import AutoModelForCausalLM  # heavy import, only when a model is loaded

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(dtype))
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------
# Sampling math: pure functions of float32 logits.


def filter_logits(logits_BV: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, then outside top-p of the renormalised rest.

    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are all kept,
    so the result does not depend on how `topk` breaks ties). top-p keeps the smallest prefix of the
    tokens sorted by probability (stable sort: ties in index order) whose mass reaches `top_p`;
    the most likely token is always kept. 0 / 1.0 turn the filters off.
    """
    vocab = logits_BV.shape[-1]
    if 0 < top_k < vocab:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        probs_BV = torch.softmax(logits_BV, dim=-1)
        sorted_BV, order_BV = torch.sort(probs_BV, dim=-1, descending=True, stable=True)
        mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
        drop_sorted_BV = mass_before_BV >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_inverse_cdf(probs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Pick token i of row b where cdf[b, i-1] <= u_b * total < cdf[b, i]; exact sampling given u ~ U[0, 1).

    The CDF is accumulated in float64 so that rounding cannot shift the mass of rare tokens, and a
    zero-probability (filtered) token adds a zero-width step, so it can never be picked.
    """
    cdf_BV = probs_BV.to(torch.float64).cumsum(dim=-1)
    target_B1 = uniforms_B.to(torch.float64).unsqueeze(-1) * cdf_BV[:, -1:]
    token_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    return token_B.clamp_(max=probs_BV.shape[-1] - 1)


def pick_next_tokens(
    logits_BV: torch.Tensor, uniforms_B: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row and return (token_B, logprob_B) under the distribution sampled from.

    Sampling: softmax(filter(logits / temperature)); the log-prob is taken from that same (renormalised)
    distribution, so with top-k/top-p it differs from the trainer's full-softmax log-prob
    (ALGORITHMS.md, 'Sampling truncation'). Greedy (temperature 0): argmax, log-prob of the untempered softmax.
    """
    logits_BV = logits_BV.float()
    if params.is_greedy:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        token_B = logits_BV.argmax(dim=-1)
    else:
        scaled_BV = filter_logits(logits_BV / params.temperature, top_k=params.top_k, top_p=params.top_p)
        logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
        token_B = sample_inverse_cdf(logprobs_BV.exp(), uniforms_B)
    return token_B, logprobs_BV.gather(-1, token_B.unsqueeze(-1)).squeeze(-1)


def draw_uniforms(seeds: Sequence[int], n_steps: int) -> torch.Tensor:
    """[len(seeds), n_steps] float64 uniforms in [0, 1); row b comes from a CPU generator seeded with seeds[b].

    CPU generation is serial, so the first k draws do not depend on n_steps: a sample generated with a
    smaller max_new_tokens sees the same random numbers for the tokens it shares.
    """
    uniforms_BN = torch.empty((len(seeds), n_steps), dtype=torch.float64)
    generator = torch.Generator(device="cpu")
    for row, seed in enumerate(seeds):
        generator.manual_seed(seed)
        uniforms_BN[row] = torch.rand(n_steps, generator=generator, dtype=torch.float64)
    return uniforms_BN


def _decode_attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """Keep PyTorch's SDPA off its cuDNN backend while decoding on CUDA.

    The KV length grows by one every step, and cuDNN attention builds a new execution plan for every
    new shape: on an H200 that cost ~45 ms per decode step of a fresh process, 4x the whole step
    otherwise. Flash / memory-efficient / math kernels have no per-shape setup.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# ---------------------------------------------------------------------------------------------


class HFEngine:
    """Batched sampling from a transformers causal LM, with per-sample seeds.

    model_dir: a `save_pretrained` directory (or use `HFEngine.from_model` with a loaded model; a LoRA adapter
        directory is loaded by `rlpipe.models.loading.load_model`, which the stages use, and passed to `from_model`).
    device, dtype: where and in which precision the weights live; logits are always cast to float32.
    batch_size: the most sequences in one forward pass (samples of several prompts share a batch).
    eos_token_ids: any of these ends a sample (and is kept as its last token).
    pad_token_id: fills left padding; any valid id works, padded positions are masked out.
    """

    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str,
        dtype: str,
        batch_size: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
    ) -> None:
        model = load_causal_lm(model_dir, device=device, dtype=dtype)
        self._setup(model, batch_size=batch_size, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        *,
        batch_size: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
    ) -> HFEngine:
        """Wrap an already loaded model (on its current device and dtype)."""
        engine = cls.__new__(cls)
        engine._setup(model, batch_size=batch_size, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        return engine

    def _setup(
        self, model: torch.nn.Module, *, batch_size: int, eos_token_ids: Sequence[int], pad_token_id: int
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(eos_token_ids) == 0:
            raise ValueError("eos_token_ids must name at least one token")
        self.model = model
        self.batch_size = batch_size
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))
        self.device = next(model.parameters()).device
        self._eos_E = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        # transformers renamed the cache argument (`past_key_values` up to 5.2x, `cache` later); the output
        # field carries the same name in each version, so read the name off the signature once.
        forward_params = inspect.signature(model.forward).parameters
        cache_names = [name for name in ("cache", "past_key_values") if name in forward_params]
        if not cache_names:
            raise TypeError(f"{type(model).__name__}.forward takes no KV cache argument")
        self._cache_arg = cache_names[0]
        self._can_keep_last_logits = "logits_to_keep" in forward_params

    def generate(
        self,
        requests: Sequence[PromptRequest],
        params: SamplingParams,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Completion]]:
        """Sample `request.n` completions per request; results in request order, samples in index order.

        progress: optional callback, called with the number of samples finished after each batch.
        """
        samples = [(req_idx, sample_idx) for req_idx, req in enumerate(requests) for sample_idx in range(req.n)]
        # Longest prompts first: similar lengths share a batch (little padding), and an out-of-memory
        # error shows up in the first batch rather than the last.
        order = sorted(range(len(samples)), key=lambda s: -len(requests[samples[s][0]].prompt_token_ids))
        results: list[list[Completion | None]] = [[None] * req.n for req in requests]
        with torch.inference_mode(), eval_mode(self.model), _decode_attention_backends(self.device):
            for start in range(0, len(order), self.batch_size):
                batch = [samples[s] for s in order[start : start + self.batch_size]]
                prompts = [requests[req_idx].prompt_token_ids for req_idx, _ in batch]
                seeds = [derive_seed(requests[req_idx].seed, sample_idx) for req_idx, sample_idx in batch]
                for (req_idx, sample_idx), completion in zip(batch, self._generate_batch(prompts, seeds, params)):
                    results[req_idx][sample_idx] = completion
                if progress is not None:
                    progress(len(batch))
        return results  # type: ignore[return-value]  # every slot was filled above

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: object | None,
    ) -> tuple[torch.Tensor, object]:
        """One model call; returns (float32 logits of the last position [R, V], the updated KV cache)."""
        kwargs: dict[str, object] = {}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if self._can_keep_last_logits:
            kwargs["logits_to_keep"] = 1  # the prefill needs only the last position's logits
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :].float(), getattr(out, self._cache_arg)

    def _prefill(
        self, prompts: Sequence[Sequence[int]], mask_BP: torch.Tensor, positions_BP: torch.Tensor
    ) -> tuple[torch.Tensor, object]:
        """Run the left-padded prompts; returns (last-position float32 logits [B, V], KV cache for B rows).

        The samples of one prompt sit next to each other in a batch: each distinct prompt is run once,
        then its KV cache and logits are repeated for every sample that shares it.
        """
        device, prompt_len = self.device, mask_BP.shape[1]
        distinct: dict[tuple[int, ...], int] = {}  # prompt -> index among the distinct prompts
        first_rows: list[int] = []  # the first row holding each distinct prompt
        source: list[int] = []  # row -> index of its distinct prompt
        for row, prompt in enumerate(prompts):
            key = tuple(prompt)
            if key not in distinct:
                distinct[key] = len(first_rows)
                first_rows.append(row)
            source.append(distinct[key])
        first_U = torch.tensor(first_rows, dtype=torch.long, device=device)
        ids_UP = torch.tensor(
            [[self.pad_token_id] * (prompt_len - len(p)) + list(p) for p in distinct], dtype=torch.long, device=device
        )
        logits_UV, cache = self._forward(ids_UP, mask_BP[first_U], positions_BP[first_U], None)
        if len(first_rows) == len(prompts):
            return logits_UV, cache
        source_B = torch.tensor(source, dtype=torch.long, device=device)
        cache.reorder_cache(source_B)  # index_select with repeats: one cache row per sample
        return logits_UV[source_B], cache

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion]:
        """Decode one batch of samples (one prompt and one seed per row) to completion."""
        device, pad = self.device, self.pad_token_id
        n_rows, n_new = len(prompts), params.max_new_tokens
        prompt_len = max(len(p) for p in prompts)
        prompt_len_B = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)

        # Left padding puts every row's newest token in the last column. The mask covers the whole run:
        # 0 on left pads, 1 on prompt tokens and on every generated column. Position ids count real
        # tokens only, so a row's rotary positions are the same as if it were alone.
        mask_BL = torch.ones((n_rows, prompt_len + n_new), dtype=torch.long, device=device)
        mask_BL[:, :prompt_len] = (
            torch.arange(prompt_len, device=device) >= (prompt_len - prompt_len_B).unsqueeze(-1)
        ).long()
        positions_BP = (mask_BL[:, :prompt_len].cumsum(-1) - 1).clamp(min=0)
        uniforms_BN = draw_uniforms(seeds, n_new).to(device)

        tokens_BN = torch.full((n_rows, n_new), pad, dtype=torch.long, device=device)
        logprobs_BN = torch.zeros((n_rows, n_new), dtype=torch.float32, device=device)
        n_generated_B = torch.zeros(n_rows, dtype=torch.long, device=device)
        stopped_B = torch.zeros(n_rows, dtype=torch.bool, device=device)

        logits_RV, cache = self._prefill(prompts, mask_BL[:, :prompt_len], positions_BP)
        # R rows are in the KV cache: rows_R maps them to batch rows; done_R marks those that have
        # produced EOS and wait to be dropped (they are fed a token but their output is ignored).
        rows_R = torch.arange(n_rows, device=device)
        done_R = torch.zeros(n_rows, dtype=torch.bool, device=device)
        for step in range(n_new):
            token_R, logprob_R = pick_next_tokens(logits_RV, uniforms_BN[rows_R, step], params)
            live_R = ~done_R
            tokens_BN[rows_R, step] = torch.where(live_R, token_R, pad)
            logprobs_BN[rows_R, step] = torch.where(live_R, logprob_R, 0.0)
            n_generated_B[rows_R] += live_R.long()
            hit_eos_R = live_R & torch.isin(token_R, self._eos_E)
            stopped_B[rows_R] |= hit_eos_R
            done_R = done_R | hit_eos_R
            if step == n_new - 1:
                break
            n_done = int(done_R.sum())  # the one host sync per step
            if n_done == rows_R.numel():
                break
            if n_done >= _COMPACT_FRACTION * rows_R.numel():
                keep_K = (~done_R).nonzero().squeeze(-1)
                cache.reorder_cache(keep_K)  # index_select on the batch dim of every layer's cache
                rows_R, token_R, done_R = rows_R[keep_K], token_R[keep_K], done_R[keep_K]
            logits_RV, cache = self._forward(
                token_R.unsqueeze(-1),
                mask_BL[rows_R, : prompt_len + step + 1],
                (prompt_len_B[rows_R] + step).unsqueeze(-1),
                cache,
            )

        lengths = n_generated_B.tolist()
        stopped = stopped_B.tolist()
        token_rows = tokens_BN.tolist()
        logprob_rows = logprobs_BN.tolist()
        return [
            Completion(
                token_ids=token_rows[row][: lengths[row]],
                sampler_logprobs=logprob_rows[row][: lengths[row]],
                finish_reason="stop" if stopped[row] else "length",
            )
            for row in range(n_rows)
        ]
