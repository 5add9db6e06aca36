"""``convert --to dcp``, streamed: DCP's own ``dcp.save`` with a planner that reads each tensor
from the trainguard checkpoint only when DCP's writer asks for it (``SavePlanner.resolve_data``),
and a writer whose files hold up to 128 MiB each. Before session 51 ``read_entries``
read every entry whole and ``dcp.save`` was given it (and torch's ``FileSystemWriter`` keeps every
tensor of a file until that file is written): a 1.5 GB state took 1.8 GB.

``dcp_export.write_dcp`` calls ``dcp.save(state, planner=LazyPlanner(source), storage_writer=writer(tmp))``,
``state`` holding ``meta`` placeholder tensors (``read_entries``), ``source`` mapping each
to its manifest path. A tensor larger than 128 MiB is written as chunks of at most that (DCP's
metadata records a tensor's chunks, as for a sharded save; ``dcp.load`` and ``format_utils``
reassemble them). Files: ``__0_<k>.distcp``, one per 128 MiB of tensors (the non-tensor values in
the first). On a torch whose ``FileSystemWriter`` has no ``_write_data`` (its internal writing
loop, used here to cut files), each item gets a file of its own (``single_file_per_rank=False``).
"""

from __future__ import annotations

import dataclasses
import os
import queue
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .commit import check_file_sizes, read_manifest
from .consolidate import GROUP as _GROUP
from .consolidate import flat_boxes
from .dcp_empty import KeepEmptyPlanner
from .errors import CheckpointError
from .export import own_tensor, selected
from .flatten import single_tensor, unflatten
from .index import ChunkSource, plan_args
from .io import ReadTarget, read_targets
from .manifest import TensorEntry
from .planner import Box, plan_reads
from .storage import for_path, location

# Bytes of tensors per file, and the largest chunk: half of a batch, as torch's writer holds two files' worth at
# a time (the last tensor of a file stays referenced until the next file's first one is read): peak ~256 MiB.
GROUP = _GROUP // 2


@dataclasses.dataclass
class Source:
    """Where the placeholders' values are: the trainguard checkpoint (``storage``, ``directory``,
    ``manifest``) and, by ``id`` of each placeholder, ``(manifest path, entry, placeholder)``."""

    storage: Any
    directory: str
    manifest: Any
    tensors: dict[int, tuple[str, TensorEntry, torch.Tensor]]


