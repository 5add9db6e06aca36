"""The read side's pieces and scheduler: read ops cut into block-aligned pieces that are read
and checksummed one after the other, spread over a few threads.

Called by ``io.read_targets`` (itself called by ``loader._load``, ``export`` and
``consolidate``). Why pieces: a read op may cover a whole 100+ MB tensor. Reading it in one
call and verifying afterwards reads every byte from DRAM twice (the copy out of the page
cache, then the hash, long after the data left the caches). A piece of a few MiB is hashed
right after it was read, while it is still in L2/L3 (from the page cache: each block in
512 KiB reads hashed as they arrive, ``storage.local.HASH_SUB``), and two threads stealing pieces (not
whole tensors) stay busy even when one tensor is most of the checkpoint.

Scheduling: the threads take pieces (in batches, :func:`batched`) from one shared iterator,
in the order of the targets (the manifest's order, which is file order within each file).
Giving each thread its own file measured worse on a cold 3 GB load after drop_caches (1.8 s
vs 1.47 s, twice the CPU time), so the order is left as planned. Piece sizes come from the
reader (``piece_bytes``: 4 MiB for a cached local file; 32 MiB O_DIRECT pieces for an
uncached one, see ``storage.local``; one piece per op for a non-local reader), and small ops
are read in groups (:class:`SmallOps`), each with one scattering ``preadv``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from .errors import CorruptCheckpointError
from .manifest import checksum, hasher
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
        sub = getattr(self.reader, "hash_sub", None)
        if sub and self.end > self.base and _tiles(self.checks, self.end, self.base):
            self._run_streamed(buf, sub)
        else:
            self.reader.readinto(buf[self.base : self.end], self.op.offset + self.base)
            for c in self.checks:
                if checksum(buf[c.start : c.start + c.length]) != c.checksum:
                    raise corrupt(self.op, self.path, c.start, c.length)
        if self.done is not None:
            self.done()

    def _run_streamed(self, buf: memoryview, sub: int) -> None:
        """Read each checked block in ``sub``-byte reads, hashing each right after it is read,
        while it is still in the core's L2 cache (a file in the page cache: ``hash_sub``)."""
        base = self.op.offset
        for c in self.checks:
            h = hasher()
            for s in range(c.start, c.start + c.length, sub):
                b = buf[s : min(s + sub, c.start + c.length)]
                self.reader.readinto(b, base + s)
                h.update(b)
            if h.hexdigest() != c.checksum:
                raise corrupt(self.op, self.path, c.start, c.length)


SMALL_OP = 1 << 20  # ops below this are read in scatter groups (local files)
SCATTER_BYTES = 4 << 20  # a group of small ops of a cached file: one preadv of at most this many bytes,
COLD_SCATTER_BYTES = 32 << 20  # of a cold one: this many (the kernel's readahead fills the page cache ahead)
SCATTER_OPS = 256  # and at most this many ops (with the gaps between them: under IOV_MAX, 1024)
SCATTER_GAP = 4096  # ops further apart than this in the file start a new group


class SmallOps:
    """Reads of small tensors, grouped into :class:`ScatterPiece` pieces: one ``preadv`` per run of
    adjacent tensors, straight into their destinations. Per tensor, a cold file makes each read
    wait for the disk (10,000 tensors of 4 KB-1 MB: 1.8 s for 1.9 GB against 0.66 s for large
    reads of the same bytes) and a cached one costs more Python than copying. For a cold file
    the groups are larger and the reads buffered: the kernel reads ahead while the group is
    verified (10,000 tensors, 1.88 GB, cold, alternating in one process: 1.51 s, against 2.17 s
    for the O_DIRECT reads of 16 MiB groups into a bounce buffer that this replaced, each
    tensor then copied out). ``take`` collects the small direct ops of a file into one open
    group per file while they come in file order (as the loader plans them: tensor order is
    file order within a file) and hands back the groups that are complete, so reading overlaps
    planning; ``rest`` the groups still open."""

    def __init__(self) -> None:
        self.open: dict[int, ScatterPiece] = {}

    def take(self, reader: FileReader, path: str, op: ReadOp, dest: memoryview | None) -> list[ScatterPiece] | None:
        """None: not a small direct op of a reader with ``readv_into`` (local files; read it as
        usual); else the groups now complete."""
        if dest is None or op.dest_byte is None or op.length >= SMALL_OP or getattr(reader, "readv_into", None) is None:
            return None
        done = []
        g = self.open.get(id(reader))
        if g is not None and not g.fits(op):
            done.append(self.open.pop(id(reader)))
            g = None
        if g is None:
            limit = COLD_SCATTER_BYTES if getattr(reader, "cold", False) else SCATTER_BYTES
            g = self.open[id(reader)] = ScatterPiece(reader, op.offset, limit)
        g.ops.append((op, path, dest[op.dest_byte : op.dest_byte + op.length]))
        g.end = max(g.end, op.offset + op.length)
        return done

    def rest(self) -> Iterator[ScatterPiece]:
        while self.open:
            yield self.open.popitem()[1]


