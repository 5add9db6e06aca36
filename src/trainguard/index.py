"""Format 2 index files: where a rank's regular parts sit in its data file.

Writer (``api._write_rank``, on every rank that holds regular tensors, after its data file is
durable): ``encode`` gives the bytes of ``data-{rank:05d}.idx``, compact JSON::

    {"file": "data-00003.bin", "tensors": {"model/w": [byte_offset, length, ["<xxh3_64>", ...]]}}

which the rank writes atomically (fsynced) before it reports success; its report to rank 0
carries only the index's size and checksum, which the manifest lists under ``indexes``.

Readers (``loader``, ``export``, ``consolidate``, ``inspect.verify``): one :class:`ChunkSource`
per load. ``chunks(path, entry, box)`` returns the chunks overlapping ``box`` as
``manifest.Chunk`` records: explicit chunks by bisection, regular parts arithmetically, reading
and validating only the index files of the parts needed (each once per source). An index is
trusted exactly as far as the manifest: size and checksum first, then every field is checked
as strictly as a manifest chunk (tensor known and regular, part in range, length equal to the
part's bytes, bounds against the data file, one checksum per block, no shared bytes).

It also holds format 2's checks of the manifest's own new fields (``indexes``, ``regular``),
which ``manifest.validate`` calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from .dtypenames import ITEMSIZE
from .errors import CorruptCheckpointError, is_media_error
from .layout import DATA_RE, IDX_RE, data_file, index_file
from .manifest import Chunk, Manifest, TensorEntry, _int, _req, checksum
from .planner import Box, Regular, overlapping
from .skeleton import loads_json

MAX_INDEX_BYTES = 1 << 30


# ----------------------------------------------------------- manifest fields (called by manifest.validate)


def parse_indexes(raw: dict[str, Any], version: int, where: str) -> dict[str, tuple[int, str]]:
    """The manifest's ``indexes`` (format 2 only): allowed names, sizes, checksums."""
    if version < 2:
        if "indexes" in raw:
            raise CorruptCheckpointError(f"{where}: format_version 1 has no index files", file=where)
        return {}
    out: dict[str, tuple[int, str]] = {}
    for name, v in _req(raw, "indexes", dict, where).items():
        if not IDX_RE.match(name):
            raise CorruptCheckpointError(f"{where}: index file name {name[:60]!r} is not allowed", file=where)
        if type(v) is not list or len(v) != 2 or type(v[1]) is not str or len(v[1]) != 16:
            raise CorruptCheckpointError(f"{where}: index {name} is malformed", file=where)
        out[name] = (_int(v[0], 0, MAX_INDEX_BYTES, f"size of {name}", where), v[1])
    return out


def parse_regular(t: dict[str, Any], shape: list[int], w: str, where: str, path: str) -> Regular:
    r = t.get("regular")
    if "chunks" in t or type(r) is not dict or set(r) != {"dim", "parts"} or not shape:
        raise CorruptCheckpointError(f"{w}: malformed regular sharding", file=where, entry=path)
    return Regular(_int(r["dim"], 0, len(shape) - 1, "regular dim", w), _int(r["parts"], 1, 1 << 20, "regular parts", w))


