"""A load that fails after it began writing into the state says so, and which entries it wrote into.

``loader._load`` reads the checkpoint's bytes straight into the state's tensors (in place, no
staging copy), verifying each block's checksum as it is read, and then calls each entry's
``load_state_dict`` in turn. A checksum mismatch found in a tensor late in the files, or an entry's
``load_state_dict`` refusing after the entries before it were loaded, leaves the state partly
loaded: before, the error (``checksum mismatch in tensor ...: the checkpoint is corrupt``) said
nothing of it, and a script that caught it and trained on, or loaded only a subset afterwards,
trained on a mix of two states. Errors raised before anything was written (a refused state, a
missing or truncated data file) are not marked.

``_load`` keeps a list ``wrote``: ``False`` once every rank passed the plan round (several ranks),
then the key of each entry it may have written into: those read in place into tensors the state
holds (:func:`in_place_entries`, before the reads), and each entry whose ``load_state_dict`` ran.
Every error of ``load`` that passed here carries ``partly_loaded`` (True or False) and
``touched_entries`` (those keys, sorted; None: not known, count every entry), alike on every
rank: with several ranks they are the union over the ranks, exchanged in the "loaded" round
(:func:`loaded_round`). After a failed load ``CheckpointManager.restore`` counts the tensors of the
touched entries (``inspect.touched_tensors``), which an older checkpoint must overwrite. Before,
with several ranks every error past the plan round was marked on every rank with every entry: a
missing data file (found before any read) made restore refuse to fall back to an older checkpoint
that lacked an entry of the state ("tensors [...] were partly read"), and so did an optimizer
added since the older save, whose fresh state no read can reach (tests/test_hunt49_loadmulti49.py).

Who calls: ``loader.load`` on every rank. One process: :func:`partly_read` with the entries this
process wrote into. Several: :func:`loaded_round`, the "loaded" round that follows the plan round.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import CheckpointError, CorruptCheckpointError, agree_load
from .stateful import OptimizerAdapter, RNGState

VERIFY_FIRST = "load a checkpoint that verifies before using it"  # tg.load names the run's earlier steps (srcnamed.advised)
PARTLY = (" The load had begun writing into the state (tensors are read in place, entries loaded in turn): "
          f"the state may hold part of the checkpoint's values; {VERIFY_FIRST}.")


def partly_read(e: BaseException, wrote: Iterable[Any] | None) -> BaseException:
    """``e`` (the same object, returned) with ``touched_entries``: the entry keys of ``wrote``
    (``False`` markers left out; None: unknown, every entry), merged with what ``e`` carries already,
    and ``partly_loaded``; :data:`PARTLY` added to its message when it is True."""
    if isinstance(e, CheckpointError):
        keys = None if wrote is None else {w for w in wrote if w is not False}
        had = getattr(e, "touched_entries", [])
        keys = None if keys is None or had is None else keys | set(had)
        e.touched_entries = None if keys is None else sorted(keys)  # type: ignore[attr-defined]
        e.partly_loaded = keys is None or bool(keys)  # type: ignore[attr-defined]
        if e.partly_loaded and e.args and isinstance(e.args[0], str) and PARTLY not in e.args[0]:
            end = "" if e.args[0].rstrip().endswith((".", "!", "?")) else "."  # "... is corrupt. The load ..."
            e.args = (e.args[0].rstrip() + end + PARTLY, *e.args[1:])
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


def in_place_entries(plans: list[tuple[Any, ...]], want: dict[str, Any]) -> list[str]:
    """``loader._load``, after the files were checked and before the reads: the keys of ``plans``
    (``(key, adapter, skeleton, dest, refs)``) that have a tensor of the state among the destinations
    read (``want``). Not a ``tg.RNGState``'s (read into its ``state_dict()``'s copies), nor an
    optimizer's without state (a fresh one: what it reads into is new, DTensor shards too)."""
    out = []
    for key, obj, _s, dest, refs in plans:
        if isinstance(obj, RNGState) or isinstance(obj, OptimizerAdapter) and not obj.optimizer.state:
            continue
        if any(dest.get(p) is not None and p in want for p in refs):
            out.append(key)
    return out


def loaded_round(ctx: Any, target: str, e: Exception | None, timeout: float | None, wrote: list[Any] | None = None) -> None:
    """``loader.load``'s "loaded" round (every rank, after the first round passed on every rank):
    ``errors.agree_load``, which also gathers each rank's ``wrote`` entries; its error marked by
    :func:`partly_read` with their union (every rank alike). When the exchange itself failed, the
    peers' writes are unknown: marked as having touched every entry."""
    try:
        agree_load(ctx, "loaded", target, e, timeout, touched=[w for w in wrote or () if w is not False])
    except CheckpointError as x:
        partly_read(x, getattr(x, "gathered_touched", None))
        raise


def skip_line(step: int, path: str, e: BaseException, limit: int = 500) -> str:
    """``CheckpointManager.restore`` (every rank), for a checkpoint it skipped: the line of ``restore: none
    of the N checkpoint(s) ... could be loaded`` that says why, naming the step and the directory once.
    :func:`in_checkpoint` made the message of a corrupt file ``<path>/data-00000.bin (checkpoint of step
    5): ...``: the line is ``step 5: <path>/data-00000.bin: ...`` (was ``step 5 (<path>): <path>/data-00000.bin
    (checkpoint of step 5): ...``); one that names the directory already, ``step 5: <message>``; any other,
    ``step 5 (<path>): <message>``. :data:`PARTLY` is left out: the summary's last line says it once."""
    msg = str(e).replace(PARTLY, "").replace(f" (checkpoint of step {step})", "", 1)
    shown = f"checkpoint {path} (step {step}): "
    if msg.startswith(shown):
        msg = msg[len(shown):]
    head = f"step {step}" if path.rstrip("/") + "/" in msg else f"step {step} ({path})"
    return f"{head}: {msg[:limit]}"
