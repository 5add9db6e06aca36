"""An entry of a checkpoint streamed into one ``torch.save`` file (``export.write_file``, for
``trainguard export --to x.pt`` and ``convert`` to ``.pt``; offline, one process).

``torch.save`` writes from the objects it is given, so a ``.pt`` export held the whole entry in
memory (a 1.5 GB entry: peak RSS 1.7 GB). Here the entry's value is built (``export.torch_value``:
non-tensor values, module versions, a tie as one tensor) around placeholder tensors that are
allocated but never touched (no memory is faulted in), ``torch.save`` writes it under
``torch.serialization.skip_data`` (every record in place, the storages' bytes left as holes), a
``torch.load(map_location="meta")`` of that file gives each storage's offset in it, and the
tensors are then read in batches of up to 256 MiB (``consolidate.whole_batches``: checksums
verified, a larger tensor in pieces) and written at those offsets. Last, each storage's CRC-32
(which ``skip_data`` leaves 0) is written into its data descriptor and the central directory, so
the file is the zip ``torch.save`` writes: ``zipfile``'s ``testzip`` finds no error in it.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .commit import check_file_sizes
from .consolidate import whole_batches
from .errors import CheckpointError
from .index import ChunkSource
from .manifest import Manifest, TensorEntry
from .storage import Storage


def placeholders(
    storage: Storage, directory: str, manifest: Manifest, mine: list[tuple[str, str, TensorEntry]],
) -> tuple[dict[str, torch.Tensor], dict[int, tuple[str, TensorEntry]]]:
    """An untouched tensor per name of ``mine`` (``(name, manifest path, entry)``), the names of a tie
    one tensor (as ``iter_tensors(share=True)`` gives them), and what to read into each (by ``id``).
    The data files' sizes are checked first, as a load checks them: a manifest cannot make this
    reserve more than the files it points at hold."""
    src = ChunkSource.of(storage, directory, manifest)
    check_file_sizes(storage, directory, manifest, {f for _n, _p, e in mine for f in src.files(e)})
    by_holder: dict[str, torch.Tensor] = {}
    reads: dict[int, tuple[str, TensorEntry]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, path, e in mine:
        holder = e.alias or path
        if holder not in by_holder:
            by_holder[holder] = t = torch.empty(e.shape, dtype=e.torch_dtype)  # malloc'd, never written: no RSS
            reads[id(t)] = (path, e)
        tensors[name] = by_holder[holder]
    return tensors, reads


def _leaves(v: Any) -> Iterator[torch.Tensor]:
    """The tensors of a value (dicts in order, lists and tuples), as ``torch.load`` rebuilds it."""
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, Mapping):
        for x in v.values():
            yield from _leaves(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _leaves(x)


def write(
    storage: Storage, directory: str, manifest: Manifest, value: Any, reads: dict[int, tuple[str, TensorEntry]], path: str, what: str,
) -> bool:
    """Write ``value`` (holding the placeholders whose reads ``reads`` names) to the new local file
    ``path`` with the tensors' bytes from the checkpoint at ``directory``. False, ``path`` left to the
    caller to replace, when the saved file's tensors do not pair with ``value``'s (then
    ``torch.save`` with the entry in memory). Called by ``export.write_file`` inside ``replacing``.
    An error of ``torch.save`` is a ``CheckpointError`` saying ``what``; one reading the checkpoint is raised as it is."""
    from .export import foreign_errors

    with foreign_errors(what), torch.serialization.skip_data():
        torch.save(value, path)
    try:  # each storage's offset in the file; a value weights_only refuses: saved as before, whole
        meta = torch.load(path, map_location="meta", weights_only=True)
    except Exception:
        return False
    ours, theirs = list(_leaves(value)), list(_leaves(meta))
    if len(ours) != len(theirs) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(ours, theirs)):
        return False
    at: dict[int, int] = {}
    for a, b in zip(ours, theirs):
        off = getattr(b.untyped_storage(), "_checkpoint_offset", None)
        if id(a) not in reads or off is None or at.get(id(a), off) != off:
            return False
        at[id(a)] = off
    order = sorted(at, key=at.__getitem__)
    items, offs = [reads[i] for i in order], [at[i] for i in order]
    src = ChunkSource.of(storage, directory, manifest)  # file sizes: checked by placeholders()
    crcs = dict.fromkeys(offs, 0)
    starts = {o: o for o in offs}  # a piece's file offset -> its storage's
    fd = os.open(path, os.O_WRONLY)
    try:
        for batch in whole_batches(storage, directory, src, items, offs):
            for c in batch:
                data = c.data
                first = c.offset if c.offset in crcs else starts[c.offset]
                crcs[first] = zlib.crc32(data, crcs[first])
                starts[c.offset + len(data)] = first  # the next piece of the same storage
                try:
                    done = 0
                    while done < len(data):
                        done += os.pwrite(fd, data[done:], c.offset + done)
                except OSError as e:  # a full disk: as stwrite says it (an error reading is raised as it is)
                    raise CheckpointError(f"{what}: {type(e).__name__}: {e}") from e
    finally:
        os.close(fd)
    with foreign_errors(what):
        return _patch_crcs(path, crcs)


def _patch_crcs(path: str, crcs: dict[int, int]) -> bool:
    """Write the CRC-32 of each record whose data starts at a key of ``crcs`` into its data
    descriptor (after the data, from its signature on; ``torch.save`` writes one per record that is
    not empty) and its central directory entry, where ``skip_data`` left 0 (``torch.load`` does not
    check it; ``zipfile`` and ``unzip -t`` report such a record as damaged). False where a descriptor
    is not where torch writes it."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        infos, cd = z.infolist(), z.start_dir
    with open(path, "r+b") as f:
        for info in infos:
            f.seek(info.header_offset + 26)
            n, m = struct.unpack("<HH", f.read(4))
            start = info.header_offset + 30 + n + m
            f.seek(cd)
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":  # not the layout zipfile read: the caller saves it whole
                return False
            n2, m2, k2 = struct.unpack_from("<HHH", head, 28)
            if start in crcs and info.compress_size:  # an empty record has CRC 0, and no data descriptor
                crc = struct.pack("<I", crcs[start] & 0xFFFFFFFF)
                f.seek(start + info.compress_size)
                if f.read(4) != b"PK\x07\x08":  # not the layout torch.save writes: the caller saves it whole
                    return False
                f.write(crc)
                f.seek(cd + 16)
                f.write(crc)
            cd += 46 + n2 + m2 + k2
    return True
