"""``trainguard convert ... --to dcp``: a trainguard checkpoint's entries written as a
``torch.distributed.checkpoint`` directory, one process, no process group. ``convert.convert``
calls :func:`check_dcp_destination` before it reads the source, then :func:`write_dcp` with the
state it read (``dcp_lazy.read_entries``)."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

from .dcp_import import single_process
from .errors import CheckpointError, DiskFullError
from .storage import absolute


def check_dcp_destination(out: str) -> None:
    """A DCP directory is written only where nothing is: its files would overwrite (or mix with)
    a DCP or trainguard checkpoint's in place."""
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise CheckpointError(
            f"{out} already exists and is not an empty directory; convert writes a DCP checkpoint into a new "
            "directory only. Remove it or pick another name"
        )


def write_dcp(state: dict[str, Any], out: str, source: Any = None) -> None:
    """``dcp.save`` (one process, no process group) into a directory beside ``out``, renamed into
    place once complete: a failed write leaves nothing at ``out``. ``source`` (``convert``: a
    ``dcp_lazy.Source``): ``state``'s tensors are ``meta`` placeholders whose values it reads, item
    by item as DCP writes them (``dcp_lazy``): memory holds about 256 MiB, not the state. A temporary
    directory of an earlier writer of ``out`` killed mid-write is removed first (``outtemp.sweep``)."""
    import uuid

    from .outtemp import owned, sweep

    head, name = os.path.split(absolute(out))
    tmp = os.path.join(head, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    sweep(out)  # the temporary directories of earlier writers of ``out`` that were killed (outtemp)
    with owned(tmp):
        _write(state, tmp, out, source)
    fd = os.open(head, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(state: dict[str, Any], tmp: str, out: str, source: Any) -> None:
    """``write_dcp``, while it owns ``tmp`` (``outtemp.owned``): ``dcp.save`` into ``tmp``, renamed to ``out``."""
    import torch.distributed.checkpoint as dcp

    try:
        with single_process():  # no_dist: without torch's warning that it assumes one process
            from .dcp_empty import KeepEmptyPlanner  # its empty dicts too (DCP writes no item for them)

            if source is None:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=KeepEmptyPlanner(), no_dist=True)
            else:
                from .dcp_lazy import LazyPlanner, writer

                dcp.save(state, storage_writer=writer(tmp), planner=LazyPlanner(source), no_dist=True)
        os.rename(tmp, out)  # over an empty directory too
    except BaseException as e:
        full = _full(tmp, out, e)  # looked at before the temporary directory's bytes are freed
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise


def _full(tmp: str, out: str, e: BaseException) -> DiskFullError | None:
    """``_write`` failed with ``e``: the error to raise instead when the file system of ``tmp`` is full now. DCP
    writes each item with ``torch.save``, whose zip writer turns ENOSPC into "[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598": ``convert --to dcp`` onto a full disk said only that."""
    if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
        return None  # Ctrl-C, SystemExit
    try:
        free = shutil.disk_usage(tmp if os.path.isdir(tmp) else os.path.dirname(tmp)).free
    except OSError:
        return None
    if free >= FULL:
        return None
    return DiskFullError(errno.ENOSPC, f"cannot write {out} as dcp: no space left on device in {os.path.dirname(tmp)} "
                                       f"({free} bytes free while it was written). Free space, or write it elsewhere")


FULL = 1 << 20  # free bytes below which a failed DCP write is taken for a full disk (``_full``)