def check_regular_files(
    tensors: dict[str, TensorEntry], files: dict[str, int], indexes: dict[str, tuple[int, str]], where: str
) -> None:
    """Every non-empty part of a regular tensor has its data file and its index: checked once
    up to the largest count of non-empty parts (non-empty parts are always the leading ones)."""
    need = max((e.regular.nonempty(e.shape) for e in tensors.values() if e.regular is not None), default=0)
    if not need:
        return  # no regular tensor with data (format 1): nothing below applies
    for i in range(need):
        if data_file(i) not in files or index_file(i) not in indexes:
            raise CorruptCheckpointError(
                f"{where}: regular tensors have a part {i} but {data_file(i)} or {index_file(i)} is not listed", file=where
            )
    # What the parts claim of each file fits in it (as explicit chunks do), so a manifest cannot
    # make a loader allocate more than the files hold: O(tensors + parts) with a difference array.
    claim = [0] * (need + 1)
    for e in tensors.values():
        if e.regular is not None and (k := e.regular.nonempty(e.shape)):
            row = math.prod(e.shape) // e.shape[e.regular.dim] * ITEMSIZE[e.dtype]
            full, last = e.regular.chunk(e.shape) * row, (e.shape[e.regular.dim] - (k - 1) * e.regular.chunk(e.shape)) * row
            claim[0] += full
            claim[k - 1] += last - full
            claim[k] -= last
    for e in tensors.values():
        for c in e.chunks if e.alias is None else ():  # an alias (format 3) claims no bytes of its own
            if (j := _part_of(c.file)) is not None and j < need:
                claim[j] += c.length
                claim[j + 1] -= c.length
    total = 0
    for i in range(need):
        total += claim[i]
        if total > files[data_file(i)]:
            raise CorruptCheckpointError(
                f"{where}: tensors claim {total} bytes of {data_file(i)}, which holds {files[data_file(i)]}", file=where
            )


def _part_of(fname: str) -> int | None:
    """The rank whose regular parts live in ``fname`` (its stream-0 file, ``data-RRRRR.bin``);
    None for any other file: a stream file (``data-RRRRR-S.bin``) holds explicit chunks only."""
    if not (DATA_RE.match(fname) and fname[5:10].isascii()):
        return None
    i = int(fname[5:10])
    return i if fname == data_file(i) else None


# ----------------------------------------------------------- index files


def encode(fname: str, entries: dict[str, tuple[int, int, list[str]]]) -> bytes:
    """The bytes of the index of data file ``fname``: ``path -> (byte_offset, length, checksums)``."""
    body = {"file": fname, "tensors": {p: [o, n, s] for p, (o, n, s) in entries.items()}}
    return json.dumps(body, separators=(",", ":")).encode()


def parse_index(data: bytes, part: int, m: Manifest, explicit: list[tuple[int, int, str]]) -> dict[str, Chunk]:
    """Validate index ``part``'s bytes against the manifest; ``path -> Chunk`` of its regular parts.

    ``explicit`` are the ``(start, end, path)`` byte spans of explicit chunks in the same data
    file: no regular part may share bytes with them or with each other.
    """
    name, fname = index_file(part), data_file(part)
    size, want = m.indexes[name]
    if len(data) != size or checksum(data) != want:
        raise CorruptCheckpointError(f"{name}: size or checksum differs from the manifest: the index is corrupt", file=name)
    try:
        raw = loads_json(data)  # a path twice: refused
    except (ValueError, RecursionError) as err:
        raise CorruptCheckpointError(f"{name}: invalid JSON: {err}", file=name) from None
    if type(raw) is not dict or raw.get("file") != fname or type(raw.get("tensors")) is not dict:
        raise CorruptCheckpointError(f"{name}: not the index of {fname}", file=name)
    fsize = m.files.get(fname, 0)
    out: dict[str, Chunk] = {}
    spans = list(explicit)
    for path, v in raw["tensors"].items():
        e = m.tensors.get(path)
        if e is None or e.regular is None or part >= e.regular.parts:
            raise CorruptCheckpointError(f"{name}: tensor {str(path)[:80]!r} is not a regular tensor with a part {part}", file=name)
        box = e.regular.part_box(e.shape, part)
        nbytes = box.numel * ITEMSIZE[e.dtype]
        if type(v) is not list or len(v) != 3:
            raise CorruptCheckpointError(f"{name}: entry of {path[:80]!r} is malformed", file=name, entry=path)
        off, length, sums = v
        if type(off) is not int or type(length) is not int or length != nbytes or not 0 <= off <= fsize - length:
            raise CorruptCheckpointError(
                f"{name}: part {part} of {path[:80]!r} ({nbytes} bytes) does not fit {fname} ({fsize} bytes) at {off}",
                file=name, entry=path,
            )
        if type(sums) is not list or len(sums) != -(-length // m.block_size) or not all(
            type(s) is str and len(s) == 16 for s in sums
        ):
            raise CorruptCheckpointError(f"{name}: checksums of {path[:80]!r} are malformed", file=name, entry=path)
        if length:
            spans.append((off, off + length, path))
        out[path] = Chunk(list(box.offsets), list(box.sizes), fname, off, length, sums)
    for path, e in m.tensors.items():
        # Invariant: every non-empty part is described, so a tensor is always read whole.
        if e.regular is not None and part < e.regular.nonempty(e.shape) and path not in out:
            raise CorruptCheckpointError(f"{name}: part {part} of {path[:80]!r} is missing", file=name, entry=path)
    spans.sort()
    for (_, end, p1), (start, _, p2) in zip(spans, spans[1:]):
        if start < end:
            raise CorruptCheckpointError(f"{name}: {p1[:60]!r} and {p2[:60]!r} claim the same bytes of {fname}", file=name)
    return out


