"""``FsspecStorage.open_read``'s reader: ranged GETs of one object, large ones in pieces fetched concurrently."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError
from ._remote import remote as _remote

READ_PIECE = 16 << 20  # ranged GETs above: split


class _RangeReader:
    """Ranged reads, split into pieces fetched concurrently; ``io.read_targets`` reads ops in ``piece_bytes``."""

    piece_bytes = 8 * READ_PIECE  # per read: GETs in flight, bytes held (a 4 GB tensor is not fetched whole)

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path

    @_remote
    def readinto(self, buf: memoryview, offset: int) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        n = len(view)
        if n == 0:
            return
        starts = list(range(offset, offset + n, READ_PIECE))
        ends = [min(s + READ_PIECE, offset + n) for s in starts]
        try:
            if len(starts) == 1:
                pieces = [self.fs.cat_file(self.path, start=offset, end=offset + n)]
            else:
                pieces = self.fs.cat_ranges([self.path] * len(starts), starts, ends, on_error="raise")
            pos = 0
            for s, e, piece in zip(starts, ends, pieces):
                if isinstance(piece, BaseException):
                    raise piece
                if len(piece) != e - s:
                    raise CorruptCheckpointError(
                        f"{self.path}: truncated: wanted {n} bytes at offset {offset}, got {pos + len(piece)}",
                        file=self.path.rsplit("/", 1)[-1],
                    )
                view[pos : pos + len(piece)] = piece
                pos += len(piece)
        except FileNotFoundError:  # deleted since the load checked it (retention, an operator): bad bytes, as locally
            raise CorruptCheckpointError(f"{self.path}: data file is missing", file=self.path.rsplit("/", 1)[-1]) from None
        except OSError as e:  # S3: 416 (InvalidRange) for a range that starts past the end: a truncated object
            if isinstance(e, TimeoutError) or offset + n <= (size := self.fs.size(self.path)):
                raise  # timed out: no size asked of a hung endpoint (a second wait of the bound, and its error raised)
            raise CorruptCheckpointError(f"{self.path}: truncated: wanted {n} bytes at offset {offset}, the object "
                                         f"holds {size}", file=self.path.rsplit("/", 1)[-1]) from e

    def close(self) -> None:
        pass
