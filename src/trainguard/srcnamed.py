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
_LOOKED = 20  # step directories whose manifest the hint looks for, at most


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
    shown = _canonical(src.rstrip("/") or src)
    in_checkpoint(e, shown, _Step(layout.parse_step(os.path.basename(shown))))
    return advised(e, shown)


def advised(e: CorruptCheckpointError, src: str) -> CorruptCheckpointError:
    """``e`` with what to do added (once): :func:`named` without naming the checkpoint again, for
    ``tg.load`` (``userload.py``), whose errors name it already; the same object.

    A message that says what to do already gets one piece of advice, not two: a missing file's
    (``loadfiles.what_to_do``: "copy the checkpoint directory whole, or load another checkpoint (...)")
    and a load that had begun writing into the state (``partread.PARTLY``: "load a checkpoint that
    verifies before using it") have their "another checkpoint" replaced by the earlier steps; a
    checkpoint whose directory was renamed (``commit.read_manifest``: rename it back) gets nothing.
    Before (polish58) each was followed by ``; use an earlier step that verifies (...)``."""
    msg = e.args[0] if e.args and isinstance(e.args[0], str) else None
    if msg is None or "trainguard verify" in msg or getattr(e, "advice_given", False):
        return e
    shown = _canonical(src.rstrip("/") or src)
    step = layout.parse_step(os.path.basename(shown))
    for generic, merged in _generic():
        if generic in msg:
            e.args = (msg.replace(generic, merged(*_advice(shown, step)), 1), *e.args[1:])
            return e
    e.args = (f"{msg.rstrip('. ')}; {_what_to_do(shown, step)}", *e.args[1:])
    return e


def _generic() -> tuple[tuple[str, Any], ...]:
    """The advice other modules end a message with that names no checkpoint, and how :func:`advised`
    writes it with ``(what, note)`` of :func:`_advice` in its place."""
    from .loadfiles import LOAD_ANOTHER
    from .partread import VERIFY_FIRST

    return ((LOAD_ANOTHER, lambda what, note: f"load {what} ({note})"),
            (VERIFY_FIRST, lambda what, note: f"load {what} before using it ({note})"))


def _canonical(src: str) -> str:
    """A URL as the error's own paths show it (``storage.location``: ``memory:///run`` as ``memory://run``);
    a local path as given (``step-000000005`` in its run directory stays relative)."""
    if "://" not in src:
        return src
    from .storage import for_path, location

    try:
        storage, root = for_path(src)
    except Exception:  # noqa: BLE001 - an unknown scheme: shown as given
        return src
    return location(storage, root)


class _Step:
    """What ``in_checkpoint`` reads of a manifest: the step (the directory's name's; None: not a step's)."""

    def __init__(self, step: int | None) -> None:
        self.step = step


def _what_to_do(shown: str, step: int | None) -> str:
    """The checkpoints to take instead: ``shown``'s run directory's newest earlier steps with a manifest."""
    what, note = _advice(shown, step)
    return f"use {what} ({note})" if what.startswith("an earlier") else note


def _advice(shown: str, step: int | None) -> tuple[str, str]:
    """What to load instead of ``shown`` and a note that names it: ``("an earlier step that verifies",
    "<run> holds steps 4, 3: `trainguard verify <run>` says which verify")`` when ``shown``'s run directory
    holds earlier steps with a manifest; else ``("another checkpoint", <why none is named>)``."""
    run = os.path.dirname(shown) or "."  # "step-000000005" given in its run directory: the run is "."
    if step is None:
        return "another checkpoint", f"`trainguard verify {shlex.quote(shown)}` lists every damaged file"
    try:
        earlier, looked, rest = _earlier(run, step)
    except Exception:  # noqa: BLE001 - a listing that fails: the hint is a convenience, the error is the news
        return "another checkpoint", f"`trainguard verify {shlex.quote(shown)}` lists every damaged file"  # HTTP: no listing
    q = shlex.quote(run)
    if not earlier:
        which = f"none of the {looked} newest earlier step directories" if rest else "no earlier step"
        return "another checkpoint", f"{which} of {run} has a manifest: `trainguard verify {q}` checks every step"
    steps = ", ".join(map(str, earlier)) + (f" (and {rest} older step director{'ies' if rest > 1 else 'y'})" if rest else "")
    return ("an earlier step that verifies",
            f"{run} holds step{'s' if len(earlier) > 1 or rest else ''} {steps}: `trainguard verify {q}` says which verify")


def _earlier(run: str, step: int) -> tuple[list[int], int, int]:
    """The newest (up to ``_SHOWN``) steps before ``step`` in ``run`` whose directory holds a manifest, how many
    step directories were looked in, and how many older ones were not. One listing of ``run``'s names (on an
    object store a delimiter listing: a request per 1,000 step directories) and a lookup of the manifest of at
    most ``_LOOKED`` of them, newest first. ``commit.list_steps`` (review57c) listed every object of the run on an
    object store (a request per 1,000 objects: 1.0-1.4 s on the tests' SeaweedFS for a run of 100 steps of 32
    ranks, against 0.02 s for the failed load itself), on every rank whose load failed, and stat'ed every step's
    manifest on a file system."""
    from .storage import for_path

    storage, root = for_path(run)
    dirs = getattr(storage, "listdir_dirs", None)
    names = dirs(root) if dirs is not None else storage.listdir(root)
    older = sorted(((s, n) for n in names if (s := layout.parse_step(n)) is not None and s < step), reverse=True)
    found: list[int] = []
    looked = 0
    for s, name in older[:_LOOKED]:
        if len(found) == _SHOWN:
            break
        looked += 1
        if storage.exists(storage.join(root, name, layout.MANIFEST)):
            found.append(s)
    return found, looked, len(older) - looked
