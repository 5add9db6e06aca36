"""``inspect.verify`` (``tg.verify``, ``trainguard verify``) of a checkpoint on an object store: several reads at once.

Against a local disk ``verify`` reads every chunk in turn through one buffer. On an object store each read is
a request: a rank file of 4,000 tensors of 16 KiB cost 4,000 ranged GETs one after another (30 s on
SeaweedFS on loopback), the HEADs of the file sizes too (two per file). Here (``storage.atomic_rename`` False):

- ``each``: the files' sizes are looked up ``THREADS`` at a time (``ls`` looks at 16 step directories at once);
- ``check_chunks``: the chunks of one file that lie close together (gaps of at most ``GAP``) are read by one GET
  of at most ``WINDOW`` bytes, a larger chunk in pieces of ``WINDOW``, ``THREADS`` reads in flight: at most
  ``THREADS * WINDOW`` bytes held (128 MiB; the sequential path held one buffer of up to 64 MiB);
- ``prefetch``: the index files of format 2 are read at once, each read's error raised where it was.

Results and messages are those of the sequential path: checksum mismatches are found on the same blocks, the
errors are listed in the same order, and a chunk whose read fails is read again by ``one_chunk`` (the
sequential path's reads, one chunk at a time), whose error names what it named.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .errors import CheckpointError
from .manifest import Chunk, checksum

THREADS = 8  # reads (or HEADs) in flight
WINDOW = 16 << 20  # bytes one GET of neighbouring chunks covers; a larger chunk's pieces
GAP = 64 << 10  # bytes between two chunks read by one GET anyway (the layout's page padding)
T = TypeVar("T")
R = TypeVar("R")


@contextlib.contextmanager
def _pool() -> Iterator[ThreadPoolExecutor]:
    """``THREADS`` threads for ``each``, ``prefetch`` and ``check_chunks``. Left by an exception (the first read's
    error that verify raises: a ``TimeoutError`` of a hung endpoint, a 403; Ctrl-C) or an early exit, the reads
    not started are cancelled, those in flight (at most ``THREADS``, each within the store's bound) waited for.
    Before (review55g), every queued read still ran before the error came out: against a hung endpoint a 100 GB
    checkpoint's verify waited one ``TRAINGUARD_STORE_TIMEOUT`` per 8 windows of 16 MiB (the sequential path, one
    bound), and Ctrl-C went on reading the whole checkpoint."""
    pool = ThreadPoolExecutor(THREADS, thread_name_prefix="trainguard-verify")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def each(storage: Any, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R | BaseException]:
    """``fn(item)`` of each item, in order, as a value or the exception it raised (yielded, not raised): one after
    another on a local disk, ``THREADS`` at once on an object store. ``verify``: the data files' sizes."""
    if storage.atomic_rename:
        for x in items:
            try:
                got: R | BaseException = fn(x)
            except Exception as e:  # noqa: BLE001 - the caller's to judge, in order
                got = e
            yield got
        return
    with _pool() as pool:
        for f in [pool.submit(fn, x) for x in items]:
            e = f.exception()
            yield e if e is not None else f.result()  # (a KeyboardInterrupt in a worker: raised by result())


def prefetch(storage: Any, read: Callable[[str], bytes], names: Iterable[str]) -> Callable[[str], bytes]:
    """``read``, its files ``names`` fetched at once first (object stores): ``ChunkSource``'s index files. Each
    name's bytes (or error) are handed out when it is asked for, as ``read`` would have."""
    names = list(names)
    if storage.atomic_rename or len(names) < 2:
        return read
    with _pool() as pool:
        got: dict[str, Future[bytes]] = {n: pool.submit(read, n) for n in names}
        for f in got.values():
            if f.exception() is not None:  # wait: every read done, none raised here; after a failed one, those
                break  # not started are not (a hung endpoint: one bound, not one per 8 files): read when asked
    return lambda name: got[name].result() if name in got and not got[name].cancelled() else read(name)


