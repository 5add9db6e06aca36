"""``convert``'s import of a ``torch.distributed.checkpoint`` (DCP) directory, streamed: the
tensors are read from the ``.distcp`` files in batches of up to 256 MiB (a larger tensor in
pieces) and written into a new trainguard checkpoint by ``consolidate.write_full``, so memory
holds one batch, not the state (before session 51: ``dcp.load`` of the whole state, then
``tg.save``: a 1 GiB tensor took 2 GiB).

``convert.convert`` calls :func:`save_dcp_import` with the state ``dcp_import.read_dcp`` built
(its non-tensor values read, each tensor a ``meta`` placeholder; ``places`` maps a placeholder to
its DCP key). One process, no process group. DCP's on-disk format (torch's ``FileSystemWriter``):
each item of the metadata's ``storage_data`` is a byte range of a ``.distcp`` file holding one
``torch.save`` of a tensor chunk (a zip whose storage is stored uncompressed); its storage's place
in the file is read from the zip's directory and the pickle's tensor record, which is parsed,
never run. A chunk saved in another form (non-contiguous strides, a class other than a plain
tensor, a conjugate or negative view: its bytes are not its values) is read whole by
``torch.load(weights_only=True)``: correct, holding that chunk. Items written through stream
transforms (DCP's ``_extensions``, e.g. compression) are read by ``dcp.load``, whole, as before
(``convert._read_foreign``).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import __version__, layout
from .dtypes import DTYPE_NAMES
from .errors import CheckpointError, UnsupportedValueError
from .flatten import flatten
from .io import DEFAULT_BLOCK
from .manifest import Manifest, TensorEntry
from .planner import Box
from .storage import for_path


def save_dcp_import(dst: str, state: Mapping[str, Any], places: dict[int, tuple[str, torch.Tensor]], src: str, meta: Any) -> Manifest:
    """Write ``state`` (entries of plain values and ``meta`` placeholder tensors) as the trainguard
    checkpoint ``dst``, as ``tg.save(dst, state)`` of the real tensors would hold it (the same
    skeletons, tensor paths, dtypes and values; one data file, ``layout="full"``), each
    placeholder's values read from DCP key ``places[id(t)][0]`` of the directory ``src``
    (``meta``: its metadata). Raises ``StepExistsError`` where ``dst`` is a checkpoint already."""
    from .capture import _check_key, _check_shape
    from .consolidate import whole_batches, write_full

    dstore, target = for_path(dst, follow_link=True)
    layout.check_target(target, None)
    objects: dict[str, Any] = {}
    leaves: dict[str, tuple[str, TensorEntry]] = {}
    for key, value in state.items():
        _check_key(key)
        skel, tensors = flatten(value, key)  # what capture gives a plain value (a dict, list, tensor)
        objects[key] = {"skeleton": skel}
        for path, t in tensors.items():
            if (dtype := DTYPE_NAMES.get(t.dtype)) is None:
                raise UnsupportedValueError(f"{path}: dtype {t.dtype} is not one trainguard stores")
            _check_shape(path, tuple(t.shape), t.element_size())
            # a tensor among a pickled value's (a tuple of tensors, one DCP item) was read: written from memory
            held = places.get(id(t))
            leaves[path] = (held[0] if held is not None else t.resolve_conj().resolve_neg(), TensorEntry(dtype, list(t.shape), []))
    items = [(p, leaves[p][1]) for p in sorted(leaves)]
    reader = DcpReader(src, meta, {p: leaves[p][0] for p in leaves})
    parent, name = os.path.split(target.rstrip("/"))

    def batches(offs: list[int], owners: list[int]) -> Iterator[Any]:
        return whole_batches(None, "", None, items, offs, owners=owners, read=reader)

    def manifest(tensors: dict[str, TensorEntry], files: dict[str, int]) -> Manifest:
        from .tied import format_for

        return Manifest(step=layout.parse_step(name) or 0, world_size=1, created=time.time(), layout="full",
                        block_size=DEFAULT_BLOCK, files=files, objects=objects, tensors=tensors, metadata={},
                        library=f"trainguard {__version__}", torch_version=torch.__version__,
                        format_version=format_for(tensors.values()))

    try:
        return write_full(dstore, parent, name, items, batches, manifest)
    except OSError as e:  # as tg.save raises it: a full disk is a DiskFullError; reading src failed: what and where
        from .storage._diskfull import save_failed

        raise save_failed(e, dst) from e
    finally:
        reader.close()


def transformed(meta: Any) -> bool:
    """Whether any DCP item was written through stream transforms (``FileSystemWriter(_extensions=...)``,
    e.g. zstd compression): not raw ``torch.save`` bytes, so ``convert`` reads that checkpoint with
    ``dcp.load``, the whole state in memory (as every DCP import before session 51), not streamed."""
    return any(getattr(info, "transform_descriptors", None) for info in (meta.storage_data or {}).values())


class DcpReader:
    """The ``read`` of ``consolidate.whole_batches`` for a DCP directory: ``plan`` a box of a
    tensor into ``dest``, ``run`` a batch's plans (in order; each reads only the byte range of
    each saved chunk that the box needs)."""

    def __init__(self, path: str, meta: Any, fqns: dict[str, str | torch.Tensor]) -> None:
        self.path, self.meta, self.fqns = path, meta, fqns
        self.fds: dict[str, int] = {}
        self.heads: dict[tuple[str, int], Any] = {}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def plan(self, path: str, e: TensorEntry, box: Box, dest: torch.Tensor) -> tuple[str | torch.Tensor, Box, torch.Tensor]:
        return (self.fqns[path], box, dest)

    def run(self, plans: list[tuple[str | torch.Tensor, Box, torch.Tensor]]) -> None:
        try:
            for fqn, box, dest in plans:
                if isinstance(fqn, torch.Tensor):  # read already (a pickled value's)
                    dest.copy_(fqn[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))])
                else:
                    self._read(fqn, box, dest)
        except OSError as e:  # the source's (missing, unreadable), as the import said it before
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"cannot read {self.path} as dcp: {type(e).__name__}: {e}") from e

    def _read(self, fqn: str, box: Box, dest: torch.Tensor) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        if dest.numel() == 0:
            return
        md = self.meta.state_dict_metadata[fqn]
        covered = 0
        for c in md.chunks:
            lo = [max(a, b) for a, b in zip(box.offsets, c.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(box.offsets, box.sizes, c.offsets, c.sizes)]
            if any(h <= x for x, h in zip(lo, hi)):
                continue
            sizes = [h - x for x, h in zip(lo, hi)]
            covered += math.prod(sizes)
            info = self.meta.storage_data[MetadataIndex(fqn, c.offsets)]
            part = dest[tuple(slice(x - b, h - b) for x, h, b in zip(lo, hi, box.offsets))]
            self._chunk(fqn, info, list(c.sizes), [x - b for x, b in zip(lo, c.offsets)], sizes, part)
        if covered != dest.numel():
            raise CheckpointError(f"{self.path}: the saved chunks of {fqn!r} cover {covered} of the {dest.numel()} elements "
                                  f"at {list(box.offsets)} (sizes {list(box.sizes)}); the DCP checkpoint is incomplete")

    def _fd(self, rel: str) -> int:
        if rel not in self.fds:
            if os.path.basename(rel) != rel or rel in ("", ".", ".."):
                raise CheckpointError(f"{self.path}: the metadata names file {rel!r}, not a file of the directory")
            self.fds[rel] = os.open(os.path.join(self.path, rel), os.O_RDONLY)
        return self.fds[rel]

    def _chunk(self, fqn: str, info: Any, shape: list[int], lo: list[int], sizes: list[int], part: torch.Tensor) -> None:
        """Elements ``lo`` + ``sizes`` of the saved chunk (of ``shape``) in DCP item ``info`` into ``part``."""
        fd = self._fd(info.relative_path)
        key = (info.relative_path, info.offset)
        if key not in self.heads:
            self.heads[key] = _head(fd, info.offset, info.length, shape, part.dtype)
        head = self.heads[key]
        if head is None:  # not the plain form: torch.load of the item, whole
            with os.fdopen(os.dup(fd), "rb") as f:
                t = torch.load(_Slice(f, info.offset, info.length), map_location="cpu", weights_only=True)
            part.copy_(t[tuple(slice(x, x + n) for x, n in zip(lo, sizes))])
            return
        pos, size = head
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        first = sum(x * s for x, s in zip(lo, strides))
        count = sum((x + n - 1) * s for x, n, s in zip(lo, sizes, strides)) - first + 1
        if count == part.numel() and part.is_contiguous():  # one run of the chunk: read straight into the batch
            _pread(fd, memoryview(part.reshape(-1).view(torch.uint8).numpy()), pos + first * size, self.path, fqn)
            return
        buf = torch.empty(count * size, dtype=torch.uint8)
        _pread(fd, memoryview(buf.numpy()), pos + first * size, self.path, fqn)
        part.copy_(torch.as_strided(buf.view(part.dtype), sizes, strides))


def _pread(fd: int, view: memoryview, at: int, path: str, fqn: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], at + done)
        if n <= 0:
            raise CheckpointError(f"{path}: the file of {fqn!r} ends before its data (truncated?)")
        done += n


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file (zipfile, torch.load)."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = max(0, off if whence == 0 else self.pos + off if whence == 1 else self.length + off)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) if n else 0
        self.pos += got
        return got


class _Record(pickle.Unpickler):
    """Reads a ``torch.save`` pickle of one plain tensor into ``(storage id, offset, size, stride)``
    without running anything: any class but the tensor's rebuild function and a storage type is
    refused (the caller then reads the item with ``torch.load(weights_only=True)``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: ("tensor", storage, offset, tuple(size), tuple(stride), rest[2:])
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _head(fd: int, start: int, length: int, shape: list[int], dtype: torch.dtype) -> tuple[int, int] | None:
    """``(file position of the chunk's first element, element size)`` of the DCP item at ``start``,
    a ``torch.save`` zip of a contiguous tensor of ``shape`` and ``dtype``, stored uncompressed in
    this machine's byte order; ``None`` for any other form."""
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            view = _Slice(f, start, length)
            z = zipfile.ZipFile(view)
            names = z.namelist()
            pkl = next(n for n in names if n.endswith("/data.pkl"))
            prefix = pkl[: -len("data.pkl")]
            if prefix + "byteorder" in names and z.read(prefix + "byteorder").decode() != sys.byteorder:
                return None
            rec = _Record(io.BytesIO(z.read(pkl))).load()
            if not (type(rec) is tuple and rec[0] == "tensor" and type(rec[1]) is tuple and len(rec[1]) >= 3):
                return None
            # bits the values are read through (``{'conj': True}``, ``{'neg': True}``): the bytes are not the values
            _tag, storage, offset, size, stride, bits = rec
            if any(bits):
                return None
            size_of = dtype.itemsize
            contiguous = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
            if list(size) != shape or any(n > 1 and s != c for n, s, c in zip(size, stride, contiguous)):
                return None
            zi = z.getinfo(f"{prefix}data/{storage[2]}")
            if zi.compress_type != zipfile.ZIP_STORED or zi.file_size < (offset + math.prod(shape)) * size_of:
                return None
            view.seek(zi.header_offset)
            local = view.read(30)
            if len(local) != 30 or local[:4] != b"PK\x03\x04":
                return None
            fn, extra = struct.unpack("<HH", local[26:30])
            return start + zi.header_offset + 30 + fn + extra + offset * size_of, size_of
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, TypeError, IndexError, EOFError):
        return None
