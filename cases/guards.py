"""The memory around what a kernel is handed: every input lies inside poisoned guard bands.

A kernel that reads past the end of an input (FLA #1134: ``fused_recurrent_kda`` reads ``g`` out of bounds for
K = 60 and 100) reads whatever lies there; in a fresh tensor of exactly its size that is often another tensor's
values or zeros, and the answer can come out right. ``materialize`` hands every input as a view into memory
with ``GUARD`` elements of poison before its first element and after its last (NaN for floats, a huge value for
integers), the values and strides unchanged, so such a read shows as a wrong or non-finite result; the call
contract (kernels/guard.py) holds the bands to coming back unchanged, so a write past an input's end is named.
"""

from __future__ import annotations

import torch

# Elements of poison on each side: 64 keeps every view's alignment of 128 bytes and more.
GUARD = 64
INTEGER_POISON = 2**40


def memory_of(x: torch.Tensor) -> torch.Tensor:
    """The whole memory ``x`` is a view into, flat (its storage, in ``x``'s dtype)."""
    count = x.untyped_storage().nbytes() // x.element_size()
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), 0, (count,), (1,))


def extent(x: torch.Tensor) -> tuple[int, int]:
    """The elements of ``memory_of(x)`` that ``x`` spans: first, one past the last."""
    if x.numel() == 0:
        return int(x.storage_offset()), int(x.storage_offset())
    span = sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride(), strict=True)) + 1
    return int(x.storage_offset()), int(x.storage_offset() + span)


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """NaN for floats; for integers a huge value (as large as the type holds, where 2^40 does not fit)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return min(INTEGER_POISON, torch.iinfo(dtype).max)


def guarded(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The same tensors (values, shapes, strides) moved into memory with poison bands before and after; tensors
    that share one memory (views of one fused buffer) share one guarded copy of it."""
    copies: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int]] = {}
    out: list[torch.Tensor | None] = []
    for x in tensors:
        if x is None:
            out.append(None)
            continue
        key = (x.untyped_storage().data_ptr(), x.dtype)
        if key not in copies:
            memory = memory_of(x)
            bigger = torch.full((memory.numel() + 2 * GUARD,), poison_value(x.dtype), dtype=x.dtype, device=x.device)
            bigger[GUARD : GUARD + memory.numel()].copy_(memory)
            copies[key] = (bigger, GUARD)
        bigger, shift = copies[key]
        out.append(bigger.as_strided(x.shape, x.stride(), x.storage_offset() + shift))
    return tuple(out)


def bands(x: torch.Tensor) -> torch.Tensor:
    """The memory around ``x`` (before its first element and after its last), flat: a copy, to compare."""
    memory = memory_of(x)
    first, end = extent(x)
    return torch.cat([memory[:first], memory[end:]])
