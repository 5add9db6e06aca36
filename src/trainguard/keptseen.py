"""Which committed checkpoints retention looks at (``retention.retain``, rank 0, holding the run directory's lock).

``committed`` lists the run directory's step directories, trusting the names it saw holding a manifest at the last
retention (``commit.list_steps(known=...)``: no stat, on an object store no HEAD, per kept checkpoint per save).
``kept_gone`` is the check that trust needs before anything is deleted: a step kept in place of an older one must
still hold its manifest. Before, a kept checkpoint whose manifest went after a retention saw it (deleted by hand or
by another process's cleanup, a lifecycle rule) was counted as one of ``KeepLatest(n)``'s n, and the older good
one was deleted: KeepLatest(2) left one valid checkpoint (on object stores since store53, on local disk before).
``kept_damaged`` is the same look at the data files (a stat each, against the sizes the manifest records): a kept
checkpoint truncated, grown or missing a data file took a ``KeepLatest`` slot, and the older good one was deleted
(review56e: ``KeepLatest(2)`` with step 4's data file cut short deleted step 3 at the save of step 5).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from . import layout
from .commit import list_steps
from .errors import CheckpointError, NotACheckpointError
from .manifestfacts import read_sizes
from .policies import KeepAll, KeepBest, KeepEvery, KeepLatest, KeepUnion

if TYPE_CHECKING:
    from .manager import CheckpointManager

log = logging.getLogger("trainguard")


def committed(mgr: CheckpointManager) -> list[Any]:
    """``retain``: the run directory's committed checkpoints (``list_steps``), oldest first. A step directory's
    manifest is stat'ed the first time a retention lists it, not at each: ``mgr``'s ``_seen`` holds the names seen
    holding one (dropped once ``_delete`` removes one, when no longer listed, and by ``restore``). Before, every
    save stat'ed each kept checkpoint's: per save O(kept) (KeepAll, 500 kept: 532 os.stat calls a save, now 8).
    ``mgr._trusted``: the names listed as committed without a look this time (``kept_gone`` checks them)."""
    seen = mgr.__dict__.setdefault("_seen", set())
    steps = [s for s in list_steps(mgr.storage, mgr._root, known=seen) if s.status == "committed"]
    mgr._trusted = {s.name for s in steps} & seen  # type: ignore[attr-defined]
    seen.clear()
    seen.update(s.name for s in steps)
    return steps


def kept_gone(mgr: CheckpointManager, steps: list[Any], keep: set[int], newest: int) -> bool:
    """``retain``, before it deletes: whether a step it keeps (``keep``), listed as committed on trust
    (``committed``), no longer holds its manifest. Those are dropped from ``_seen``, so that ``retain``, run
    again, looks at them (listed "incomplete": no place among those kept). Only when a step is to be deleted, and
    only the kept steps that may stand in its place (``_stand_ins``): newer than the oldest step deleted, the
    steps a ``KeepBest`` picked (``metadata_picks``; a policy of the user's that reads metadata: any), and the
    newest kept one before ``newest`` (it is the "one before the newest" that ``retain`` keeps whatever the
    policy chose: an older KeepEvery multiple gone, the step it deleted was the only valid one before the newest;
    review54a). A stat (HEAD) each: KeepLatest(n) n-1, KeepEvery(k) one, KeepBest(n) about n, KeepAll
    none. A failed stat raises (``apply_retention``: nothing deleted)."""
    trusted, st = mgr.__dict__.get("_trusted", set()), mgr.storage
    gone = [s for s in _stand_ins(mgr, steps, keep, newest) if s.step != newest and s.name in trusted
            and not st.exists(st.join(s.path, layout.MANIFEST))]
    for s in gone:
        mgr._seen.discard(s.name)
    return bool(gone)


def _stand_ins(mgr: CheckpointManager, steps: list[Any], keep: set[int], newest: int) -> list[Any]:
    """The kept steps that stand in place of those ``retain`` deletes (none when it deletes none): newer than the
    oldest step deleted, the newest kept one before ``newest``, and those a policy that reads metadata chose
    (``metadata_picks``: a ``KeepBest``'s n; any kept step for a policy of the user's). Before, any kept step
    under a policy that reads metadata: ``KeepBest(..) | KeepEvery(k)`` stat'ed every KeepEvery multiple at each
    save (review58c: 1,000 saves with ``KeepEvery(5)``, 200 kept, 172 storage calls a save where the first took 25)."""
    doomed = [s.step for s in steps if s.step not in keep and s.step < newest]
    if not doomed:
        return []
    picks = mgr.__dict__.get("_picks")  # retention._plan's: None when any kept step may be one
    low = -1 if picks is None and (mgr.keep.reads_metadata or "_picks" in mgr.__dict__) else min(doomed)
    before = max((s.step for s in steps if s.step in keep and s.step < newest), default=None)
    return [s for s in steps if s.step in keep and (low < s.step or s.step in (before, newest) or s.step in (picks or ()))]


def metadata_picks(policy: Any, infos: list[Any]) -> set[int] | None:
    """``retention._plan``: the steps whose loss may change what ``policy`` keeps beyond what their steps alone
    decide (``_stand_ins``). A ``KeepBest`` picks its n best: a step it did not pick, gone, changes nothing it
    picks; the built-in policies of steps alone (``KeepLatest``, ``KeepEvery``, ``KeepAll``), none; a union, its
    policies'; any other policy (the user's own ``select``, whether it reads metadata or not): None, every kept step."""
    if not policy.reads_metadata:  # a user's policy of steps (KeepFirst) alone or in a union of such: None (review58j)
        return set() if _steps_alone(policy) else None
    if type(policy).select is KeepBest.select:
        return set(policy.select(infos))
    if type(policy).select is KeepUnion.select:
        return _member_picks(policy, infos)
    return None


def _member_picks(policy: Any, infos: list[Any]) -> set[int] | None:
    """``metadata_picks`` of one policy of a union that reads metadata. A policy of the user's that says it reads
    no metadata (``reads_metadata = False``, its own ``select``) may still keep a step because of the others (the
    oldest one): the step rule of ``_stand_ins`` (newer than the oldest deleted) is ``KeepLatest``'s, so None (every
    kept step, as before review58c). review58h: ``KeepLatest(2) | KeepBest(..) | KeepFirst()`` with the first
    step's manifest removed deleted the oldest valid step, which KeepFirst keeps in its place."""
    if type(policy).select is KeepUnion.select:  # KeepLatest(2) | KeepEvery(5) | KeepBest(..): a union in a union
        out: set[int] = set()
        for p in policy.policies:
            if (more := _member_picks(p, infos)) is None:
                return None
            out |= more
        return out
    if not policy.reads_metadata and type(policy).select not in _STEP_SELECTS:
        return None
    return metadata_picks(policy, infos)


