"""Byte views of tensors and page-aligned host buffers: what the write and read paths (``io``,
``reads``), the staging pool (``stage``) and the savers hand to ``pwrite``/``preadv``."""

from __future__ import annotations

import torch

from .planner import PAGE

PAGE_ALIGN = PAGE  # coalescing buffers start on a page: their pages can go through direct I/O

# dtypes whose tensors .numpy() takes as they are (not bfloat16, the float8s, ...)
_NUMPY_DTYPES = frozenset(getattr(torch, n) for n in "float64 float32 float16 int64 int32 int16 int8 uint8 bool".split())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype in _NUMPY_DTYPES and t.dim() and not t.requires_grad and t.is_contiguous():
        return memoryview(t.numpy()).cast("B")  # 1 us instead of 3: 10,000 tensors are saved and loaded
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def in_place(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a load can read bytes of ``dtype`` straight into ``t``'s memory (``loader`` and
    ``aliases`` ask): a contiguous CPU tensor of that dtype whose memory holds its values as
    they are (no conjugate or negative bit: ``x.conj()``, ``torch._neg_view``)."""
    return t.is_cpu and t.dtype == dtype and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view, same device)."""
    return t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def aligned_empty(nbytes: int, align: int = PAGE_ALIGN, phase: int = 0) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte sits ``phase`` bytes past an
    ``align``-aligned address."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    shift = (phase - raw.data_ptr()) % align
    return raw[shift : shift + nbytes]
