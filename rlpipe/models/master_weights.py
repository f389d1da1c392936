"""A bf16 checkpoint's float32 master weights, kept as the 16 low bits that bf16 rounding drops.

Why: train saves the policy in its own dtype (bf16) for generation and the reference pass, and the
exact float32 weights for the next train stage, so that updates smaller than bf16's precision are
not rounded away between iterations. A full float32 copy is 4 bytes a parameter beside bf16's 2:
for a Qwen2.5-0.5B shape 2 GB of a 3 GB checkpoint, written, hashed by DVC, cached and read every
iteration. The bf16 weights already hold the top 16 bits of each float32 weight up to the rounding,
so the float32 value is recovered exactly from them and 16 more bits: 2 bytes a parameter.

The arithmetic, on the weights' bit patterns: bf16 rounds a float32 to nearest, ties to even, on the
low 16 bits of its 32. With ``m`` the float32 bits and ``r`` those of the rounded value widened back
to float32 (exact), ``d = m - r`` lies in [-0x8000, 0x8000] (same sign: the difference of the
magnitudes' bits). Stored as int16, d covers [-0x8000, 0x7fff]; the one value beyond, d = +0x8000
(a tie rounded down to an even ``r``), wraps to -0x8000 and its index is recorded ("ties": about
one weight in 131,072). A tensor whose difference does not fit (a NaN whose rounding changed its
sign) is kept as full float32 instead. `join` is the exact inverse of `split` (tests/models/test_checkpoint.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

LOW_BITS_FILE = "low_bits.safetensors"
FORMAT = "rlpipe/bf16-low-bits/1"
_TIE = 0x8000


def storage_key(tensor: torch.Tensor) -> tuple:
    """Equal for the names of one tensor in a state dict (tied embeddings), different otherwise."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def split(master: torch.Tensor, rounded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(low, ties)`` of a float32 tensor against its bf16 rounding: the int16 differences of the bit
    patterns, and the flat indices where the difference is +0x8000 (stored as -0x8000, int16's wrap);
    None when a difference does not fit (a NaN whose rounding changed its sign bit).

    ``rounded``: the bf16 tensor the checkpoint saves for ``master``, when the caller has converted it
    already (then the low bits complete exactly the bytes written); else converted here."""
    if master.dtype != torch.float32:
        return None
    m = master.detach().contiguous().view(torch.int32)
    r = (master.detach().to(torch.bfloat16) if rounded is None else rounded).to(torch.float32).view(torch.int32)
    d = m - r  # exact, or wrapped where m is NaN: then out of range, or still m - r modulo 2**32
    lowest, highest = torch.aminmax(d)
    if int(lowest) < -_TIE or int(highest) > _TIE:
        return None
    if int(highest) == _TIE:
        ties = (d == _TIE).reshape(-1).nonzero().reshape(-1)
    else:
        ties = torch.empty(0, dtype=torch.int64, device=d.device)
    return d.to(torch.int16), ties


def join(rounded: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> None:
    """Turn ``rounded`` (a float32 tensor holding the bf16 weights, widened) into the exact master
    weights, in place."""
    bits = rounded.view(torch.int32)
    bits.add_(low.to(device=bits.device, dtype=torch.int32))  # widened first: twice as fast as a mixed add
    if ties.numel():
        flat = bits.view(-1)
        index = ties.to(bits.device)
        flat[index] = flat[index] + 2 * _TIE  # stored as -0x8000, meant +0x8000


def low_bits_tensors(state: dict[str, torch.Tensor],
                     rounded: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What `save_low_bits` writes for a float32 state dict (tensors that share storage once, under
    their first name, as `save_pretrained` keeps them); ``rounded``: its bf16 conversion, by name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, tensor in state.items():
        if tensor.dtype != torch.float32:
            continue
        key = storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        parts = split(tensor, None if rounded is None else rounded.get(name))
        if parts is None:
            out[f"{name}.full"] = tensor.detach().cpu().contiguous()
            continue
        low, ties = parts
        out[name] = low.cpu()
        if ties.numel():
            out[f"{name}.ties"] = ties.cpu()
    return out


def save_low_bits(state: dict[str, torch.Tensor], path: Path, rounded: dict[str, torch.Tensor] | None = None) -> None:
    from safetensors.torch import save_file

    save_file(low_bits_tensors(state, rounded), str(path), metadata={"format": FORMAT})


def apply_low_bits(model: torch.nn.Module, path: Path) -> None:
    """Make ``model``, loaded in float32 from the bf16 weights beside ``path``, hold the exact master
    weights. Raises ValueError when the file does not fit the model."""
    from safetensors import safe_open

    state = model.state_dict()
    device = next(iter(state.values())).device if state else torch.device("cpu")
    try:
        opened = safe_open(str(path), "pt", device=str(device))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    with opened as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file")
        names = set(f.keys())
        for name in sorted(names):
            if name.endswith(".ties"):
                continue
            if name.endswith(".full"):
                target = _float32_entry(state, name[:-len(".full")], path)
                with torch.no_grad():
                    target.copy_(f.get_tensor(name))
                continue
            target = _float32_entry(state, name, path)
            low = f.get_tensor(name)
            if low.shape != target.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(low.shape)}, the model's {tuple(target.shape)}")
            ties = f.get_tensor(f"{name}.ties") if f"{name}.ties" in names else torch.empty(0, dtype=torch.int64)
            with torch.no_grad():
                join(target, low, ties)


def _float32_entry(state: dict[str, torch.Tensor], name: str, path: Path) -> torch.Tensor:
    target = state.get(name)
    if target is None or target.dtype != torch.float32:
        raise ValueError(f"{path}: {name} is not a float32 weight of the model")
    return target