class ChunkSource:
    """The chunks of a checkpoint's tensors, regular ones resolved through their index files.

    ``read(name)`` returns the bytes of a file of the checkpoint directory (a storage read in
    the library, in-memory bytes in ``bench/planner_scale.py``). One per load, one thread.
    """

    def __init__(self, m: Manifest, read: Callable[[str], bytes]) -> None:
        self.m = m
        self._read = read
        self._cache: dict[int, dict[str, Chunk]] = {}
        self._explicit: dict[str, list[tuple[int, int, str]]] | None = None

    @classmethod
    def of(cls, storage: Any, directory: str, m: Manifest) -> ChunkSource:
        def read(name: str) -> bytes:
            try:
                return storage.read_bytes(storage.join(directory, name), m.indexes[name][0])
            except (FileNotFoundError, NotADirectoryError) as e:
                raise CorruptCheckpointError(f"{storage.join(directory, name)}: index file is missing ({e})", file=name) from e
            except OSError as e:  # EACCES, EMFILE, ESTALE: the process's, raised (restore must not fall back)
                if not is_media_error(e):  # (an object store's EIO is not a medium's: FsspecStorage marks it)
                    raise
                raise CorruptCheckpointError(f"{storage.join(directory, name)}: index file cannot be read ({e})", file=name) from e

        return cls(m, read)

    def index(self, part: int) -> dict[str, Chunk]:
        """Index ``part`` (read and validated once)."""
        got = self._cache.get(part)
        if got is None:
            if self._explicit is None:
                self._explicit = {}
                for p, e in self.m.tensors.items():
                    for c in e.chunks if e.alias is None else ():  # an alias: its target's bytes
                        if c.length:
                            self._explicit.setdefault(c.file, []).append((c.offset, c.offset + c.length, p))
            name = index_file(part)
            if name not in self.m.indexes:
                raise CorruptCheckpointError(f"{name} is not listed in the manifest", file=name)
            got = self._cache[part] = parse_index(self._read(name), part, self.m, self._explicit.get(data_file(part), []))
        return got

    def chunks(self, path: str, e: TensorEntry, box: Box) -> list[Chunk]:
        """The chunks of tensor ``path`` that may overlap ``box`` (all non-empty ones for the full box)."""
        if e.regular is None:
            if len(e.chunks) < 2:  # plan_reads skips a chunk that misses the box
                return e.chunks
            return [e.chunks[i] for i in overlapping([(c.offsets, c.sizes) for c in e.chunks], box)]
        return [self.index(i)[path] for i in e.regular.overlapping(e.shape, box)]

    def all_chunks(self, path: str, e: TensorEntry) -> list[Chunk]:
        if e.regular is None:
            return e.chunks
        return [self.index(i)[path] for i in range(e.regular.nonempty(e.shape))]

    def files(self, e: TensorEntry) -> set[str]:
        """The data files holding tensor ``e`` (no index read)."""
        if e.regular is None:
            return {c.file for c in e.chunks}
        return {data_file(i) for i in range(e.regular.nonempty(e.shape))}


def plan_args(chunks: list[Chunk]) -> list[tuple[Box, str, int, int, list[str]]]:
    """``planner.plan_reads``'s chunk tuples."""
    return [(Box(tuple(c.offsets), tuple(c.sizes)), c.file, c.offset, c.length, c.checksums) for c in chunks]
