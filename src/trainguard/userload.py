"""``tg.load`` as the user calls it: a damaged checkpoint's error says what to load instead.

Who calls: the script, on every rank, as ``tg.load`` (``api.load`` is this). The manager's ``restore``
calls :func:`trainguard.loader.load` itself, which this wraps: it falls back to older checkpoints on
its own, and its skip lines stay as they were.

A ``CorruptCheckpointError`` of a checkpoint in a run directory (a failed block checksum, a data file
cut short or missing, a damaged manifest or index) gets the words ``export``, ``convert`` and
``consolidate`` give it (:func:`trainguard.srcnamed.advised`): the run directory's earlier steps that
hold a manifest, newest first, and the ``trainguard verify`` command that says which of them verify;
an error that says what to do already (a missing file, a load that had begun writing) gets them in
place of its own "another checkpoint", one piece of advice (polish58).
Before (review57c), ``tg.load`` of a step whose data file was cut by one byte said only
``.../data-00000.bin: 6004159 bytes on disk, the manifest says 6004160 (truncated or replaced)``,
and of a damaged manifest ``checksum mismatch: the manifest is corrupt``: nothing to do. The listing
runs only on that error, on the rank that raises it (the others raise ``RankFailureError`` naming it).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from .errors import CorruptCheckpointError
from .loader import load as load_in_place


@functools.wraps(load_in_place)
def load(path: str | os.PathLike[str], state: Any, **kwargs: Any) -> Any:
    try:
        return load_in_place(path, state, **kwargs)
    except CorruptCheckpointError as e:
        from .srcnamed import advised

        advised(e, os.fspath(path))  # the same object, its message completed
        raise
