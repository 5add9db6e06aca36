"""Checkpoint tiers for ``CheckpointManager``: the optional RAM tier in host shared memory.

With ``CheckpointManager(root, ram_tier=True)`` every save goes first to
``/dev/shm/trainguard-ram-<uid>/<hash of root>/step-N`` (a normal trainguard checkpoint on
tmpfs, no disk involved), and rank 0 then copies it to the durable tier (``root``) in
a background thread: data files first, ``manifest.json`` last, in a temp directory renamed
into place (object stores: in place, the manifest is the marker). The RAM tier survives a
worker process crash (torchrun restarts workers on the same node), so ``restore`` prefers
it: for each step, newest first, the RAM copy, then the durable copy.

Bounded: the RAM tier keeps only the newest checkpoint (two while the next one is being
written). Cleaned by a clean ``close()`` (no exception, no preemption signal): the job ended.
All ranks must be on one node (the RAM tier is node-local); checked at ``open``.

Call order (every rank, the manager does it): ``open`` -> (``target`` -> save ->
``committed``)* -> ``close``; ``candidates`` during ``restore``. Rank 0 alone persists,
deletes and lists; the others only write their own data files into the RAM directory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from . import iostall, layout, ramroom
from .commit import check_owned, clean_debris, list_steps
from .commitfail import discard_copy
from .distwait import default_timeout
from .errors import CheckpointError, StepExistsError
from .faults import fault
from .io import open_writer, reserve
from .manifest import MAX_MANIFEST_BYTES, parse
from .ramleft import run_id, unclaimed
from .ramroom import COPYING, drop_copy, drop_others, forget_after, goes_durable, opened, ran_out, remove_tier
from .ramview import DEFAULT_BASE, ON_DISK, RUN_ID, on_disk_mark, ram_copies, ram_dir, stale_reason  # noqa: F401  (imported from here)
from .storage import LocalStorage, Storage, location
from .streamjobs import run_parallel

log = logging.getLogger("trainguard")

PIECE = 64 << 20


class RamTier:
    """The RAM tier of one manager. ``spec`` is ``True`` (``/dev/shm``) or a base directory."""

    def __init__(self, spec: bool | str | os.PathLike[str], *, root: str, durable: Storage, durable_root: str, ctx: Any, events: Any, staging: tuple[bool, int | None] = (False, None), on_error: str = "raise") -> None:
        base = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else DEFAULT_BASE  # True, 1, np.True_
        if not os.path.isdir(base):
            raise CheckpointError(f"ram_tier: {base} is not a directory; pass ram_tier=True (/dev/shm) or an existing tmpfs dir")
        self.storage = LocalStorage()
        self.dir = ram_dir(location(durable, durable_root), base)  # one spelling per run: file://, "run/", ...
        self.durable, self.durable_root = durable, durable_root
        self.ctx, self.events = ctx, events
        self.staging = staging  # the manager's (async_save, max_staging_bytes): its pools grow from the memory a RAM copy takes (ramroom._in_memory)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed_step: int | None = None  # the step whose copy _error is of
        self.on_error = on_error  # the manager's: "raise" raises a failed copy at the next save (ramroom.goes_durable)
        self.timeout: float | None = None  # the manager's (open): also wait()'s bound for a copy stuck in a write
        self.persisted: int | None = None
        self._committed: int | None = None  # the step committed() last started to persist
        self._passed: set[int] = set()  # RAM copies newer than the step restore() returned: not needed
        # Room (ramroom.py): the last checkpoint's bytes, the free space a save into RAM ran out of, the free
        # space before this save, the step target() sent straight to the run directory.
        self.need: int | None = None
        self._short, self._free = 0, None  # int, int | None
        self._bypass: int | None = None
        self._force: int | None = None  # the step no_room() sends to the run directory whatever the free space

    # --------------------------------------------------------------- lifecycle
    def open(self, timeout: float | None = None) -> None:
        """Every rank: check that all ranks share this node (within the manager's ``timeout``);
        rank 0 cleans crashed RAM saves."""
        self.timeout = timeout
        if self.ctx.is_distributed:
            hosts = self.ctx.all_gather("ram_host", socket.gethostname(), timeout=timeout)
            if len(set(hosts)) > 1:
                raise CheckpointError(
                    f"ram_tier needs every rank on one node (ranks run on {sorted(set(hosts))}); "
                    "drop ram_tier=... for multi-node jobs"
                )
        opened(self, timeout)

    def prepare(self) -> None:
        """``ramroom.opened``, rank 0: create the RAM directory, clean crashed RAM saves, check the run."""
        os.makedirs(self.dir, exist_ok=True)
        clean_debris(self.storage, self.dir)
        self._check_run()

    def _check_run(self) -> None:
        """Rank 0, at open: the RAM tier belongs to this run directory, not to one deleted since
        (a user who removed the run to start over must not get its old RAM copy back). Both
        hold the same random id: the durable root's ``RUN_ID`` file, written at the first open."""
        d, marker = self.durable, self.durable.join(self.durable_root, RUN_ID)
        fresh = not d.exists(marker)  # a new run directory (or one of a trainguard before run ids, 2026-12-01)
        rid = uuid.uuid4().hex if fresh else d.read_bytes(marker, 64).decode(errors="replace")
        if fresh:
            d.write_atomic(marker, rid.encode())
        own = os.path.join(self.dir, RUN_ID)
        mine = run_id(own)  # None: no id, a RAM tier new or written before run ids (ramleft.unclaimed)
        if mine != rid and (mine is not None or (fresh and unclaimed(self.storage, self.dir, d, self.durable_root))):
            stale = [s.name for s in list_steps(self.storage, self.dir)]
            if stale:
                log.warning("trainguard: the RAM tier %s held %s of a run directory since deleted: discarded", self.dir, stale)
                self.events.emit("ram_discard", steps=stale)
            ramroom.discard_stale(self.storage, self.dir)  # raises when one stays: it would be this run's from now on
        if mine != rid:
            self.storage.write_atomic(own, rid.encode())

    def make_room(self) -> None:
        """Rank 0, before a save into RAM: a RAM tier too small for two checkpoints drops the
        copies it no longer needs first (else every later save fails for want of room): the one
        copied to disk, and those ``restored`` went back behind (a rollback's abandoned step, a
        RAM-only copy that failed to load). Before, only the copy this process had copied to
        disk counted: after a restart whose ``restore`` did not load the RAM copy, that copy
        stayed, and every save of the run failed with ENOSPC."""
        steps = list_steps(self.storage, self.dir)
        done = [s for s in steps if s.step == self.persisted or s.step in self._passed]
        need = sum(_tree_bytes(s.path) for s in steps)
        if done and shutil.disk_usage(self.dir).free < need * 1.05 + (16 << 20):
            for s in done:
                self.storage.remove_tree(s.path)
            self.events.emit("ram_make_room", removed=[s.name for s in done])

    def close(self, *, clean: bool) -> None:
        """Rank 0: wait for the persist in flight (raise its error); with ``clean`` (the job
        ended normally) remove the RAM tier."""
        if self.ctx.rank != 0:
            return
        self.wait()
        err, self._error = self._error, None
        if clean and err is None:
            remove_tier(self)
        if err is not None:
            raise CheckpointError(f"RAM tier: copying to {self.durable_root} failed: {err}") from err

    # --------------------------------------------------------------- save
    def target(self, step: int, timeout: float | None = None, state: Any = None) -> tuple[Storage, str]:
        """Every rank, before a save: where it goes. Rank 0 first waits for the previous persist
        (one in flight; the wait counts as stall) and makes room (``ramroom.goes_durable``, agreed
        by every rank within ``timeout``, rank 0's error raised on every rank). Straight to the run
        directory when the RAM tier has no room for it."""
        self._bypass = step if goes_durable(self, step, timeout, state) else None  # state: the first save's size
        if self._bypass is not None:
            return self.durable, self.durable.join(self.durable_root, layout.step_dir(step))
        return self.storage, os.path.join(self.dir, layout.step_dir(step))

    def no_room(self, step: int | None, e: BaseException) -> bool:
        """Every rank, when the manager's save of ``step`` failed with ``e`` (the same on every rank:
        the commit round's outcome): whether it was a save into RAM that ran out of room there (on
        any rank). Rank 0 then sends this step's retry (a sync save, ``CheckpointManager._save_now``)
        and the next saves to the run directory until the RAM tier has more room than it had then."""
        if step is None or step == self._bypass or not ran_out(e, self.dir):
            return False
        if self.ctx.rank == 0:
            self._short, self._force = max(self._short, self._free or 0), step
        return True

    def preflight(self, step: int, bad: Exception | None) -> Exception | None:
        """Every rank, when the manager starts a save of ``step`` into RAM (after it removed a
        durable copy it replaces): the error to raise in the save's first round, ``bad`` (the
        caller's) first. On rank 0, a ``StepExistsError`` when the durable tier already holds a
        committed ``step``: ``persist`` would find it there and skip the copy, so the new save
        would never reach disk (the same refusal as a save without the RAM tier)."""
        if bad is not None or self.ctx.rank != 0 or self._bypass == step:  # bypass: the save itself checks
            return bad
        final = self.durable.join(self.durable_root, layout.step_dir(step))
        try:  # an error of the stat (EIO, EACCES) fails this save on every rank, not rank 0 alone and bare
            there = self.durable.exists(self.durable.join(final, layout.MANIFEST))
        except OSError as e:
            return CheckpointError(f"cannot look into {location(self.durable, final)}: {e}")
        if there:
            return StepExistsError(f"{location(self.durable, final)} already holds a committed checkpoint")
        return None

    def committed(self, step: int, on_durable: Callable[[int], None], nbytes: int | None = None) -> None:
        """Rank 0, after ``step`` (``nbytes`` of data) committed in RAM: drop older RAM copies, then
        copy ``step`` to the durable tier in the background and call ``on_durable(step)`` (retention)
        after. Committed in the run directory (``target`` found no room): retention at once.
        An async save calls it from its thread at the commit and the manager again when it
        collects the save: the second call does nothing."""
        if self.ctx.rank != 0 or self._committed == step:
            return
        self._committed, self._passed = step, set()  # the older RAM copies go now (not failing this copy)
        drop_others(self, step)
        if self._bypass == step:  # on disk already; the next save tries RAM again if it has room
            self.need = nbytes if nbytes is not None else self.need
            on_durable(step)
            return
        self.need, self._short = _tree_bytes(os.path.join(self.dir, layout.step_dir(step))), 0
        self._start(step, on_durable)

    def _start(self, step: int, on_durable: Callable[[int], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                t0 = time.monotonic()
                if self.persist(step):
                    self.events.emit("ram_persist", step=step, seconds=round(time.monotonic() - t0, 6))
                self.persisted = step
                self._mark_on_disk(step)
                on_durable(step)
            except BaseException as e:  # surfaced at close(); the next save retries with a newer step
                log.warning("trainguard: copying step %d from the RAM tier to %s failed: %s", step, self.durable_root, e)
                self.events.emit("ram_persist_failed", step=step, error=str(e)[:2000])
                self._error, self._failed_step = e, step

        self._error = None
        self._thread = threading.Thread(target=run, name="trainguard-ram-persist", daemon=True)
        COPYING.add(self)  # the interpreter's exit waits for the copy (exitdrain.py)
        self._thread.start()

    def wait(self) -> None:
        t = self._thread
        if t is not None:  # bounded: a write to the run directory stuck for the timeout raises StuckWriteError
            iostall.join_bounded(t, self.timeout or default_timeout(),
                                 f"copying step {self._committed} from the RAM tier to {self.durable_root}")
            self._thread = None

    def persist(self, step: int) -> bool:
        """Copy RAM step ``step`` to the durable tier, manifest last. False if already there."""
        d, root, name = iostall.watched(self.durable), self.durable_root, layout.step_dir(step)
        src = os.path.join(self.dir, name)
        final = d.join(root, name)
        if d.exists(d.join(final, layout.MANIFEST)):
            return False
        raw = self.storage.read_bytes(os.path.join(src, layout.MANIFEST), MAX_MANIFEST_BYTES)
        manifest = parse(raw, where=f"{src}/{layout.MANIFEST}")
        work = d.join(root, layout.tmp_dir(name, uuid.uuid4().hex[:16])) if d.atomic_rename else final
        d.makedirs(work)
        try:  # the fault point inside: a drill's raise here is cleaned up like a failed copy
            fault("before_persist", 0)
            for fname, size in {**manifest.files, **{k: v[0] for k, v in manifest.indexes.items()}}.items():
                _copy(os.path.join(src, fname), d, d.join(work, fname), size)
            # Invariant: the manifest is copied only after every data file is durable.
            check_owned(root)  # the run directory's lock lost since the save (runlock.py): no commit
            d.write_atomic(d.join(work, layout.MANIFEST), raw)
            if d.atomic_rename:
                d.fsync_dir(work)
                d.rename_dir(work, final)
        except BaseException as e:  # a lost run lock (an rm -rf mid-copy: ENOENT) is raised in its place
            discard_copy(d, work, root, e)
        return True

    # --------------------------------------------------------------- restore
    def candidates(self, durable_steps: list[int]) -> list[tuple[int, str, str]]:
        """Rank 0: ``(step, path, tier)`` to try, newest step first, RAM copy before durable.
        A RAM copy the run directory no longer stands behind is discarded first (``_stale``)."""
        durable = set(durable_steps)  # not the list: a look-up per step made this O(steps**2)
        ram = {s.step: s.path for s in list_steps(self.storage, self.dir) if s.status == "committed"}
        for step in [s for s in ram if self._stale(s, ram[s], s in durable)]:
            drop_copy(self, ram.pop(step))  # not offered, whether or not it could be removed
        out = []
        for step in sorted(set(ram) | durable, reverse=True):
            if step in ram:
                out.append((step, ram[step], "ram"))
            if step in durable:
                out.append((step, location(self.durable, self.durable.join(self.durable_root, layout.step_dir(step))), "durable"))
        return out

    def _stale(self, step: int, path: str, on_disk: bool) -> bool:
        """``candidates``: ``stale_reason`` of the RAM copy of ``step``, logged and emitted."""
        why = stale_reason(self.dir, self.durable, self.durable_root, step, on_disk)
        if why:
            log.warning("trainguard: the RAM tier's copy of %s is discarded: %s", layout.step_dir(step), why)
            self.events.emit("ram_discard", steps=[layout.step_dir(step)], reason=why)
        return bool(why)

    def _mark_on_disk(self, step: int) -> None:
        """The persist thread, once ``step`` is on disk: record it in ``ON_DISK`` (best effort:
        without it a RAM copy removed from disk later is still restored, as before)."""
        try:
            self.storage.write_atomic(os.path.join(self.dir, ON_DISK), on_disk_mark(self.dir, step))
        except (OSError, CheckpointError) as e:
            log.warning("trainguard: could not record in the RAM tier that step %d is on disk: %s", step, e)

    def restored(self, step: int, tier: str, on_durable: Callable[[int], None], nbytes: int | None = None) -> None:
        """Every rank, at the end of ``CheckpointManager.restore``; rank 0 acts. From the RAM tier: that
        step reaches the durable tier. From the durable tier: the RAM copy of that step, tried first, was
        unusable; it is removed. RAM copies of newer steps (unusable, or behind a rollback) stay until the
        next save commits (``make_room`` may drop them). What the tier remembers of the steps after
        ``step`` is forgotten (``ramroom.forget_after``): a rollback saves them again."""
        if self.ctx.rank != 0:
            return
        self.need = nbytes if nbytes is not None else self.need  # the size the next save's room is checked against
        forget_after(self, step)  # its _passed: the RAM copies newer than step, which make_room may drop
        if tier == "ram":
            self._start(step, on_durable)
            return
        self.wait()
        bad = os.path.join(self.dir, layout.step_dir(step))
        if os.path.exists(bad):
            drop_copy(self, bad)
            self.events.emit("ram_discard", steps=[layout.step_dir(step)])


def _tree_bytes(path: str) -> int:
    return sum(e.stat().st_blocks * 512 for e in os.scandir(path) if e.is_file())


def _copy(src: str, d: Storage, dst: str, size: int) -> None:
    """Copy one data file from tmpfs to ``d`` in pieces, two at a time, no intermediate copy; local files
    O_DIRECT (3 GB state: 12-13 s buffered here, 1.0-1.1 s direct; docs/storage.md, "RAM tier")."""
    w = open_writer(d, dst)
    try:
        if size:
            reserve(w, size)
            with open(src, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mm)
            pieces = [view[o : min(o + PIECE, size)] for o in range(0, size, PIECE)]
            try:
                if len(mm) < size:
                    raise CheckpointError(f"{src}: {len(mm)} bytes, the manifest says {size}")
                run_parallel([lambda i=i, p=p: w.pwrite(p, i * PIECE) for i, p in enumerate(pieces)], 2)  # daemon threads
            finally:
                for p in pieces:
                    p.release()
                view.release()
                with contextlib.suppress(BufferError):  # a slice held elsewhere (a gc.get_objects() list): unmapped
                    mm.close()  # when it goes; every byte was written, the copy did not fail
        w.finish(size)
    except BaseException:
        w.abort()
        raise
