"""An entry of a checkpoint streamed into one ``.safetensors`` file (``export.export``, offline,
one process): the header comes from the manifest alone (names, dtypes, shapes, offsets), then the
tensors are read in batches of up to 256 MiB (``consolidate.GROUP``, checksums verified; a larger tensor in pieces) into one
reused buffer and written after it with ``io.write_batches`` (direct I/O on local disks). Memory
holds one batch, not the model: safetensors' own ``save_file`` writes from a dict of every tensor.

The file is what ``save_file`` writes (the format: an 8-byte little-endian header length, the
JSON header padded with spaces to 8 bytes, the tensors' bytes back to back, larger dtypes first) and
what ``safetensors.torch.load_file``/``safe_open`` read; tests read every file it writes back
with them. A dtype without a safetensors name here: ``None`` (the caller uses ``save_file``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .commit import check_file_sizes
from .consolidate import whole_batches
from .errors import CheckpointError
from .index import ChunkSource
from .io import DEFAULT_BLOCK, WriteChunk, write_batches
from .manifest import Manifest, TensorEntry
from .storage import LocalStorage, Storage

# torch dtype -> safetensors' name for it (not all: complex64 and the fnuz float8 types, which safetensors 0.8
# names C64, F8_E4M3FNUZ, F8_E5M2FNUZ, go through save_file, as do dtypes safetensors has no name for)
NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    **{getattr(torch, t): n for t, n in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")) if hasattr(torch, t)},
}


def header(mine: list[tuple[str, str, TensorEntry]], metadata: Mapping[str, str]) -> tuple[bytes, list[int]] | None:
    """The file's first bytes (length + padded JSON header) and each tensor's offset in the data
    section, in ``mine``'s order; None when a dtype has no safetensors name."""
    doc: dict[str, Any] = {"__metadata__": dict(metadata)}
    offs, pos = [], 0
    for name, _path, e in mine:
        if e.torch_dtype not in NAMES or name == "__metadata__":  # save_file says why it cannot
            return None
        doc[name] = {"dtype": NAMES[e.torch_dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        offs.append(pos)
        pos += e.nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offs


def write(
    storage: Storage, directory: str, manifest: Manifest, mine: list[tuple[str, str, TensorEntry]], path: str,
    metadata: Mapping[str, str], what: str,
) -> bool:
    """Write ``mine`` (``(name, manifest path, entry)``) of the checkpoint at ``directory`` to the
    local file ``path``; False (nothing written) when a dtype has no safetensors name. The caller
    makes ``path`` replace the destination (``export.replacing``). An error reading the checkpoint
    is raised as it is; one writing ``path``, as a ``CheckpointError`` saying ``what``."""
    # Larger elements first (then by name), as save_file orders them: every tensor's offset is then a
    # multiple of its element size (the data section starts on 8 bytes), so it can be viewed in place.
    mine = sorted(mine, key=lambda m: (-m[2].torch_dtype.itemsize, m[0]))
    got = header(mine, metadata)
    if got is None:
        return False
    head, rel = got
    offs = [len(head) + o for o in rel]  # in the file
    src = ChunkSource.of(storage, directory, manifest)
    # Sizes on disk first, as a load checks them: no read past what the files hold.
    check_file_sizes(storage, directory, manifest, {f for _n, _p, e in mine for f in src.files(e)})
    reading: list[BaseException] = []

    def batches() -> Iterator[list[WriteChunk]]:
        yield [WriteChunk(memoryview(head), 0)]
        yield from whole_batches(storage, directory, src, [(p, e) for _n, p, e in mine], offs, failed=reading)

    try:
        write_batches(LocalStorage(), path, batches(), len(head) + sum(e.nbytes for _n, _p, e in mine), block=DEFAULT_BLOCK)
    except Exception as e:
        if isinstance(e, CheckpointError) or e in reading:  # a full disk says so itself
            raise
        raise CheckpointError(f"{what}: {type(e).__name__}: {e}") from e
    return True


def refuse_names(names: Iterable[str], out: str) -> None:
    """Refuse, before anything is written, a tensor name that a safetensors file cannot hold
    (``export.export`` and ``convert._stream_file``, for a ``.safetensors`` destination):
    ``__metadata__``, the header's own key (``save_file`` wrote it twice: a file that does not
    load), and a str that is not UTF-8 (a lone surrogate: ``save_file`` raised UnicodeEncodeError
    while the streamed header held a JSON escape that safetensors refuses to read)."""
    for n in names:
        try:
            n.encode("utf-8")
            why = "the name of the file's own metadata" if n == "__metadata__" else ""
        except UnicodeEncodeError:
            why = "not UTF-8: a lone surrogate"
        if why:
            raise CheckpointError(
                f"{out}: tensor name {n[:80]!r} cannot be stored in a safetensors file ({why}); "
                "export to a .pt file instead, or rename the tensor")
