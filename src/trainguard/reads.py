"""The read side's pieces and scheduler: read ops cut into block-aligned pieces that are read
and checksummed one after the other, spread over a few threads.

Called by ``io.read_targets`` (itself called by ``loader._load``, ``export`` and
``consolidate``). Why pieces: a read op may cover a whole 100+ MB tensor. Reading it in one
call and verifying afterwards reads every byte from DRAM twice (the copy out of the page
cache, then the hash, long after the data left the caches). A piece of a few MiB is hashed
right after it was read, while it is still in L2/L3, and two threads stealing pieces (not
whole tensors) stay busy even when one tensor is most of the checkpoint.

Scheduling: the threads take pieces from one shared iterator, in the order of the targets
(tensor order). Sorting them by file offset and giving each thread its own file measured
worse on a cold 3 GB load after drop_caches (1.8 s vs 1.47 s, twice the CPU time), so the
order is left as planned. Piece sizes come from the reader (``piece_bytes``: 4 MiB for a
cached local file; None, one piece per op, for an uncached one or a non-local reader: see
``storage._pagecache``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .errors import CorruptCheckpointError
from .manifest import checksum
from .planner import BlockCheck, ReadOp
from .storage.base import FileReader

Buffer = memoryview | Callable[[], memoryview]


class Piece:
    """Read bytes ``[base, end)`` of op ``op`` into the same bytes of ``buf`` (the op's whole
    buffer, or a function returning it: indirect ops allocate their scratch buffer only when
    a piece runs), then verify ``checks`` (starts relative to the op); then call ``done``."""

    __slots__ = ("reader", "buf", "base", "end", "checks", "op", "path", "done")

    def __init__(
        self,
        reader: FileReader,
        buf: Buffer,
        base: int,
        end: int,
        checks: Sequence[BlockCheck],
        op: ReadOp,
        path: str,
        done: Callable[[], None] | None,
    ) -> None:
        self.reader, self.buf, self.base, self.end, self.checks = reader, buf, base, end, checks
        self.op, self.path, self.done = op, path, done

    @property
    def length(self) -> int:
        return self.end - self.base

    def run(self) -> None:
        buf = self.buf if isinstance(self.buf, memoryview) else self.buf()
        self.reader.readinto(buf[self.base : self.end], self.op.offset + self.base)
        for c in self.checks:
            if checksum(buf[c.start : c.start + c.length]) != c.checksum:
                raise corrupt(self.op, self.path, c.start, c.length)
        if self.done is not None:
            self.done()


def corrupt(op: ReadOp, path: str, start: int, length: int) -> CorruptCheckpointError:
    """The error for a checksum mismatch over ``length`` bytes at ``start`` within ``op``."""
    a = op.offset + start
    return CorruptCheckpointError(
        f"{op.file}: checksum mismatch in tensor {path!r} (bytes {a}..{a + length}): the checkpoint is corrupt",
        file=op.file,
        entry=path,
    )


def split(
    reader: FileReader,
    buf: Buffer,
    op: ReadOp,
    path: str,
    piece_bytes: int | None,
    done: Callable[[], None] | None = None,
) -> list[Piece]:
    """Cut ``op`` (to be read into ``buf``, ``op.length`` bytes) into pieces of at most
    ``piece_bytes`` (None: one piece), each ending on a checksum block boundary, so that every
    block is verified by the piece that read it. A block larger than ``piece_bytes`` is one piece.

    ``done``, if given, is called once, by whichever piece finishes last (the indirect reads'
    copy out of their scratch buffer)."""
    n = op.length
    if not piece_bytes or n <= piece_bytes or (op.checks and not _tiles(op.checks, n)):
        bounds = [(0, n, 0, len(op.checks))]
    else:
        bounds = []
        checks = op.checks
        if checks:
            i = 0
            while i < len(checks):
                start, j = checks[i].start, i + 1
                while j < len(checks) and checks[j].start + checks[j].length - start <= piece_bytes:
                    j += 1
                end = checks[j - 1].start + checks[j - 1].length
                bounds.append((start, end, i, j))
                i = j
        else:
            bounds = [(s, min(s + piece_bytes, n), 0, 0) for s in range(0, n, piece_bytes)]
    finish = done
    if done is not None and len(bounds) > 1:
        finish = _countdown(len(bounds), done)
    return [Piece(reader, buf, start, end, op.checks[i:j], op, path, finish) for start, end, i, j in bounds]


def _tiles(checks: Sequence[BlockCheck], n: int) -> bool:
    """Whether the checked blocks cover ``[0, n)`` exactly, in order (as ``plan_reads`` makes
    them); pieces are cut along them, so any other shape is read as one piece."""
    pos = 0
    for c in checks:
        if c.start != pos:
            return False
        pos += c.length
    return pos == n


def _countdown(n: int, done: Callable[[], None]) -> Callable[[], None]:
    left = [n]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()

    return one


def run(pieces: Iterable[Piece], streams: int) -> None:
    """Run every piece on ``streams`` threads (the caller's among them), which take the next
    piece in the order given (work stealing over pieces); re-raises the first error in the
    caller's thread, after the other threads stopped taking pieces.

    ``pieces`` may be a generator that plans as it goes (``io.read_targets``): it is advanced
    under the lock by whichever thread needs a piece, so the first pieces are being read while
    later ones are still planned. An error raised by the generator is re-raised like a read's."""
    if streams <= 1:
        for p in pieces:
            p.run()
        return
    it = iter(pieces)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            try:
                with lock:
                    p = next(it, None)
                if p is None:
                    return
                p.run()
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
                return

    with ThreadPoolExecutor(max_workers=streams - 1, thread_name_prefix="trainguard-read") as ex:
        futures = [ex.submit(worker) for _ in range(streams - 1)]
        worker()
        for f in futures:
            f.result()
    if errors:
        raise errors[0]
