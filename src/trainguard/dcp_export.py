"""``trainguard convert ... --to dcp``: a trainguard checkpoint's entries written as a
``torch.distributed.checkpoint`` directory, one process, no process group. ``convert.convert``
calls :func:`check_dcp_destination` before it reads the source, then :func:`write_dcp` with the
state it read (``dcp_lazy.read_entries``)."""

from __future__ import annotations

import os
from typing import Any

from .dcp_import import single_process
from .errors import CheckpointError
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
    by item as DCP writes them (``dcp_lazy``): memory holds about 256 MiB, not the state."""
    import shutil
    import uuid

    import torch.distributed.checkpoint as dcp

    head, name = os.path.split(absolute(out))
    tmp = os.path.join(head, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with single_process():  # no_dist: without torch's warning that it assumes one process
            from .dcp_empty import KeepEmptyPlanner  # its empty dicts too (DCP writes no item for them)

            if source is None:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=KeepEmptyPlanner(), no_dist=True)
            else:
                from .dcp_lazy import LazyPlanner, writer

                dcp.save(state, storage_writer=writer(tmp), planner=LazyPlanner(source), no_dist=True)
        os.rename(tmp, out)  # over an empty directory too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd = os.open(head, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
