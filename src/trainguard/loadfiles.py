"""The files a rank's load reads, checked before the load's plan round (``loader._load``).

``loader._load`` calls :func:`check_needed` on every rank once its plans are made (every
tensor's destination known) and before its "load" round, in which every rank learns whether
all ranks can go on. A rank whose file is missing, truncated or whose index does not match the
manifest therefore fails that round, and with it the load on every rank, before any rank has
written a byte into its state.

Before session 57 the files of the regular parts (format 2: FSDP2 shards) read into a live
shard were checked when first opened, during the reads, and their indexes read there too: a
checkpoint of 3 FSDP2 ranks with ``data-00002.bin`` or ``data-00002.idx`` gone, loaded on 2 or
3 ranks, overwrote the parameters on every rank (the ranks whose parts were there read them,
the others part of theirs) and only then raised, "the state may hold part of the checkpoint's
values"; the same file gone from a DDP checkpoint was refused before anything was read.
"""

from __future__ import annotations

from typing import Any

from .commit import check_file_sizes
from .dtensor import is_dtensor, shard_of
from .errors import CorruptCheckpointError
from .index import ChunkSource
from .layout import data_file, index_file
from .manifest import Manifest
from .planner import Box
from .storage import Storage, location


def check_needed(storage: Storage, directory: str, manifest: Manifest, src: ChunkSource,
                 plans: list[tuple[Any, ...]], bad: dict[str, str]) -> set[str]:
    """Every data file this rank reads exists with the manifest's size, and every index of a
    regular part it reads exists and validates (read once: ``src`` keeps it for the reads).
    ``plans`` are ``_load``'s ``(key, adapter, skeleton, dest, refs)``; ``bad`` the paths not
    read. Returns the data files checked (the reads' ``check_file`` skips them). Raises
    ``CorruptCheckpointError`` naming the file, which rank saved it and what to do."""
    wanted: set[str] = set()
    parts: set[int] = set()
    for _k, _o, _s, dest, refs in plans:
        for p in refs:
            if p in bad:
                continue
            e, live = manifest.tensors[p], dest.get(p)
            if live is not None and e.regular is None and is_dtensor(live):
                shard_of(live, p)  # an uneven DTensor.from_local shard refused before the plan round (dtensor.refuse_uneven)
            if e.regular is not None and live is not None:  # read into this rank's shard: the parts it overlaps
                data, _shape, offsets, _ = shard_of(live, p)
                box = Box(tuple(offsets), tuple(data.shape))
                parts.update(i for i in e.regular.overlapping(e.shape, box) if i < e.regular.nonempty(e.shape))
            elif e.regular is None and len(e.chunks) == 1:
                wanted.add(e.chunks[0].file)
            else:
                wanted |= src.files(e)
    wanted |= {data_file(i) for i in parts}
    try:
        check_file_sizes(storage, directory, manifest, wanted)
        for i in sorted(parts):
            read_index(storage, directory, src, i)
    except CorruptCheckpointError as err:
        if err.args and isinstance(err.args[0], str) and err.args[0].endswith(" is missing"):
            err.args = (err.args[0] + what_to_do(manifest), *err.args[1:])
        raise
    return wanted


def read_index(storage: Storage, directory: str, src: ChunkSource, part: int) -> None:
    """Index ``part`` read and validated against the manifest (kept in ``src`` for the reads), by
    :func:`check_needed`. Its absence is found by the read itself: a lookup before it (review57a)
    was one more request per part on every rank's every load on an object store (a HEAD of each
    index, then its GET), and on local disk called an index that is a symbolic link to a file
    gone "missing" where the read says it is a link. A missing one is told with ``location``'s
    path (``s3://...``), as a missing data file is."""
    try:
        src.index(part)
    except CorruptCheckpointError as err:
        gone = isinstance(err.__cause__, (FileNotFoundError, NotADirectoryError)) or (
            err.args and isinstance(err.args[0], str) and err.args[0].endswith("index file is missing"))
        if not gone:
            raise
        path = storage.join(directory, index_file(part))
        raise CorruptCheckpointError(f"{location(storage, path)}: index file is missing", file=index_file(part)) from None


LOAD_ANOTHER = "load another checkpoint (a CheckpointManager's restore goes back to the newest one that verifies)"
"""The end of :func:`what_to_do`, which ``tg.load`` (``srcnamed.advised``) replaces with the run's earlier steps."""


def what_to_do(manifest: Manifest) -> str:
    """The advice on a missing file: which ranks wrote the checkpoint and that each of their files is needed."""
    return (f"; the checkpoint was saved by {manifest.world_size} rank(s), each writing its own files, and a load at any "
            f"world size needs every file the manifest lists: copy the checkpoint directory whole, or {LOAD_ANOTHER}")
