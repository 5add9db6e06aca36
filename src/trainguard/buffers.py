"""Byte views of tensors and page-aligned host buffers: what the write and read paths (``io``,
``reads``), the staging pool (``stage``) and the savers hand to ``pwrite``/``preadv``."""

from __future__ import annotations

import functools
import mmap
import threading
import warnings

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


def holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds all of its bytes (``storage.resize_(0)``, as FSDP's
    freeing of unsharded parameters does, leaves a tensor pointing at nothing). Asked by
    ``capture._leaf`` (refused at save), ``loader._load`` (a destination) and ``stagecopy``."""
    st = t.untyped_storage()
    if t.is_contiguous():  # the common case first: 0.45 us a tensor (a load of 10,000 asks for each)
        return st.data_ptr() != 0 and st.nbytes() >= (t.storage_offset() + t.numel()) * t.element_size() or not t.numel()
    if st.data_ptr() == 0 or not t.numel():
        return st.data_ptr() != 0 or not t.numel()
    # The last element's offset: a view whose elements overlap (unfold) spans less than its nbytes.
    end = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return st.nbytes() >= (t.storage_offset() + end) * t.element_size()


def may_overlap(t: torch.Tensor) -> bool:
    """(``capture._leaf``, ``loader._expanded``) Whether two elements of non-contiguous ``t`` may share memory (stride 0 of ``expand``,
    ``as_strided``): its contiguous copy could be far larger than its memory. Dense layouts
    (channels_last, transposes) and slices with gaps (``x[:, ::2]``) are not: with the
    dimensions in stride order, each stride must pass the last offset the smaller ones reach
    (``x[:, ::2]`` of a 5-wide ``x``: columns reach 4, rows step 5)."""
    reach = 0  # the largest offset reached by the dimensions taken so far
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


@functools.cache
def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """(``loader._load``, strict=False) Whether ``copy_`` casts ``src`` into ``dst`` (no kernel for ``float4_e2m1fn_x2``; it failed
    after the reads, other tensors of the state already overwritten)."""
    try:
        with warnings.catch_warnings():  # complex to real: "discards the imaginary part"
            warnings.simplefilter("ignore")
            torch.zeros(1, dtype=dst).copy_(torch.zeros(1, dtype=torch.uint8).view(src) if src.itemsize == 1 else
                                            torch.zeros(1, dtype=src))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def in_place(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a load can read bytes of ``dtype`` straight into ``t``'s memory (``loader`` and
    ``aliases`` ask): a contiguous CPU tensor of that dtype whose memory holds its values as
    they are (no conjugate or negative bit: ``x.conj()``, ``torch._neg_view``)."""
    return t.is_cpu and t.dtype == dtype and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view, same device)."""
    return t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def mapped_empty(nbytes: int, phase: int = 0) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` in an anonymous mapping of its own, its first byte
    ``phase`` bytes past a page; unmapped when the tensor is freed."""
    m = mmap.mmap(-1, max(phase + nbytes, 1))
    return torch.frombuffer(m, dtype=torch.uint8)[phase : phase + nbytes]


class ScratchPool:
    """Scratch buffers of one read (``io.read_targets``: a resharding load's partial blocks and
    column windows), each in a mapping of its own, handed back after use and reused (at most
    ``keep`` kept): gone with the pool, not left as holes in the malloc heap between the tensors
    the load creates. From ``torch.empty`` they came from the heap once glibc's dynamic mmap
    threshold rose past their size, and those holes stayed in the process (a fresh Adam loaded
    2 -> 3 ranks: 34-90 MiB more peak RSS per rank than the 85 MiB of state it created;
    tests/test_hunt47_reshardcost.py). Reused, not mapped afresh each time: a fresh mapping's
    page faults made a column-sharded load 2-3x slower. Thread-safe."""

    GRAIN = 1 << 20  # sizes rounded up to this, so that a window's buffer fits the next window

    def __init__(self, keep: int) -> None:
        self.keep, self.lock = keep, threading.Lock()
        self.free: list[torch.Tensor] = []

    def take(self, nbytes: int, phase: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base, view)``: ``view`` is ``nbytes`` starting ``phase`` bytes past a page of ``base``;
        hand ``base`` back with :meth:`give` once ``view`` is no longer used."""
        need = phase + nbytes
        with self.lock:
            i = next((i for i, b in enumerate(self.free) if b.numel() >= need), None)
            base = None if i is None else self.free.pop(i)
        if base is None:
            base = mapped_empty(-(-need // self.GRAIN) * self.GRAIN)
        return base, base[phase:need]

    def give(self, base: torch.Tensor) -> None:
        """``io._Scratch.done``, once the op's last piece is copied out: ``base`` kept for the next
        op (past ``keep`` it is dropped, and unmapped with its last view)."""
        with self.lock:
            if len(self.free) < self.keep:
                self.free.append(base)


def aligned_empty(nbytes: int, align: int = PAGE_ALIGN, phase: int = 0) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte sits ``phase`` bytes past an
    ``align``-aligned address."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    shift = (phase - raw.data_ptr()) % align
    return raw[shift : shift + nbytes]
