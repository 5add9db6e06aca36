"""A load that fails after it began writing into the state says so.

``loader._load`` reads the checkpoint's bytes straight into the state's tensors (in place, no
staging copy), verifying each block's checksum as it is read, and then calls each entry's
``load_state_dict`` in turn. A checksum mismatch found in a tensor late in the files, or an entry's
``load_state_dict`` refusing after the entries before it were loaded, leaves the state partly
loaded: before, the error (``checksum mismatch in tensor ...: the checkpoint is corrupt``) said
nothing of it, and a script that caught it and trained on, or loaded only a subset afterwards,
trained on a mix of two states. Errors raised before anything was written (a refused state; in
one process a missing or truncated data file too) are not marked. With several ranks the data
files are checked after the plan round, when the other ranks may be reading: marked. Every error
of ``load`` that passed here carries ``partly_loaded`` (True or False; alike on every rank, see
:func:`loaded_round`): after a failed load ``CheckpointManager.restore`` counts the tensors the
checkpoint would have written (``inspect.touched_tensors``) only when it is not False.

Who calls: ``loader.load`` on every rank. One process: :func:`partly_read` with whether this
process wrote into the state. Several: :func:`loaded_round`, the "loaded" round that follows the
plan round, after which every rank reads into its own state, so an error raised there (this rank's
or a peer's) is marked on every rank.
"""

from __future__ import annotations

from typing import Any

from .errors import CheckpointError, CorruptCheckpointError, agree_load

PARTLY = (" The load had begun writing into the state (tensors are read in place, entries loaded in turn): "
          "the state may hold part of the checkpoint's values; load a checkpoint that verifies before using it.")


def partly_read(e: BaseException, wrote: bool) -> BaseException:
    """``e`` with :data:`PARTLY` added to its message when ``wrote``, and ``partly_loaded = wrote`` (the same object, returned)."""
    if isinstance(e, CheckpointError):
        e.partly_loaded = wrote or getattr(e, "partly_loaded", False)  # type: ignore[attr-defined]
        if wrote and e.args and isinstance(e.args[0], str) and PARTLY not in e.args[0]:
            e.args = (e.args[0] + ("" if e.args[0].endswith(".") else ".") + PARTLY, *e.args[1:])  # "corrupt The load"
    return e


def in_checkpoint(e: BaseException, shown: str, manifest: Any) -> BaseException:
    """``loader.load``, every rank, on its error ``e`` before it is exchanged: a ``CorruptCheckpointError``
    whose message does not name the checkpoint ``shown`` (its directory or URL) names it, with the step
    when the manifest was read: a data or index file's (``data-00000.bin: checksum mismatch ...``, which
    is all ``tg.load`` said) as ``<shown>/data-00000.bin (checkpoint of step 5): ...``; any other (a
    malformed RNG state) after ``checkpoint <shown> (step 5): ``. The same object, returned."""
    msg = e.args[0] if isinstance(e, CorruptCheckpointError) and e.args and isinstance(e.args[0], str) else None
    if msg is None or shown in msg:
        return e
    step = getattr(manifest, "step", None)
    of = "" if step is None else f" (checkpoint of step {step})"
    if e.file and "/" not in e.file and msg.startswith(f"{e.file}:"):
        msg = f"{shown.rstrip('/')}/{e.file}{of}{msg[len(e.file):]}"
    else:
        msg = f"checkpoint {shown}{'' if step is None else f' (step {step})'}: {msg}"
    e.args = (msg, *e.args[1:])
    return e


def loaded_round(ctx: Any, target: str, e: Exception | None, timeout: float | None, past: bool = True) -> None:
    """``loader.load``'s "loaded" round (every rank, after the first round passed on every rank):
    ``errors.agree_load``, its error marked by :func:`partly_read` when ``past``: every rank passed
    the whole plan round, ``split_state``'s check of the tensors no rank takes included (that check
    raises on every rank alike, before any reads), so every rank may have read into its state."""
    try:
        agree_load(ctx, "loaded", target, e, timeout)
    except CheckpointError as x:
        partly_read(x, past)
        raise