class ScatterPiece:
    """Small ops of a file, next to each other in the file: one ``preadv`` (buffered) straight
    into their destinations (the alignment gaps between them into a scratch buffer), then each
    op verified in place. Instead of a piece, a read call and a hand-over per tensor (10,000
    tensors of 4 KB-1 MB loaded hot: Python per piece, not the copies, was the cost)."""

    def __init__(self, reader: FileReader, lo: int, limit: int = SCATTER_BYTES) -> None:
        self.reader, self.lo, self.end, self.limit = reader, lo, lo, limit
        self.ops: list[tuple[ReadOp, str, memoryview]] = []

    @property
    def length(self) -> int:
        return self.end - self.lo

    def fits(self, op: ReadOp) -> bool:
        return (
            self.end <= op.offset <= self.end + SCATTER_GAP
            and op.offset + op.length - self.lo <= self.limit
            and len(self.ops) < SCATTER_OPS
        )

    def run(self) -> None:
        gap = memoryview(bytearray(SCATTER_GAP))
        bufs, pos = [], self.lo
        for op, _path, dst in self.ops:
            if op.offset > pos:
                bufs.append(gap[: op.offset - pos])
            bufs.append(dst)
            pos = op.offset + op.length
        if self.reader.readv_into(bufs, self.lo) != pos - self.lo:  # type: ignore[attr-defined]
            for op, _path, dst in self.ops:  # short (a file changed under us): op by op, which raises
                self.reader.readinto(dst, op.offset)
        for op, path, dst in self.ops:
            for c in op.checks:
                if checksum(dst[c.start : c.start + c.length]) != c.checksum:
                    raise corrupt(op, path, c.start, c.length)


class Pieces(list):
    """Several small pieces handed to a read thread at once (``io.read_targets`` batches them):
    one hand-over of the shared iterator's lock per batch instead of per 4 KB tensor."""

    def run(self) -> None:
        for p in self:
            p.run()


BATCH_BYTES = 4 << 20  # pieces are handed to the read threads in batches of about this many bytes


def batched(
    pieces: Iterator[Piece | ScatterPiece],
) -> Generator[Piece | ScatterPiece | Pieces, None, None]:  # io.read_targets closes it
    """The pieces in batches of at least ``BATCH_BYTES`` (a large piece alone, thousands of small
    tensors' pieces together): one hand-over of :func:`run`'s lock per batch (10,000 small
    tensors loaded hot while planning: 0.805 s one by one, 0.780 s batched). Closes ``pieces``."""
    batch, size = Pieces(), 0
    try:
        for p in pieces:
            batch.append(p)
            size += p.length if isinstance(p, (Piece, ScatterPiece)) else BATCH_BYTES
            if size >= BATCH_BYTES:
                yield batch
                batch, size = Pieces(), 0
        if batch:
            yield batch
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()


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


def _tiles(checks: Sequence[BlockCheck], n: int, start: int = 0) -> bool:
    """Whether the checked blocks cover ``[start, n)`` exactly, in order (as ``plan_reads`` makes
    them); pieces are cut along them, so any other shape is read as one piece (and a piece
    whose blocks do not cover it is hashed whole, not in parts)."""
    pos = start
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


def run(
    pieces: Iterable[Piece | ScatterPiece | Pieces],
    streams: int,
    *,
    extra: int = 0,
    want_extra: Callable[[], bool] | None = None,
) -> None:
    """Run every piece on ``streams`` threads (the caller's among them), which take the next
    piece in the order given (work stealing over pieces); re-raises the first error in the
    caller's thread, after the other threads stopped taking pieces.

    ``extra`` more threads run while ``want_extra()`` says so (checked after each piece they
    run; ``io.read_targets`` asks for them while it reads with O_DIRECT, where a thread spends
    most of its time waiting for the device and two leave it idle while they checksum).

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

    def worker(gated: bool = False) -> None:
        while not errors:
            try:
                with lock:
                    p = next(it, None)
                if p is None:
                    return
                p.run()
                if gated and not (want_extra is not None and want_extra()):
                    return
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
                return

    with ThreadPoolExecutor(max_workers=streams - 1 + extra, thread_name_prefix="trainguard-read") as ex:
        futures = [ex.submit(worker) for _ in range(streams - 1)]
        futures += [ex.submit(worker, True) for _ in range(extra if want_extra is not None else 0)]
        worker()
        for f in futures:
            f.result()
    if errors:
        try:  # cleared: the error's traceback holds this frame, the frame ``errors``: a cycle kept
            raise errors[0]  # the load's fresh tensors (GBs) alive after it failed, until a gc ran
        finally:
            errors.clear()
