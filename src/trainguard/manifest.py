"""The manifest: versioned, human-readable JSON, validated field by field before any use.

``manifest.json`` is ``{"checksum":"<xxh3_64 hex>","manifest":<body>}`` where the checksum
covers the exact bytes of ``<body>``: a flipped byte anywhere is detected before parsing the
body. Written by rank 0 only, last, after every rank reported success (see ``commit.py``).

Body (format_version 1)::

    {"format_version": 1, "step": 700, "created": 1764500000.0, "world_size": 2,
     "layout": "sharded", "library": "trainguard 0.1.0", "torch": "2.13.0",
     "checksum": "xxh3_64", "block_size": 4194304, "metadata": {...},
     "files": {"data-00000.bin": 123456},
     "objects": {"model": {"skeleton": {...}}, "rng": {"ranks": [{...}, {...}]}},
     "tensors": {"model/fc.weight": {"dtype": "float32", "shape": [4, 3],
                 "chunks": [[offsets, sizes, file, byte_offset, length, [checksums...]]]}}}

Chunks are lists, not objects, to keep manifests of thousands of ranks small.

format_version 2 (written only when some tensor uses it) adds regularly sharded tensors::

     "indexes": {"data-00000.idx": [size, "<xxh3_64 hex>"], ...},
     "tensors": {"model/w": {"dtype": "bfloat16", "shape": [4096, 4096],
                 "regular": {"dim": 0, "parts": 4096}}}

Part ``i`` of a regular tensor is the ``torch.chunk``/``Shard(dim)`` box ``i`` (see
``planner.Regular``) and lives in ``data-{i:05d}.bin``; where in that file, and its block
checksums, are in the index ``data-{i:05d}.idx`` (``index.py``), whose size and checksum the
manifest holds. The manifest stays O(tensors + ranks) instead of O(tensors x ranks).

format_version 3 (written only when some entry is an alias) stores a tensor that one rank's
state holds under several names (a tie: ``lm_head.weight`` IS ``wte.weight``) once: the first
name in the state's order keeps the chunks, each later name is an alias entry naming it::

     "tensors": {"model/lm_head.weight": {"dtype": "float32", "shape": [50257, 768],
                 "alias": "model/wte.weight"}}

The target exists, is not an alias itself, has chunks (not ``regular``), and the same dtype and
shape; parsed, an alias entry shares its target's ``chunks`` list (``tied.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from .dtypenames import ITEMSIZE, stored
from .errors import CorruptCheckpointError, FormatVersionError, UnsupportedValueError
from .layout import DATA_RE, MAX_STEP
from .planner import Regular, tiles
from .skeleton import decode_json, loads_json, single_tensor, unflatten
from .tied import parse_alias, resolve_aliases

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1  # what a save writes with no regular tensor and no alias (``format_for``)
SUPPORTED_VERSIONS = (1, 2, 3)

# Hard limits on what a manifest may claim (hostile or corrupt input).
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 48
MAX_BLOCK = 1 << 30


def checksum(data: Any) -> str:
    """The checksum of a bytes-like object: xxh3_64 as 16 hex digits (releases the GIL)."""
    return xxhash.xxh3_64_hexdigest(data)


def hasher() -> Any:
    """A streaming form of :func:`checksum`: ``update()`` with the parts in order, then
    ``hexdigest()`` equals ``checksum`` of the whole (``reads.Piece`` hashes hot blocks so)."""
    return xxhash.xxh3_64()


@dataclass(slots=True)
class Chunk:
    """One stored box of a tensor: ``offsets``/``sizes`` in the global tensor, bytes at
    ``[offset, offset+length)`` of ``file``, one checksum per ``block_size`` bytes."""

    offsets: list[int]
    sizes: list[int]
    file: str
    offset: int
    length: int
    checksums: list[str]

    def to_json(self) -> list[Any]:
        return [self.offsets, self.sizes, self.file, self.offset, self.length, self.checksums]


@dataclass
class TensorEntry:
    dtype: str
    shape: list[int]
    chunks: list[Chunk]
    regular: Regular | None = None  # format 2: parts listed in the index files, chunks empty
    alias: str | None = None  # format 3: the path of the entry holding the bytes (its chunks shared)

    @property
    def torch_dtype(self) -> torch.dtype:
        from .dtypes import DTYPES  # torch: a tensor is made or checked

        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        if self.alias is not None:
            return {"dtype": self.dtype, "shape": self.shape, "alias": self.alias}
        if self.regular is not None:
            return {"dtype": self.dtype, "shape": self.shape, "regular": {"dim": self.regular.dim, "parts": self.regular.parts}}
        # Chunk.to_json inline: one call per tensor, not two (10,000 small tensors)
        return {"dtype": self.dtype, "shape": self.shape, "chunks": [[c.offsets, c.sizes, c.file, c.offset, c.length, c.checksums] for c in self.chunks]}


@dataclass
class Manifest:
    step: int
    world_size: int
    created: float
    layout: str
    block_size: int
    files: dict[str, int]
    objects: dict[str, dict[str, Any]]
    tensors: dict[str, TensorEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    library: str = ""
    torch_version: str = ""
    format_version: int = FORMAT_VERSION
    indexes: dict[str, tuple[int, str]] = field(default_factory=dict)  # format 2: name -> (size, xxh3_64)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def to_bytes(self) -> bytes:
        from .flatten import encode_json  # torch: a save's, not a manifest's readers' (trainguard ls, verify)
        extra: dict[str, Any] = {"indexes": {k: list(v) for k, v in self.indexes.items()}} if self.format_version >= 2 else {}
        body = json.dumps(
            {
                "format_version": self.format_version,
                "step": self.step,
                "created": self.created,
                "world_size": self.world_size,
                "layout": self.layout,
                "library": self.library,
                "torch": self.torch_version,
                "checksum": "xxh3_64",
                "block_size": self.block_size,
                "metadata": encode_json(self.metadata),
                "files": self.files,
                **extra,
                "objects": self.objects,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode()
        if len(body) > MAX_MANIFEST_BYTES - 64:  # no load would read it: refused before the commit
            raise UnsupportedValueError(
                f"the manifest would be {len(body)} bytes, over the {MAX_MANIFEST_BYTES} a load reads: the state's "
                "JSON values (numbers, strings, lists outside tensors) are too many; put bulk data in tensors")
        return b'{"checksum":"' + checksum(body).encode() + b'","manifest":' + body + b"}\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest.json") -> Manifest:
        return parse(data, where)


_PREFIX = b'{"checksum":"'


def parse(data: bytes, where: str = "manifest.json") -> Manifest:
    """Check the checksum, then validate every field. Raises CorruptCheckpointError/FormatVersionError."""
    try:
        raw = loads_json(verified_body(data, where))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: invalid JSON: {e}", file=where) from None
    return validate(raw, where)


def verified_body(data: bytes, where: str = "manifest.json") -> bytes:
    """The JSON body of a manifest file's bytes, its checksum verified (``parse``, ``retention.read_facts``)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes is larger than any manifest", file=where)
    head = len(_PREFIX) + 16
    # Exactly what ``to_bytes`` writes, ending in b"}\n": a cut-off or altered last byte is
    # corruption too, not whitespace to strip.
    if not (data.startswith(_PREFIX) and data[head : head + 13] == b'","manifest":' and data.endswith(b"}\n")):
        raise CorruptCheckpointError(f"{where}: not a trainguard manifest (or truncated)", file=where)
    want = data[len(_PREFIX) : head].decode("ascii", "replace")
    body = data[head + 13 : len(data) - 2]
    if checksum(body) != want:
        raise CorruptCheckpointError(f"{where}: checksum mismatch: the manifest is corrupt", file=where)
    return body