_STEP_SELECTS = (KeepLatest.select, KeepEvery.select, KeepAll.select)  # policies of steps alone: their gone steps change nothing _stand_ins misses


def _steps_alone(policy: Any) -> bool:
    """``metadata_picks``: whether ``policy`` is a built-in policy of steps alone, or a union of such. Before
    (review58j), any policy that reads no metadata counted: ``KeepLatest(2) | KeepFirst()`` (a user's) with the first
    step's manifest removed by hand deleted the oldest valid step, which KeepFirst keeps in its place (review58h had
    fixed it only in a union that also reads metadata)."""
    if type(policy).select is KeepUnion.select:
        return all(_steps_alone(p) for p in policy.policies)
    return type(policy).select in _STEP_SELECTS


# The newest kept steps whose files' sizes ``kept_damaged`` holds on to, and the most stand-ins it looks at per save:
# a policy that reads metadata keeps every kept step a stand-in (KeepBest(2) | KeepEvery(2): 100 at step 200), and
# each save read the manifests of those past the 16 held (review56i: 35-60 a save, 4.3-4.6 s where it took 0.1 s).
SIZES_HELD = 16


def remember_files(mgr: CheckpointManager, m: Any) -> None:
    """Rank 0, at the commit of its save of ``m.step`` (``retention.committed_facts``): the sizes of the files its
    manifest ``m`` records, which ``kept_damaged`` compares with the files' (no manifest read for its own saves)."""
    mgr.__dict__.setdefault("_sizes", {})[m.step] = {**m.files, **{k: v[0] for k, v in m.indexes.items()}}