def one_chunk(reader: Any, path: str, c: Chunk, view: memoryview, block: int, errors: list[str],
              media: Callable[[OSError], None]) -> int:
    """The sequential path's check of chunk ``c`` (tensor ``path``, as shown) through ``view`` (its buffer):
    read in pieces of ``len(view)``, every block's checksum compared; errors appended to ``errors``, a read's
    error ends the chunk. ``media(e)`` raises an ``OSError`` that is not a medium's. Returns the bytes read."""
    pos = total = 0
    while pos < c.length:
        n = min(len(view), c.length - pos)
        try:
            reader.readinto(view[:n], c.offset + pos)
        except (CheckpointError, OSError) as ex:  # bad bytes, or a medium's error: reported, not raised
            if isinstance(ex, OSError) and not isinstance(ex, CheckpointError):
                media(ex)
            errors.append(f"{c.file}: tensor {path}: {ex}")
            break
        for b in range(0, n, block):
            idx = (pos + b) // block
            if checksum(view[b : min(b + block, n)]) != c.checksums[idx]:
                errors.append(f"{c.file}: checksum mismatch in tensor {path} (block {idx})")
        pos += n
        total += n
    return total


def _windows(every: list[tuple[str, Chunk]]) -> list[list[int]]:
    """Indices into ``every``, grouped: chunks of one file within ``GAP`` of each other and ``WINDOW`` bytes in all;
    a chunk over ``WINDOW`` alone."""
    order = sorted((i for i, (_p, c) in enumerate(every) if c.length), key=lambda i: (every[i][1].file, every[i][1].offset))
    out: list[list[int]] = []
    for i in order:
        c = every[i][1]
        if out and c.length <= WINDOW:
            first, last = every[out[-1][0]][1], every[out[-1][-1]][1]
            if (first.file == c.file and first.length <= WINDOW and 0 <= c.offset - (last.offset + last.length) <= GAP
                    and c.offset + c.length - first.offset <= WINDOW):
                out[-1].append(i)
                continue
        out.append([i])
    return out


def check_chunks(readers: dict[str, Any], every: list[tuple[str, Chunk]], block: int, bufsize: int, errors: list[str],
                 media: Callable[[OSError], None]) -> int:
    """Every chunk of ``every`` (``(tensor as shown, chunk)``, the manifest's order) checked, ``THREADS`` reads at
    once; errors appended to ``errors`` in that order, as the sequential path's (``bufsize``: its buffer). Returns
    the bytes read."""
    errs: list[list[str]] = [[] for _ in every]
    done = [0] * len(every)
    slow = threading.Lock()  # one sequential re-read at a time: its buffer is the sequential path's, up to 64 MiB

    def again(i: int) -> None:
        path, c = every[i]
        errs[i] = []
        with slow:
            done[i] = one_chunk(readers[c.file], path, c, memoryview(bytearray(min(bufsize, c.length))), block,
                                errs[i], media)

    def fail(ex: BaseException, group: list[int]) -> None:  # a process's error raised at once (a hung endpoint: one wait)
        if isinstance(ex, OSError) and not isinstance(ex, CheckpointError):
            media(ex)
        for i in group:
            again(i)

    def sums(i: int, data: memoryview, pos: int) -> None:
        path, c = every[i]
        for b in range(0, len(data), block):
            idx = (pos + b) // block
            if checksum(data[b : min(b + block, len(data))]) != c.checksums[idx]:
                errs[i].append(f"{c.file}: checksum mismatch in tensor {path} (block {idx})")

    def run(group: list[int]) -> None:
        first = every[group[0]][1]
        if first.length > WINDOW:  # one large chunk, in pieces of whole blocks
            piece = memoryview(bytearray(max(1, WINDOW // block) * block))
            pos = 0
            try:
                while pos < first.length:
                    n = min(len(piece), first.length - pos)
                    readers[first.file].readinto(piece[:n], first.offset + pos)
                    sums(group[0], piece[:n], pos)
                    pos += n
            except (CheckpointError, OSError) as ex:
                return fail(ex, group)
            done[group[0]] = first.length
            return
        last = every[group[-1]][1]
        buf = memoryview(bytearray(last.offset + last.length - first.offset))
        try:
            readers[first.file].readinto(buf, first.offset)
        except (CheckpointError, OSError) as ex:
            return fail(ex, group)
        for i in group:
            c = every[i][1]
            sums(i, buf[c.offset - first.offset : c.offset - first.offset + c.length], 0)
            done[i] = c.length

    stop = threading.Event()  # a group raised (its error is verify's): no other group starts reading

    def guarded(group: list[int]) -> None:
        if not stop.is_set():
            try:
                run(group)
            except BaseException:
                stop.set()
                raise

    with _pool() as pool:
        for f in [pool.submit(guarded, g) for g in _windows(every)]:
            f.result()  # a process's error (EACCES, a timeout): raised, as the sequential path raises it
    for e in errs:
        errors.extend(e)
    return sum(done)
