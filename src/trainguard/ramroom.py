"""Room in the RAM tier (``tiers.RamTier``): whether a save fits there, else it goes straight to
the run directory.

Called by ``RamTier.target`` on every rank before each save (rank 0 makes room and decides, every
rank gets its decision, or rank 0's error, through one broadcast, so that all ranks write the same
checkpoint), and by
``RamTier.no_room`` when a save into RAM failed. Before, a RAM tier smaller than one
checkpoint (a small ``--shm-size``, a ``/dev/shm`` filled by NCCL or DataLoader workers) failed
every save with ENOSPC: with ``on_error="warn"`` the run trained on with no checkpoint on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from . import layout, memroom
from .commit import list_steps
from .errors import CheckpointError
from .iostall import StuckWriteError
from .ramleft import adopt_legacy, read_id
from .ramsize import estimated

log = logging.getLogger("trainguard")

SLACK = 256 << 10  # manifest, index files, block rounding beyond the data's bytes
COPYING: weakref.WeakSet[Any] = weakref.WeakSet()  # RAM tiers that started a copy to disk (drain_copies)


def room_needed(need: int | None, short: int) -> int:
    """Free bytes the RAM tier must have for the next save: the last checkpoint's ``need`` (bytes)
    with a margin, and more than ``short`` (the free space a save into RAM ran out of)."""
    return max(need + need // 100 + SLACK if need else 0, short + 1 if short else 0)


def goes_durable(tier: Any, step: int, timeout: float | None, state: Mapping[str, Any] | None = None) -> bool:
    """Every rank, in ``RamTier.target``: whether the save of ``step`` skips the RAM tier. Rank 0
    waits for the previous copy to disk and makes room (``RamTier.make_room``), compares the RAM
    directory's free space with ``room_needed`` and says so (event ``ram_no_room`` each time, a
    warning when the previous save went to RAM); the other ranks receive its answer. When rank 0
    fails there (an OSError removing a copy), it sends its error instead of the answer, in the
    same round: every rank raises a ``CheckpointError`` naming it (the manager reports it per
    ``on_error``). Before, rank 0 raised the bare error and the others waited in the round. So does
    the previous copy's failure with ``on_error="raise"`` (``_copy_failed``), in its own words.
    ``state``: the state being saved; rank 0 takes the larger of the last checkpoint's size and
    :func:`.ramsize.estimate` of it (before a run's first save, the estimate alone). Before, the estimate was
    taken before the first save only: a state that grew since (an optimizer added after the first
    save, Adam's moments created by the first step) was written into a RAM tier without room for
    it, and an async save then failed with ENOSPC (raised at the next call) instead of going to the
    run directory."""
    durable: bool | dict[str, Any] = False
    err: Exception | None = None
    failed: CheckpointError | None = None
    if tier.ctx.rank == 0:
        try:
            tier.wait()
            if (failed := _copy_failed(tier)) is not None:
                raise failed
            tier.make_room()
            if state is not None:  # the state may have grown since the last checkpoint (an optimizer added)
                tier.need = max(tier.need or 0, estimated(tier, state))  # the real size replaces it at the next commit
            durable = _decide(tier, step)
        except Exception as e:  # any of rank 0's: every rank fails this save with it (a stuck copy as one: iostall)
            err, durable = e, {"error": f"{type(e).__name__}: {e}", "stuck": isinstance(e, StuckWriteError)}
            durable["copy"] = str(e) if e is failed else ""
    if tier.ctx.is_distributed:
        durable = tier.ctx.broadcast("ram_room", durable, timeout=timeout)
    if isinstance(durable, dict) and durable.get("copy"):  # rank 0's copy of the previous save to disk failed
        raise CheckpointError(f"RAM tier: {durable['copy']}; the save of {layout.step_dir(step)} was not made. Make room "
                              f"in the run directory {tier.durable_root} (or fix what failed): a restart on this node "
                              "resumes from the RAM tier's copy and copies it again. With on_error='warn' the run "
                              "goes on saving into RAM only, warned at each failed copy") from err
    if isinstance(durable, dict):
        raise (StuckWriteError if durable.get("stuck") else CheckpointError)(
            f"RAM tier: rank 0 could not prepare the save of {layout.step_dir(step)} in {tier.dir}: {durable['error']}"
        ) from err
    return bool(durable)


def _copy_failed(tier: Any) -> CheckpointError | None:
    """``goes_durable``, rank 0, once the previous copy to disk ended: with ``on_error="raise"``, its failure, as
    this save's error on every rank (then forgotten: ``RamTier.close`` does not raise it again). Before, it was
    only logged until ``close()``: a run directory out of space had every later copy fail while each ``save()``
    returned, and the run went on for good with no checkpoint on disk (the RAM tier held the newest only)."""
    e, step = tier._error, tier._failed_step
    if e is None or tier.on_error != "raise" or not isinstance(e, Exception):
        return None
    tier._error = None
    return CheckpointError(f"copying {layout.step_dir(step)} to {tier.durable_root} failed: {type(e).__name__}: {e}")


def _decide(tier: Any, step: int) -> bool:
    """Rank 0, ``goes_durable``: whether the RAM tier lacks room for ``step`` (or it is the retry of a save that ran out)."""
    try:
        free = shutil.disk_usage(tier.dir).free
    except OSError as e:  # cannot tell: the save tries RAM, as before
        log.warning("trainguard: cannot read the free space of the RAM tier %s: %s", tier.dir, e)
        free = None
    want = room_needed(tier.need, tier._short)
    free, memory = _in_memory(tier, free, want)
    tier._free = free
    durable = (free is not None and want > free) or tier._force == step  # the retry of a save that ran out
    if durable and tier._bypass is None:  # _bypass: still the previous save's
        log.warning("trainguard: the RAM tier %s has %d bytes free%s, a checkpoint needs about %d: %s is saved "
                    "straight to %s, and so are the next saves until it has room", tier.dir, free, memory, want,
                    layout.step_dir(step), tier.durable_root)
    if durable:
        tier.events.emit("ram_no_room", step=step, free=free, need=want)
    return durable


def _in_memory(tier: Any, free: int | None, want: int) -> tuple[int | None, str]:
    """``_decide``: the RAM directory's ``free`` bytes, or less when the memory this job can still use
    (``memroom.room``: MemAvailable, the memory cgroup's limit) is less, and the words saying so:
    tmpfs pages are charged to the cgroup, and a copy past its limit had the OOM killer end the job.
    Rank 0's node stands for every node; each holds its ranks' share (``LOCAL_WORLD_SIZE`` of
    ``world_size``): the room is scaled to bytes of the whole checkpoint."""
    room = memroom.room()
    if room is None:
        return free, ""
    world = max(tier.ctx.world_size, 1)
    local = min(memroom.local_ranks(), world)
    room = max(room - _staging_growth(tier, want * local // world, local), 0)
    whole = room * world // local  # this node's room, in bytes of the whole checkpoint
    if whole < want and (free is None or whole < free):
        return whole, (" in the memory this job can still use (host MemAvailable and memory cgroup limits, less "
                       "the training step's own peak and an async save's staging buffers; tmpfs pages count "
                       "against them)")
    return free, ""


def _staging_growth(tier: Any, share: int, local: int) -> int:
    """``_in_memory``: what the staging pools of an async save (one per rank of the node) still take from the
    same memory before its RAM copy is written (0 for a sync save, or once the pools hold the state): each
    rank stages about its part of the node's ``share``, up to ``max_staging_bytes``. Before, each fit alone,
    both did not, and the OOM killer ended the job during the first async save into the RAM tier."""
    async_save, cap = getattr(tier, "staging", (False, None))
    if not async_save:
        return 0
    from .stage import pool_capacity  # torch: imported by the save anyway

    per_rank = share // local if cap is None else min(share // local, cap)
    return max(per_rank - pool_capacity(cap), 0) * local


def drop_others(tier: Any, step: int) -> None:
    """``RamTier.committed`` (rank 0), once ``step`` committed in the RAM tier (or in the run directory,
    past it): every other RAM copy is removed. One that cannot be (an OSError: EACCES, EBUSY) stays, with
    a warning and the event ``ram_remove_failed``; the next commit tries again. Before, the error left
    ``committed`` before the copy of ``step`` to disk started (after an async save: logged, and its second
    call did nothing; a sync save raised a bare OSError, whatever ``on_error``): ``step`` was only in RAM,
    and a clean ``close()`` removed the RAM tier with it."""
    for s in list_steps(tier.storage, tier.dir):
        if s.step != step:
            drop_copy(tier, s.path)


def drop_copy(tier: Any, path: str) -> None:
    """Remove the RAM copy ``path`` of ``tier`` (rank 0): ``drop_others``, and ``RamTier.candidates``
    and ``restored`` for a copy that ``restore`` must not use (stale, or found unusable). An OSError
    leaves it there, with a warning and the event ``ram_remove_failed`` (a later commit removes it):
    ``candidates`` leaves it out all the same. Before, a stale copy that could not be removed failed
    the ``restore`` with a bare OSError on rank 0 (the other ranks waited in its broadcast), though
    the run directory held usable checkpoints."""
    try:
        tier.storage.remove_tree(path)
    except OSError as e:
        log.warning("trainguard: could not remove %s from the RAM tier (kept): %s", path, e)
        tier.events.emit("ram_remove_failed", step=layout.parse_step(os.path.basename(path)), error=str(e)[:2000])


def forget_after(tier: Any, step: int) -> None:
    """``RamTier.restored`` (rank 0), once ``restore`` returned ``step``: the tier's memory of the steps
    after it is of the timeline that restore went back behind (a rollback). Its RAM copies newer than
    ``step`` become ``_passed`` (``make_room`` may drop them); ``_committed`` and a ``persisted`` newer
    than ``step`` are forgotten: a save of such a step again is a new checkpoint. Before, ``committed``
    took that save for an async save's second call and never copied it to disk (a clean ``close`` then
    lost it), and ``make_room`` took it for the copy on disk and dropped it when its copy failed."""
    tier._passed = {s.step for s in list_steps(tier.storage, tier.dir) if s.step > step}
    tier._committed = None
    if tier.persisted is not None and tier.persisted > step:
        tier.persisted = None


def ran_out(e: BaseException, ram: str) -> bool:
    """``RamTier.no_room`` (every rank): whether the save error ``e`` (any rank's: a ``RankFailureError`` carries
    each failed rank's traceback as text) is a lack of room in the RAM directory ``ram``."""
    texts = [str(e)] + [str(t) for t in getattr(e, "failures", {}).values()]
    return any(ram in t and "no space left" in t.lower() for t in texts)


def opened(tier: Any, timeout: float | None) -> None:
    """``RamTier.open``, every rank after the check that all share one node: rank 0 prepares the RAM
    directory (``RamTier.prepare``: creates it, cleans crashed RAM saves, discards the copies of a run
    directory deleted since; :func:`left_behind`) and sends its error, if any, to the others; every rank then raises a
    ``CheckpointError`` naming it. Before, rank 0 raised the bare OSError (EACCES removing a stale copy)
    and the other ranks went on to wait for it in the manager's next round."""
    err, cause = None, None
    if tier.ctx.rank == 0:
        try:
            private_dir(os.path.dirname(tier.dir))
            try:  # before prepare: a run upgraded from before 2026-12-04 (ramleft.py); best effort
                adopt_legacy(tier)
            except OSError as e:  # an unreadable older directory: the open goes on without it, as before
                log.warning("trainguard: cannot look at an older RAM directory of %s: %s", tier.durable_root, e)
            tier.prepare()
            left_behind(tier)
            check_medium(tier.dir, tier.durable_root)
        except Exception as e:  # OSError, a store's error reading the run directory's id
            err, cause = f"{type(e).__name__}: {e}", e
            if isinstance(e, Warning):  # check_medium's, an error by a warnings filter (-W error): nothing to remove
                err = f"{WARNING_AS_ERROR}{e} (a warning, made an error by the warnings filter)"
    if tier.ctx.is_distributed:
        err = tier.ctx.broadcast("ram_open", err, timeout=timeout)
    if err and err.startswith(WARNING_AS_ERROR):
        raise CheckpointError(f"RAM tier: {err[len(WARNING_AS_ERROR):]}") from cause
    if err:
        raise CheckpointError(
            f"RAM tier: rank 0 could not prepare {tier.dir}: {err}. Remove that directory by hand if it holds no "
            "copy you need (`trainguard ls RUN` on this node lists them), or pass another ram_tier=..."
        ) from cause


def left_behind(tier: Any) -> None:
    """``opened``, rank 0, once ``RamTier.prepare`` wrote the run's id into the RAM directory: log
    the other RAM directories of this user that hold checkpoints of the same run (the same id), with the
    event ``ram_left_behind``. The RAM directory is named by the run directory's real path: a run moved
    (``mv run run2``) and resumed from its new path left its RAM copies under the old name, holding
    memory until the node restarts, and nothing said so. They are not removed: a copy of the run
    directory (``cp -r``, which copies the id) may be a live job of this node. One listing of the
    user's RAM directories per open."""
    from .tiers import RUN_ID, _tree_bytes

    def run_id(d: str) -> bytes | None:
        try:
            return read_id(os.path.join(d, RUN_ID))
        except OSError:  # unreadable: passed over
            return None

    base, mine = os.path.dirname(tier.dir), run_id(tier.dir)
    try:
        others = sorted(e.path for e in os.scandir(base) if e.is_dir(follow_symlinks=False) and e.path != tier.dir)
    except OSError:
        return
    def size(path: str) -> int:  # gone since the listing (a live copy's retention), a dangling link: 0
        try:
            return _tree_bytes(path)
        except OSError:
            return 0

    for d in others:
        try:  # a log line: what cannot be read here does not fail the open (it raised out of it before)
            if mine is None or run_id(d) != mine or not (steps := list_steps(tier.storage, d)):
                continue
        except OSError:
            continue
        mb = sum(size(s.path) for s in steps) / 1e6
        log.warning("trainguard: %s also holds RAM copies of this run (%s, %.0f MB of memory), saved under the run "
                    "directory's earlier path (moved, or copied with its %s); they are not used. If no job of this "
                    "node runs from that path, remove them: rm -rf %s", d, ", ".join(s.name for s in steps), mb, RUN_ID, d)
        tier.events.emit("ram_left_behind", path=d, steps=[s.step for s in steps], mb=round(mb, 1))


WARNING_AS_ERROR = "warning:"  # opened: check_medium's warning raised as an error, sent to the other ranks


def check_medium(ram: str, durable_root: str) -> None:
    """``opened``, rank 0, once the RAM directory ``ram`` exists: warn when it is not on tmpfs (before,
    any directory was taken without a word). On a disk, every save is written to disk twice (the
    "RAM" copy and the run directory's); on ramfs, which reports 0 bytes free, ``ramroom`` sends every
    save straight to the run directory, so the RAM tier does nothing. An unreadable
    ``/proc/self/mountinfo``: no word."""
    from .doctor import filesystem_of, parse_mountinfo  # here: doctor imports half the library

    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            fs = filesystem_of(os.path.realpath(ram), parse_mountinfo(f.read()))
    except OSError:
        return
    if fs in (None, "tmpfs"):
        return
    from .userframe import user_stacklevel

    why = ("ramfs reports 0 bytes free, so every save would go straight to the run directory " + durable_root
           if fs == "ramfs" else "its copies are written to that filesystem, not to memory, besides the run directory's")
    warnings.warn(f"ram_tier: {ram} is on {fs}, not tmpfs: {why}. Pass ram_tier=True (/dev/shm) or a directory on "
                  "a tmpfs", stacklevel=user_stacklevel())


def private_dir(path: str) -> None:
    """``opened``, rank 0, before ``RamTier.prepare``: the per-user directory ``trainguard-ram-<uid>``
    under the RAM tier's base, created private (0700), refused (a ``CheckpointError``) when it is not a
    directory of this user's, and made private when it is (one made by an earlier version: 0755). The
    base (``/dev/shm``) is writable by every user and the name is known in advance: another local user
    could create it first, read this job's checkpoints and put a step of theirs there, which ``restore``
    preferred and copied into the run directory; with the default umask every user could read them."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else (
            "is not a directory" if not stat.S_ISDIR(st.st_mode) else f"is owned by uid {st.st_uid}")
        raise CheckpointError(
            f"{path} {what}, not a directory of this user (uid {os.getuid()}): another user may have made it to "
            "read or replace this job's RAM copies, so it is not used; remove it (as its owner or root)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def discard_stale(storage: Any, ram: str) -> None:
    """``RamTier._check_run``, rank 0 at open: remove the RAM copies in ``ram`` of a run directory deleted
    since (another run id). A copy whose manifest stays (its removal refused: EACCES, EIO; the storage's
    ``remove_tree`` warns and goes on) raises a ``CheckpointError`` naming it, so that the open fails
    before the RAM tier takes the new run's id: before, the copy was adopted with it, and the new run's
    ``restore`` loaded the deleted run's checkpoint (one that never reached disk) and copied it into the
    new run directory."""
    for s in list_steps(storage, ram):
        storage.remove_tree(s.path)
    left = [s.name for s in list_steps(storage, ram) if s.status == "committed"]
    if left:
        raise CheckpointError(
            f"{ram} holds {left} of a run directory deleted since (another run id), and they could not be removed: "
            "a restore of this run would load them")


def remove_tier(tier: Any) -> None:
    """``RamTier.close(clean=True)``, rank 0, once its last copy reached the run directory: remove the RAM
    tier. One that cannot be removed (EACCES, EBUSY) stays, with a warning that says where and the event
    ``ram_remove_failed``: the job ended well and its checkpoints are on disk. Before, ``close()`` raised the
    bare OSError. Each step directory goes first, by ``remove_tree`` (its manifest before its data): one
    ``rmtree`` of the tier removed a step's data file before its manifest, and a kill in between left a
    manifest alone in RAM that the next open's restore tried as a checkpoint (review57b)."""
    try:
        with contextlib.suppress(FileNotFoundError):  # removed by hand already: nothing to do
            for s in list_steps(tier.storage, tier.dir):
                tier.storage.remove_tree(s.path)
        tier.storage.remove_tree(tier.dir)
    except OSError as e:
        log.warning("trainguard: could not remove the RAM tier %s (it holds memory until removed: rm -rf it): %s",
                    tier.dir, e)
        tier.events.emit("ram_remove_failed", step=None, error=str(e)[:2000])
        return
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(tier.dir))  # the per-user dir, if no other run uses it


def drain_copies() -> None:
    """At interpreter exit (``exitdrain``, after the async save in flight, whose commit may start one):
    wait for each RAM tier's copy to disk still running, bounded by its manager's timeout. A job that
    ended without ``close()`` left its last checkpoint in RAM only (the copy's thread is a daemon): a
    restart on another node started over. Its error, if any, is printed (logging may be torn down)."""
    for tier in list(COPYING):
        t = tier._thread
        if t is None or not t.is_alive():
            continue
        print(f"trainguard: the interpreter is exiting; waiting for the RAM tier's copy of step {tier._committed} "
              f"to {tier.durable_root}", file=sys.stderr)
        try:
            tier.wait()
        except Exception as e:  # stuck for the timeout: the exit goes on (the thread is a daemon)
            print(f"trainguard: the RAM tier's copy of step {tier._committed} did not finish: {e}", file=sys.stderr)
            continue
        if tier._error is not None:
            print(f"trainguard: the RAM tier's copy of step {tier._committed} failed: {tier._error}", file=sys.stderr)