def _req(d: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise CorruptCheckpointError(f"{where}: missing field {key!r}", file=where)
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise CorruptCheckpointError(f"{where}: field {key!r} has type {type(v).__name__}", file=where)
    return v


def _int(v: Any, lo: int, hi: int, what: str, where: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptCheckpointError(f"{where}: {what} = {str(v)[:40]!r} is not an integer in [{lo}, {hi}]", file=where)
    return v


def validate(raw: Any, where: str = "manifest.json") -> Manifest:
    """Turn a parsed JSON body into a Manifest, checking types, bounds and cross references."""
    if type(raw) is not dict:
        raise CorruptCheckpointError(f"{where}: body is not an object", file=where)
    version = raw.get("format_version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:  # true == 1 in Python
        raise FormatVersionError(
            f"{where}: format_version {str(version)[:20]} is not supported by this trainguard "
            f"(reads {', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade trainguard to load it"
        )
    if raw.get("checksum", "xxh3_64") != "xxh3_64":
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {str(raw.get('checksum'))[:20]!r}")
    step = _int(_req(raw, "step", int, where), 0, MAX_STEP, "step", where)
    world = _int(_req(raw, "world_size", int, where), 1, 1 << 20, "world_size", where)
    block = _int(_req(raw, "block_size", int, where), 1, MAX_BLOCK, "block_size", where)
    created = _req(raw, "created", (int, float), where)
    if not 0 <= created < 1e11:  # nan, inf, or no time a clock of ours gives
        raise CorruptCheckpointError(f"{where}: created={created!r} is no timestamp", file=where)
    layout = _req(raw, "layout", str, where)
    if layout not in ("sharded", "full"):
        raise CorruptCheckpointError(f"{where}: unknown layout {layout[:20]!r}", file=where)
    files_raw = _req(raw, "files", dict, where)
    files: dict[str, int] = {}
    for name, size in files_raw.items():
        if not DATA_RE.match(name):
            raise CorruptCheckpointError(f"{where}: data file name {name[:60]!r} is not allowed", file=where)
        files[name] = _int(size, 0, MAX_TENSOR_BYTES, f"size of {name}", where)
    from .index import check_regular_files, parse_indexes  # format 2; index.py imports this module

    indexes = parse_indexes(raw, version, where)
    objects = _req(raw, "objects", dict, where)
    tensors: dict[str, TensorEntry] = {}
    for path, t in _req(raw, "tensors", dict, where).items():
        tensors[path] = _tensor(path, t, files, block, where, version)
    if version >= 3:
        resolve_aliases(tensors, where)
    check_regular_files(tensors, files, indexes, where)
    _check_file_ranges(tensors, where)
    for key, obj in objects.items():
        # A rank-local entry holds one skeleton per rank (None for a rank without it): a list of another length
        # would give one rank another rank's state (a hand edit; no save writes it).
        if type(obj) is not dict or not ("skeleton" in obj or (type(obj.get("ranks")) is list and len(obj["ranks"]) == world)):
            raise CorruptCheckpointError(f"{where}: object {key[:60]!r} is malformed", file=where)
        for skel in [obj["skeleton"]] if "skeleton" in obj else obj["ranks"]:
            if single_tensor(skel) in tensors:
                continue  # an entry that is one described tensor: nothing else to check
            _check_skeleton(skel, tensors, f"{where}: object {key[:60]!r}")
    metadata = raw.get("metadata", {})
    if type(metadata) is not dict:
        raise CorruptCheckpointError(f"{where}: metadata is not an object", file=where)
    metadata = decode_json(metadata, f"{where}: metadata")
    return Manifest(
        step=step,
        world_size=world,
        created=float(created),
        layout=layout,
        block_size=block,
        files=files,
        objects=objects,
        tensors=tensors,
        metadata=metadata,
        library=str(raw.get("library", "")),
        torch_version=str(raw.get("torch", "")),
        format_version=version,
        indexes=indexes,
    )


def _tensor(path: str, t: Any, files: dict[str, int], block: int, where: str, version: int = 1) -> TensorEntry:
    if type(t) is not dict:
        raise CorruptCheckpointError(f"{_w(where, path)} is malformed", file=where, entry=path)
    dtype = t.get("dtype")
    if type(dtype) is not str or not stored(dtype):  # a list here would raise TypeError
        raise CorruptCheckpointError(f"{_w(where, path)}: unknown dtype {str(dtype)[:20]!r}", file=where, entry=path)
    shape = t.get("shape")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"{_w(where, path)}: bad shape", file=where, entry=path)
    itemsize = ITEMSIZE[dtype]
    if block % itemsize:  # a resharding read's views of whole blocks failed in torch (a bare RuntimeError)
        raise CorruptCheckpointError(f"{_w(where, path)}: block_size {block} is not a multiple of its {dtype} item size "
                                     f"({itemsize}): the manifest is corrupt or hand-edited", file=where, entry=path)
    nonzero = itemsize  # the product of the nonzero dims, times the item size
    for s in shape:  # a loop, not all() and prod() over generators: this runs for every tensor
        if type(s) is not int or not 0 <= s <= MAX_TENSOR_BYTES:
            _int(s, 0, MAX_TENSOR_BYTES, "shape", _w(where, path))  # raises, naming the value
        if s:
            nonzero *= s
    # Nonzero dims only: [0, 3e9, 3e9] holds nothing but its strides overflow int64 in torch.
    if nonzero > MAX_TENSOR_BYTES:
        raise CorruptCheckpointError(f"{_w(where, path)}: claims {math.prod(shape) * itemsize} bytes", file=where, entry=path)
    if "alias" in t:  # format 3: no chunks of its own (resolve_aliases checks the target)
        return TensorEntry(dtype, shape, [], alias=parse_alias(t, version, _w(where, path), where, path))
    if version >= 2 and "regular" in t:
        from .index import parse_regular

        return TensorEntry(dtype=dtype, shape=shape, chunks=[], regular=parse_regular(t, shape, _w(where, path), where, path))
    chunks_raw = t.get("chunks")
    if type(chunks_raw) is not list:
        raise CorruptCheckpointError(f"{_w(where, path)}: chunks is not a list", file=where, entry=path)
    chunks = []
    volume = 0
    for c in chunks_raw:
        if type(c) is not list or len(c) != 6:
            raise CorruptCheckpointError(f"{_w(where, path)}: malformed chunk", file=where, entry=path)
        offs, sizes, fname, off, length, sums = c
        if type(offs) is not list or type(sizes) is not list or len(offs) != len(shape) or len(sizes) != len(shape):
            raise CorruptCheckpointError(f"{_w(where, path)}: chunk box does not match the shape", file=where, entry=path)
        for o, s, dim in zip(offs, sizes, shape):
            if type(o) is int and type(s) is int and o >= 0 and s >= 0 and o + s <= dim:
                continue  # the common case, one test; the slow path below says what is wrong
            _int(o, 0, dim, "chunk offset", _w(where, path))
            _int(s, 0, dim, "chunk size", _w(where, path))
            raise CorruptCheckpointError(f"{_w(where, path)}: chunk extends past the tensor", file=where, entry=path)
        if type(fname) is not str or fname not in files:
            raise CorruptCheckpointError(f"{_w(where, path)}: chunk refers to unknown file {str(fname)[:60]!r}", file=where, entry=path)
        flen = files[fname]
        if not (type(off) is int and type(length) is int and 0 <= off <= flen and 0 <= length <= flen):
            _int(off, 0, flen, "chunk offset in file", _w(where, path))  # raises, naming the value
            _int(length, 0, flen, "chunk length", _w(where, path))
        n = math.prod(sizes)
        if length != n * itemsize or off + length > flen:
            raise CorruptCheckpointError(
                f"{_w(where, path)}: chunk length {length} does not fit its box ({n * itemsize} bytes) or its file",
                file=where,
                entry=path,
            )
        if type(sums) is not list or len(sums) != -(-length // block) or not (
            (type(sums[0]) is str and len(sums[0]) == 16)
            if len(sums) == 1
            else all(type(s) is str and len(s) == 16 for s in sums)
        ):
            raise CorruptCheckpointError(f"{_w(where, path)}: chunk checksums are malformed", file=where, entry=path)
        volume += n
        chunks.append(Chunk(offs, sizes, fname, off, length, sums))  # fresh lists from the JSON parser
    if volume != math.prod(shape):
        raise CorruptCheckpointError(
            f"{_w(where, path)}: chunks cover {volume} elements, the shape has {math.prod(shape)}", file=where, entry=path
        )
    # The boxes tile the tensor exactly: no element is left unread (uninitialised memory) and
    # none is written twice.
    if len(chunks) > 1 and not (ok := tiles([(c.offsets, c.sizes) for c in chunks if math.prod(c.sizes)], shape)):
        why = "overlap (they do not tile the tensor)" if ok is False else "are too irregular a layout to check"
        raise CorruptCheckpointError(f"{_w(where, path)}: chunks {why}", file=where, entry=path)
    return TensorEntry(dtype, shape, chunks)


def _w(where: str, path: str) -> str:
    """How an error names a tensor entry (built only when there is an error)."""
    return f"{where}: tensor {path[:80]!r}"


def _check_file_ranges(tensors: dict[str, TensorEntry], where: str) -> None:
    """No two chunks share bytes of a file: a tensor can never claim more bytes than the files hold."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for path, e in tensors.items():
        if e.alias is not None:
            continue  # its target's chunks
        for c in e.chunks:
            if c.length:
                spans.setdefault(c.file, []).append((c.offset, c.offset + c.length, path))
    for fname, rs in spans.items():
        rs.sort()
        for (_, end, p1), (start, _, p2) in zip(rs, rs[1:]):
            if start < end:
                raise CorruptCheckpointError(
                    f"{where}: tensors {p1[:60]!r} and {p2[:60]!r} claim the same bytes of {fname} (at {start})",
                    file=where,
                    entry=p2,
                )


def _check_skeleton(skel: Any, tensors: dict[str, TensorEntry], where: str) -> None:
    """The skeleton decodes (bounded depth, known markers) and references only described tensors."""
    def known(p: str) -> None:
        if p not in tensors:
            raise CorruptCheckpointError(f"{where}: references tensor {p[:80]!r} that the manifest does not describe")

    unflatten(skel, known, where=where)

