"""The bytes of a data file that ``io.write_batches`` never writes: the gaps between its chunks.

``planner.layout_file`` starts each large chunk on a page (or at its memory's phase in a page), so
a file holds holes between chunks whose sizes are not whole pages (a bias, an embedding of
50,257 rows). A local file leaves them sparse. An object store's writer (``storage.fsspec``'s
``_PartWriter``) uploads a part once all of its bytes are there: a part with a hole never was, so
every such part waited in memory for ``finish``, the whole file when no tensor size was a multiple
of 4 KiB (measured on SeaweedFS: a 977 MiB rank file sent no part before ``finish``; a 2.9 GB
state of 64 tensors of 12,000,003 floats, one sync ``tg.save``: peak RSS grew 3,374 MiB, 3,095 MiB
of it Python objects, against 1,445 and 1,216 MiB now), where docs/storage.md promises at most 8
parts buffered. ``write_batches`` now tells a
writer that has ``hole(offset, length)`` which ranges of each batch no write covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def spans(tasks: Sequence[tuple[int, ...]], chunks: Sequence[Any]) -> list[tuple[int, int]]:
    """``(start, end)`` of the bytes each of ``io._tasks``'s tasks writes, in file order: ``(0, i, start, n)``
    bytes ``start:start+n`` of chunk ``i``; ``(1, i, j, ...)`` the coalesced span of those small chunks,
    their gaps included (written from the coalescing buffer)."""
    out = []
    for t in tasks:
        if t[0] == 0:
            lo = chunks[t[1]].offset + t[2]
            out.append((lo, lo + t[3]))
        else:
            out.append((chunks[t[1]].offset, chunks[t[-1]].offset + chunks[t[-1]].length))
    return sorted(out)


def declare(w: Any, tasks: Sequence[tuple[int, ...]], chunks: Sequence[Any], start: int) -> int:
    """Call ``w.hole(offset, length)`` for each range from ``start`` to the end of the last of ``tasks``
    that none of them writes (``write_batches``, once per batch, before its writes: batches come in
    file order, so nothing writes there later); returns where the batch's writes end (the next
    batch's ``start``). A writer without ``hole`` (local files) is left alone."""
    hole = getattr(w, "hole", None)
    pos = start
    for lo, hi in spans(tasks, chunks):
        if hole is not None and lo > pos:
            hole(pos, lo - pos)
        pos = max(pos, hi)
    return pos
