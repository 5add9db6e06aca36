"""A corrupt source checkpoint of ``export``, ``convert`` and ``consolidate`` is named, with what to do.

Who calls: :func:`trainguard.export.export`, :func:`trainguard.convert.convert` (a trainguard source)
and :func:`trainguard.consolidate.consolidate`, each around all of its reading, in its one process.
A ``CorruptCheckpointError`` raised inside (a block's checksum, a truncated or missing data file, a
damaged manifest) leaves :func:`naming_source` with the checkpoint's path and step in its message
(``partread.in_checkpoint``, as ``tg.load`` names it) and what to do: the earlier step directories
of its run directory that hold a manifest, newest first, and the ``trainguard verify`` command that
tells which of them verify. Before (review56d), ``trainguard export``/``convert``/``consolidate``
of a step whose block failed said only ``error: data-00000.bin: checksum mismatch in tensor
'model/bias' (bytes 0..12): the checkpoint is corrupt``: no checkpoint, no step, nothing to do.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator
from typing import Any

from . import layout
from .errors import CorruptCheckpointError

_SHOWN = 5  # earlier steps named in the hint


@contextlib.contextmanager
def naming_source(src: str | os.PathLike[str]) -> Iterator[None]:
    """Around a command's reads of the trainguard checkpoint ``src`` (a path or URL, as given):
    its ``CorruptCheckpointError`` re-raised (the same object) naming ``src``, its step, and what to do."""
    try:
        yield
    except CorruptCheckpointError as e:
        named(e, os.fspath(src))
        raise


def named(e: CorruptCheckpointError, src: str) -> CorruptCheckpointError:
    """``e`` with :func:`naming_source`'s words added to its message (once); the same object."""
    from .partread import in_checkpoint

    msg = e.args[0] if e.args and isinstance(e.args[0], str) else None
    if msg is None or "trainguard verify" in msg:
        return e
    shown = src.rstrip("/") or src
    in_checkpoint(e, shown, _Step(layout.parse_step(os.path.basename(shown))))
    return advised(e, shown)


def advised(e: CorruptCheckpointError, src: str) -> CorruptCheckpointError:
    """``e`` with what to do added (once): :func:`named` without naming the checkpoint again, for
    ``tg.load`` (``userload.py``), whose errors name it already; the same object."""
    msg = e.args[0] if e.args and isinstance(e.args[0], str) else None
    if msg is None or "trainguard verify" in msg:
        return e
    shown = src.rstrip("/") or src
    e.args = (f"{msg.rstrip('. ')}; {_what_to_do(shown, layout.parse_step(os.path.basename(shown)))}", *e.args[1:])
    return e


class _Step:
    """What ``in_checkpoint`` reads of a manifest: the step (the directory's name's; None: not a step's)."""

    def __init__(self, step: int | None) -> None:
        self.step = step


def _what_to_do(shown: str, step: int | None) -> str:
    """The checkpoints to take instead: ``shown``'s run directory's earlier steps with a manifest."""
    run = os.path.dirname(shown)
    if step is None or not run:
        return f"`trainguard verify {shlex.quote(shown)}` lists every damaged file"
    try:
        earlier = [s.step for s in _steps(run) if s.step < step and s.status == "committed"]
    except Exception:  # noqa: BLE001 - a listing that fails: the hint is a convenience, the error is the news
        earlier = []
    q = shlex.quote(run)
    if not earlier:
        return f"no earlier step of {run} has a manifest (`trainguard verify {q}` checks every step)"
    newest = sorted(earlier, reverse=True)
    steps = ", ".join(map(str, newest[:_SHOWN])) + (f" (and {len(newest) - _SHOWN} more)" if len(newest) > _SHOWN else "")
    return (f"use an earlier step that verifies ({run} holds step{'s' if len(newest) > 1 else ''} {steps}: "
            f"`trainguard verify {q}` says which verify)")


def _steps(run: str) -> list[Any]:
    from .commit import list_steps
    from .storage import for_path

    storage, root = for_path(run)
    return list_steps(storage, root)