def kept_damaged(mgr: CheckpointManager, steps: list[Any], keep: set[int], newest: int) -> bool:
    """``retain``, rank 0, after ``kept_gone``, before it deletes, on a local run directory (an object store's object
    is whole or absent: a save's files there are not torn): whether a step that stands in place of one it deletes
    (``_stand_ins``, ``newest`` too) holds a data or index file that is missing or not the size its manifest records
    (cut short by a torn write the file system did not report, a copy or restore of the directory cut short, a file
    removed by hand), or a manifest that does not read (its checksum). Such a step goes into ``mgr._damaged`` (step:
    what is wrong; ``retention._plan`` then gives it no place among those kept, and keeps it while it is newer than
    the oldest step kept), with a warning and a ``retention_damaged`` event; ``restore`` would skip it. A stat per
    file of each step looked at, the ``SIZES_HELD`` newest stand-ins at most (KeepBest | KeepEvery keeps every kept
    step a stand-in: older ones are not looked at), their sizes the manager's own saves', else its manifest's, read
    once and held (before, review56i, read again at every save past the 16 newest kept); bytes are not
    read: a flipped bit is found by ``restore`` and ``trainguard verify`` only (docs/checkpoints.md, retention).
    A read or stat that fails (EIO, EACCES, ESTALE) tells nothing: the step counts as sound (a transient EIO
    made it damaged: deleted as such, or kept for good under KeepEvery; review56i)."""
    sizes, damaged = mgr.__dict__.setdefault("_sizes", {}), mgr.__dict__.setdefault("_damaged", {})
    ins = sorted((s for s in _stand_ins(mgr, steps, keep, newest) if s.step not in damaged), key=lambda s: -s.step)
    looked = ins[:SIZES_HELD]  # the newest (``newest``, the one before it first): their sizes are held, no manifest read
    for step in set(sizes) - set(sorted(keep)[-SIZES_HELD:]) - {s.step for s in looked}:  # not every kept step's
        del sizes[step]
    for step in set(damaged) - {s.step for s in steps}:  # no longer listed (removed by hand)
        del damaged[step]
    if not mgr.storage.atomic_rename:
        return False
    found = False
    for s in looked:
        if (why := _wrong_files(mgr, s, sizes)) is None:
            continue
        found, damaged[s.step] = True, why
        log.warning("trainguard: the checkpoint of step %d in %s is damaged (%s), and a restore would skip it: "
                    "retention does not count it among those it keeps, and keeps another in its place; `trainguard "
                    "verify %s` says what else is wrong", s.step, mgr.root, why, s.path)
        mgr.events.emit("retention_damaged", step=s.step, why=why)
    return found


def _wrong_files(mgr: CheckpointManager, s: Any, sizes: dict[int, dict[str, int]]) -> str | None:
    """``kept_damaged``: what is wrong with step ``s``'s files (missing, another size), or None."""
    st = mgr.storage
    if s.step not in sizes:
        try:
            sizes[s.step] = read_sizes(st, s.path)  # not each tensor validated
        except NotACheckpointError:  # its manifest went meanwhile: kept_gone's, at the next look
            return None
        except CheckpointError as e:
            return f"its manifest is corrupt: {e}"
        except OSError:  # an EIO may pass (a retry, another node's mount): kept as sound, never deleted on it
            return None
    files = sizes[s.step]
    if len(files) < MANY_FILES:
        return next((why for why in (_wrong_size(st, s.path, n, w) for n, w in files.items()) if why != ""), None)
    with ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="trainguard-retention-stat") as pool:  # a round trip each
        return next((why for why in pool.map(lambda f: _wrong_size(st, s.path, *f), files.items()) if why != ""), None)


MANY_FILES, STAT_THREADS = 32, 16  # a checkpoint of MANY_FILES files or more (one a rank) is stat'ed 16 at once (NFS)


def _wrong_size(st: Any, directory: str, name: str, want: int) -> str | None:
    """``_wrong_files``: what is wrong with one file, "" when nothing is, None when the stat tells nothing (EACCES)."""
    try:
        have = st.size(st.join(directory, name))
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError:  # EIO, EACCES, ESTALE: tells nothing for sure; a transient one kept a step for good (review56i)
        return None
    return f"{name} holds {have:,} bytes where its manifest says {want:,}" if have != want else ""