class LazyPlanner(KeepEmptyPlanner):
    """DCP's default planner (it flattens the state as ``dcp.save`` does: the same keys and
    ``planner_data``, with the state's empty dicts: ``dcp_empty``), whose tensor items are read from ``source`` when written, a tensor larger
    than ``GROUP`` bytes planned as chunks of at most that (``consolidate.flat_boxes``)."""

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.source = source
        self.chunks = ChunkSource.of(source.storage, source.directory, source.manifest)
        self.group: dict[tuple[str, tuple[int, ...]], int] = {}  # a tensor item -> the file it goes to (_Writer)
        self.files: list[list[WriteItem]] = []
        self.ready: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # the items of the file being written, read

    def by_file(self, files: list[list[WriteItem]]) -> None:
        """``_Writer``: the items of each file, in the order written: the tensors of a file are read
        together (in parallel) when DCP asks for the first of them."""
        self.files = files
        self.group = {_key(i): k for k, items in enumerate(files) for i in items if i.type != WriteItemType.BYTE_IO}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            td = item.tensor_data
            if td is None or item.type != WriteItemType.TENSOR or _nbytes(td.size, td.properties.dtype) <= GROUP:
                items.append(item)
                continue
            shape, size = list(td.size), td.properties.dtype.itemsize
            step = max(GROUP // size, 1)
            n = _numel(shape)
            for lo in range(0, n, step):
                for box, _first in flat_boxes(shape, lo, min(n, lo + step)):
                    at = torch.Size(box.offsets)
                    items.append(WriteItem(index=MetadataIndex(item.index.fqn, at), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(ChunkStorageMetadata(at, torch.Size(box.sizes)),
                                                                       td.properties, td.size)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:  # a value DCP pickles whole (a tuple of tensors too)
            return self.transform_object(write_item, self._real(self.lookup_object(write_item.index)))
        key = _key(write_item)
        if key not in self.ready and key in self.group:  # the first of a file: the file's items, read at once
            self.ready = {}  # the previous file's are written
            items = [i for i in self.files[self.group[key]] if i.type != WriteItemType.BYTE_IO]
            targets = []
            for i in items:
                self.ready[_key(i)], target = self._target(i)
                targets += target
            read_targets(self.source.storage, self.source.directory, targets)
        if key in self.ready:
            return self.ready.pop(key)
        out, targets = self._target(write_item)
        read_targets(self.source.storage, self.source.directory, targets)
        return out

    def _target(self, item: WriteItem) -> tuple[torch.Tensor, list[ReadTarget]]:
        chunk = item.tensor_data.chunk
        return self._plan(self.state_dict[item.index.fqn], Box(tuple(chunk.offsets), tuple(chunk.sizes)))

    def _real(self, v: Any) -> Any:
        """``v`` with each placeholder in it read (whole)."""
        if isinstance(v, torch.Tensor) and id(v) in self.source.tensors:
            out, targets = self._plan(v, Box((0,) * v.dim(), tuple(v.shape)))
            read_targets(self.source.storage, self.source.directory, targets)
            return out
        if type(v) in (list, tuple):
            return type(v)(self._real(x) for x in v)
        if type(v) is dict:
            return {k: self._real(x) for k, x in v.items()}
        return v

    def _plan(self, placeholder: torch.Tensor, box: Box) -> tuple[torch.Tensor, list[ReadTarget]]:
        """A new tensor for ``box`` of ``placeholder``'s values, and the read that fills it (checksums verified)."""
        path, e, _t = self.source.tensors[id(placeholder)]
        out = torch.empty(box.sizes, dtype=e.torch_dtype)
        if not out.numel():
            return out, []
        reads = plan_reads(plan_args(self.chunks.all_chunks(path, e)), box, e.torch_dtype.itemsize,
                           self.source.manifest.block_size, True)
        return out, [ReadTarget(path, out, box, reads)]


def _key(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    return item.index.fqn, tuple(item.index.offset or ())


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _nbytes(size: Any, dtype: torch.dtype) -> int:
    return _numel(list(size)) * dtype.itemsize


class _Writer(FileSystemWriter):
    """``FileSystemWriter`` whose files hold up to ``GROUP`` bytes of tensors each (it keeps every
    tensor of a file until that file is written), the non-tensor values in the first."""

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        buckets: list[list[WriteItem]] = [[]]
        size = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                buckets[0].append(item)
                continue
            n = _nbytes(item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype)
            if size and size + n > GROUP:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += n
        if isinstance(planner, LazyPlanner):
            planner.by_file(buckets)
        files: queue.Queue = queue.Queue()
        for k, bucket in enumerate(buckets):
            name = f"{plan.storage_data.prefix}{k}.distcp"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)


def writer(path: str) -> FileSystemWriter:
    """The storage writer of a streamed ``convert --to dcp`` into ``path``."""
    if callable(getattr(FileSystemWriter, "_write_data", None)):
        return _Writer(path)
    return FileSystemWriter(path, single_file_per_rank=False)


def read_entries(src: str | os.PathLike[str], entry: str | None) -> tuple[dict[str, Any], int, Any]:
    """``convert`` to DCP: each entry (every one with ``entry=None``) as a load into nothing gives
    it, tensors and JSON values (an optimizer's ``state`` by parameter name and its
    ``param_groups``), so that DCP flattens it into the keys it gives ``get_state_dict``'s output
    (``optim.state.0.weight.exp_avg``, ``optim.param_groups.0.lr``). Rank-local entries are left
    out. Each tensor is a ``meta`` placeholder of its shape and dtype, read when DCP writes it
    (``dcp_lazy``; before session 51 every tensor was read here). Returns the state, its number of
    tensors and the ``dcp_lazy.Source`` of the placeholders' values."""
    storage, d = for_path(src)
    manifest = read_manifest(storage, d)
    entries = list(manifest.objects) if entry is None else [entry]
    state: dict[str, Any] = {}
    n = 0
    source = Source(storage, d, manifest, {})
    chunks = ChunkSource.of(storage, d, manifest)
    for e in entries:
        if e not in manifest.objects:
            raise CheckpointError(f"{location(storage, d)} has no entry {e!r}; it has {sorted(manifest.objects)}. Pass --entry NAME")
        obj = manifest.objects[e]
        if "skeleton" not in obj:
            continue  # rank-local (RNG state of each rank): not part of a model's DCP checkpoint
        one = single_tensor(obj["skeleton"]) is not None
        mine = selected(manifest, e)
        # sizes on disk first, as a load checks them (iter_tensors did): no read past a truncated file
        check_file_sizes(storage, d, manifest, {f for _n, _p, te in mine for f in chunks.files(te)})
        tensors = {}
        for name, path, te in mine:
            t = tensors[e if one else f"{e}/{name}"] = torch.empty(te.shape, dtype=te.torch_dtype, device="meta")
            source.tensors[id(t)] = (path, te, t)
        n += len(tensors)
        state[e] = unflatten(obj["skeleton"], own_tensor(tensors, location(storage, d), e))
    if not n:
        raise CheckpointError(f"{location(storage, d)}: entries {entries} hold no tensors to export")
    return state, n, source
