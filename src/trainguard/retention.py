"""Retention on a run directory: which committed checkpoints a ``CheckpointManager`` deletes.

Called by ``CheckpointManager._apply_retention`` on rank 0 only, while it holds the run
directory's lock, after the checkpoint of step ``newest`` is committed (never before): from the
training thread after a sync save, from the save's or the RAM tier's background thread otherwise.
The policy (``policies.RetentionPolicy.select``) decides; this module lists and deletes.
``restore_candidates`` lists what ``CheckpointManager.restore`` tries (rank 0, broadcast);
``set_aside`` moves a rollback's abandoned checkpoints out of its way before a save starts.
``unrestored_error`` words the error of a manager's save that met an earlier run's step.
"""

from __future__ import annotations

import logging
import numbers
import secrets
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import iostall, layout
from .commit import list_steps, settle_aside
from .errors import CheckpointError, StepExistsError, error_text, is_store_client_error
from .faults import fault
from .freshhint import at_or_before, nested_runs, older_holds  # noqa: F401  (at_or_before, older_holds: manager.restore's)
from .keptseen import committed, kept_damaged, kept_gone, metadata_picks, remember_files
from .manifestfacts import read_facts
from .permanent import mark
from .policies import CheckpointInfo, KeepBest
from .ramleft import unused_copies
from .relist import committed_steps
from .storage._stale import recheck
from .tiers import location, stale_reason
from .userframe import warn_each

if TYPE_CHECKING:
    from .manager import CheckpointManager

log = logging.getLogger("trainguard")


def apply_retention(mgr: CheckpointManager, newest: int) -> None:
    """``CheckpointManager._apply_retention``: ``retain``, after ``newest`` is committed (never
    before), on rank 0, holding the lock; a failure is logged, emitted and warned, not raised."""
    try:  # recorded as one storage call: stuck (a hung NFS), it holds the save thread (iostall.oldest's thread)
        with iostall.inside(f"{iostall.RETENTION} {newest} (removing older checkpoints of {mgr.root})"):
            retain(mgr, newest)
        if aborted := recheck(mgr.storage, mgr._root):  # S3 uploads the open left young (a live save's?), idle since
            log.warning("trainguard: removed debris of crashed saves in %s: %s", mgr.root, aborted)
            mgr.events.emit("debris", removed=aborted)
    except Exception as e:
        log.warning("trainguard: retention after step %d failed (checkpoints are intact): %s", newest, e)
        mgr.events.emit("retention_failed", step=newest, error=str(e)[:2000])
        warn_each(f"retention after step {newest} failed; old checkpoints were kept: {e}")


def at_commit(mgr: CheckpointManager, handle: Any, clock: Callable[[], float]) -> None:
    """``CheckpointManager._track`` of an async save, rank 0: what follows its commit, on the save
    thread once it commits (``handle.after_commit``). With a RAM tier, its copy to disk starts
    (``tiers.RamTier.committed``, which runs retention after the copy). Else retention runs there,
    before the handle is done, not in the training thread's next ``save()``, whose stall it was
    (0.13-0.34 s for a 1 GB checkpoint on this machine; seconds on a parallel filesystem). A next
    ``save()`` that waits for it counts that as waiting for the previous save (``retained_at``, on
    the manager's ``clock``); ``_finish_pending`` then does not run it again."""

    def run(m: Any) -> None:
        # What _finish_pending sets later, for the policy's facts: with the RAM tier too, whose copy's
        # retention may run first (after a rollback the step's entry was the abandoned timeline's).
        committed_facts(mgr, m)
        if mgr.ram:
            return mgr.ram.committed(m.step, mgr._apply_retention, m.total_bytes)
        try:
            apply_retention(mgr, m.step)
        finally:
            handle.retained_at = clock()

    handle.after_commit(run)


def retain(mgr: CheckpointManager, newest: int) -> None:
    """Delete the committed checkpoints of ``mgr``'s root that ``mgr.keep`` does not keep, older
    than ``newest`` (which is kept whatever the policy says). A step ``restore`` found unusable
    takes no place among those kept, nor does one whose files ``kept_damaged`` found cut short or missing.

    Checkpoints newer than ``newest`` that this manager did not write are deleted too, once its
    ``restore`` returned a step: an earlier run left them, and this run went back behind them
    (``restore`` found them unusable, or the operator rolled back with ``restore(state, step=N)``).
    Their timeline is abandoned: kept, they would hold ``KeepLatest`` slots in place of this run's
    checkpoints, and the next restart would resume from them instead of from this run's newest.
    A manager that never restored knows nothing of them and keeps them (with a warning, once).

    Listed again while ``kept_gone`` finds a kept step's manifest gone (each time one more: a kept step that then
    stood in for it may be gone too, as when a lifecycle rule expired several; once, until review54d, and KeepEvery(10)
    deleted step 21 on the trust of step 10, gone with 20), at most once per listed step."""
    steps, abandoned, keep = _plan(mgr, newest)
    for _ in range(len(steps)):  # a kept step lost its manifest since it was seen, or its files are damaged: again
        if not (kept_gone(mgr, steps, keep, newest) or kept_damaged(mgr, steps, keep, newest)):
            break
        steps, abandoned, keep = _plan(mgr, newest)
    fault("before_retention", mgr.ctx.rank)
    if abandoned:
        log.warning(
            "trainguard: removing the checkpoints of steps %s in %s: this run saved step %d behind them, so "
            "they belong to an earlier run's abandoned timeline (a restart must not resume from them)",
            ", ".join(str(s.step) for s in abandoned), mgr.root, newest,
        )
    for s in abandoned:
        _delete(mgr, s.path, s.step, abandoned_by=newest)
    for name in mgr.storage.listdir(mgr._root) if mgr._aside not in ("", DONE) else []:  # set aside for this save
        if (m := layout.ASIDE_RE.match(name)) and m.group(2) == mgr._aside:
            _delete(mgr, mgr.storage.join(mgr._root, name), int(m.group(1)), abandoned_by=newest)
    mgr._aside = DONE if mgr._aside else ""
    for s in steps:
        if s.step not in keep and s.step < newest:
            _delete(mgr, s.path, s.step)


def _plan(mgr: CheckpointManager, newest: int) -> tuple[list[Any], list[Any], set[int]]:
    """``retain``'s one pass: the committed steps (but the abandoned ones), the abandoned ones, the steps kept."""
    steps = committed(mgr)
    foreign = [s for s in steps if s.step > newest and s.step not in mgr._own and not mgr._own.unknown(s.step)]
    abandoned = foreign if mgr._restored is not None else []
    if foreign and not abandoned and not mgr._warned_foreign:
        mgr._warned_foreign = True
        log.warning(
            "trainguard: %s holds checkpoints of steps %s, newer than this run's step %d, that this run did not "
            "write; they are kept, and a restart resumes from the newest of them. Call mgr.restore(state) at the "
            "start (or mgr.restore(state, step=N) to roll back: they are then removed), or use a new directory",
            mgr.root, ", ".join(str(s.step) for s in foreign), newest,
        )
    steps = [s for s in steps if s not in abandoned]
    facts = mgr.keep.reads_metadata  # else no manifest is read (KeepLatest, KeepEvery: steps alone)
    infos, unread = [], set()  # unread: kept, their manifest could not be read (_info)
    damaged = mgr.__dict__.get("_damaged", {})  # kept_damaged's: no place among those kept (nor is one rejected)
    for s in (s for s in steps if s.step not in mgr._rejected and s.step not in damaged):
        info = _info(mgr, s, facts)
        if info is None:
            unread.add(s.step)
        else:
            infos.append(info)
    _warn_no_metric(mgr, infos)
    mgr._picks = metadata_picks(mgr.keep, infos)  # type: ignore[attr-defined]  # keptseen._stand_ins: which to look at
    kept, older = _steps_kept(mgr.keep, infos), {i.step for i in infos if i.step < newest}
    # ... and one checkpoint before the newest, whatever the policy chose (KeepBest when the newest
    # is the best, KeepEvery(k) at a multiple of k): the newest may be unreadable when the job dies.
    keep = kept | {newest} | unread | ({max(older)} if older and not kept & older else set())
    return steps, abandoned, keep | {s.step for s in steps if s.step in damaged and s.step > min(keep)}


def _delete(mgr: CheckpointManager, path: str, step: int, **extra: Any) -> None:
    """``retain``, rank 0: remove one checkpoint and record it. ``remove_tree`` never raises (it logs
    what it could not remove, left for the next cleanup), so the event follows what is there after it:
    ``retention_delete`` once the manifest is gone (no longer a checkpoint), else ``retention_kept``
    with the path: before, ``retention_delete`` was emitted for a step an object store refused to delete
    (a 403, a persistent 500), which ``trainguard ls`` still listed. One more stat (a HEAD) per delete; when
    that stat fails too, the step is recorded as kept and retention goes on with the next one."""
    mgr.__dict__.get("_seen", set()).discard(path.rstrip("/").rsplit("/", 1)[-1])  # stat'ed again if still there
    mgr.storage.remove_tree(path)
    try:  # an error here (a 500 to the HEAD too) ended the whole retention, every time: no later step was deleted
        kept = mgr.storage.exists(mgr.storage.join(path, layout.MANIFEST))
        why = "could not be removed (see the log); left for the next cleanup"
    except Exception as e:  # what the store answers for the manifest then: not known to be gone, so kept
        kept, why = True, f"could not tell whether it was removed ({error_text(e)}); left for the next cleanup"
    if kept:
        mgr.events.emit("retention_kept", step=step, path=path, why=why, **extra)
        return
    _forget(mgr, step)
    mgr.events.emit("retention_delete", step=step, **extra)


def _warn_no_metric(mgr: CheckpointManager, infos: list[CheckpointInfo]) -> None:
    """``retain``, rank 0: log once per manager when a ``KeepBest`` of its retention ranks by a metric
    that no checkpoint of the run directory holds (no ``mgr.save(..., metrics={...})`` passed it), once
    there are more checkpoints than it keeps. Before, KeepBest then kept the newest ones, as it ranks
    checkpoints without the metric, without a word. A run that passes the metric at its evaluation
    steps only is warned at most once, before its first evaluation."""
    policies, best = [mgr.keep], []
    while policies:
        p = policies.pop()
        policies.extend(getattr(p, "policies", ()))
        if isinstance(p, KeepBest) and len(infos) > p.n and not any(p.metric in i.metrics for i in infos):
            best.append(p)
    if best and not mgr.__dict__.get("_warned_no_metric"):
        mgr._warned_no_metric = True  # type: ignore[attr-defined]
        names = sorted({p.metric for p in best})
        log.warning("trainguard: %r ranks checkpoints by %s, which none of the %d checkpoints in %s holds: until a "
                    "save passes it, the newest ones are kept. Pass it when you have it: mgr.save(step, state, "
                    "metrics={%s})", mgr.keep, ", ".join(names), len(infos), mgr.root,
                    ", ".join(f"{n!r}: value" for n in names))


def _steps_kept(policy: Any, infos: list[CheckpointInfo]) -> set[int]:
    """``retain``: ``policy.select(infos)`` as a set of steps. Anything but numbers in it (the
    steps as strings, say ``"20"`` parsed from a directory name) raises, so that retention fails
    and keeps everything (``apply_retention``): before, no step matched, and every checkpoint but
    the newest was deleted."""
    keep = set(policy.select(infos))
    wrong = [k for k in keep if isinstance(k, bool) or not isinstance(k, numbers.Real)]
    if wrong:
        raise TypeError(f"{policy!r}.select() returned {sorted(map(repr, wrong))[:5]}: it must return the steps "
                        "(ints) to keep, e.g. {c.step for c in checkpoints if ...}")
    return keep


DONE = "-"  # mgr._aside once set_aside found nothing to set aside, or what it set aside was deleted


def set_aside(mgr: CheckpointManager, step: int, meta: dict[str, Any]) -> CheckpointError | None:
    """Rank 0, in ``CheckpointManager.save`` after ``restore`` (a run directory that renames
    atomically, no RAM tier), before the save of ``step`` starts. The committed checkpoints newer
    than the step ``restore`` returned that this manager did not write (the timeline it went back
    behind; the earlier run's copy of ``step`` itself is replaced by the commit) are renamed
    to ``step-N.abandoned-<token>``, where no restore sees them, and the save's ``meta`` carries
    ``aside: token`` (so does every save until one with it commits, which ``retain`` follows by
    deleting them). Before, they were deleted only after that commit, and a crash in between (for
    an async save, until it was collected) left them to the restart, which resumed from the
    abandoned timeline. Now ``clean_debris`` (the next ``open``) deletes them when a checkpoint
    carrying the token committed, and otherwise puts them back: the rollback takes effect with
    the first save's commit, as before, and at once. Returns the error for the save's first
    round (a rename that failed), or None."""
    if not mgr.storage.atomic_rename or mgr._aside == DONE:  # DONE: nothing (more) to set aside since restore
        return None
    try:
        newer = [s for s in list_steps(mgr.storage, mgr._root)
                 if s.status == "committed" and s.step > (mgr._restored or 0) and s.step not in mgr._own
                 and not mgr._own.unknown(s.step) and s.step != step]
        mgr._aside = mgr._aside or (secrets.token_hex(8) if newer else DONE)
        if newer:  # those restore skipped said so (step, why); named again here, it is their deletion
            bad = ", ".join(str(s.step) for s in newer if s.step in mgr._rejected)
            log.warning("trainguard: setting aside the checkpoints of steps %s in %s%s, an abandoned timeline: this run "
                        "went back to step %s behind them; they are deleted when its next save commits",
                        ", ".join(str(s.step) for s in newer), mgr.root,
                        f" (restore found {bad} unusable: see its warning)" if bad else "", mgr._restored)
        for s in newer:
            mgr.storage.rename_dir(s.path, mgr.storage.join(mgr._root, layout.aside_dir(s.name, mgr._aside)))
    except OSError as e:
        return CheckpointError(f"could not move the checkpoints newer than step {step} out of the way of this run's "
                               f"rollback, in {mgr.root}: {e}")
    if mgr._aside != DONE:
        meta["aside"] = mgr._aside
    return None


def remove_replaced(mgr: CheckpointManager, durable: str) -> CheckpointError | None:
    """Rank 0, in ``CheckpointManager.save`` of a step it replaces (rejected by restore, or behind a
    rollback) where no atomic rename can replace it (RAM tier, object stores): the durable copy
    ``durable`` is removed first (it is unusable or abandoned). Returns the error for the save's
    first round when the storage cannot tell whether it is there (EIO, EACCES on its stat:
    ``LocalStorage.exists`` raises them): raised bare here, it escaped ``on_error="warn"`` on rank 0
    alone while the other ranks waited in the save's first round."""
    try:
        if mgr.storage.exists(mgr.storage.join(durable, layout.MANIFEST)):
            mgr.__dict__.get("_seen", set()).discard(durable.rstrip("/").rsplit("/", 1)[-1])
            mgr.storage.remove_tree(durable)
    except OSError as e:
        return CheckpointError(f"cannot look into {durable}, the checkpoint this save replaces: {e}")
    return None


def restore_candidates(mgr: CheckpointManager) -> list[tuple[int, str, str]] | dict[str, str]:
    """Rank 0, in ``CheckpointManager.restore``: the committed checkpoints to try, ``(step, path,
    tier)`` newest first (the RAM tier's copy of a step before its durable one), which it
    broadcasts; or ``{"error": ...}`` when the run directory cannot be listed (no permission, an
    object store's error), so that every rank raises it instead of waiting for rank 0. What
    ``set_aside`` moved away for a save that did not commit is put back first: before, a restore
    after that save failed did not see it (``restore()`` gave the earlier timeline's copy of the
    failed save's step, ``restore(step=5)`` that step too), where a restart resumes from it."""
    for seen in (mgr.__dict__.get("_seen", set()), mgr.__dict__.get("_damaged", {})):
        seen.clear()  # what retention saw before: a restore looks afresh
    try:
        if mgr._aside not in ("", DONE):  # set aside for a save that failed (restore waited for it)
            # Back first: this restore sees what a restart would (commit.clean_debris); the next save
            # sets aside again what is newer than the step restored now.
            token, mgr._aside = mgr._aside, ""
            settle_aside(mgr.storage, mgr._root, mgr.storage.listdir(mgr._root), only=token)
        steps = committed_steps(mgr.storage, mgr._root)  # listed again if retention deleted what it listed
        if not steps and not mgr.ram:  # a fresh start: the run one level down? (freshhint.py; never raises)
            nested_runs(mgr)
    except Exception as e:  # the broadcast carries it: the other ranks are waiting in it
        return {"error": error_text(e)}  # an object store's: what to check
    if mgr.ram:
        return mgr.ram.candidates(steps)
    unused_copies(mgr, steps)
    return [(s, location(mgr.storage, mgr.storage.join(mgr._root, layout.step_dir(s))), "durable") for s in reversed(steps)]


RELISTS = 3  # how many times ``tries`` lists the run directory again once every listed checkpoint failed


def tries(mgr: CheckpointManager, candidates: list[Any], at: int | None) -> Iterator[tuple[int, str, str]]:
    """``CheckpointManager.restore``, every rank, in the same order: the candidates to load (``restore_candidates``'
    broadcast), newest first; once every one failed, rank 0 lists the run directory again (``restore_candidates``)
    and broadcasts what was not tried (newer checkpoints committed meanwhile), at or before ``at``, up to
    ``RELISTS`` times. A job that saves into the run directory while another process restores from it (an eval
    job's manager on an object store, which has no run lock) deletes what that restore listed (``KeepLatest(2)``:
    two saves during a long load): the restore found every listed checkpoint "missing" and raised "none of the 2
    checkpoint(s) ... could be loaded" (a permanent error) while two newer valid ones were there (review55c).
    A restore whose candidates all failed for their own bytes lists once more and finds nothing new."""
    tried: set[tuple[int, str]] = set()
    for n in range(RELISTS + 1):
        if n:
            listed = mgr.ctx.broadcast("candidates-again", restore_candidates(mgr) if mgr.ctx.rank == 0 else None,
                                       timeout=mgr.timeout)
            if isinstance(listed, dict):  # cannot list now: the restore's error says what failed to load
                return
            candidates = [c for c in listed if (c[0], c[1]) not in tried and (at is None or c[0] <= at)]
        if not candidates:
            return
        for c in candidates:
            tried.add((c[0], c[1]))
            yield c


def newest_step(mgr: CheckpointManager) -> int | None:
    """``CheckpointManager.latest_step``, any rank, no collective: the newest committed step, the RAM
    tier's included. A save into the RAM tier is committed there (``wait()`` returns, ``restore``
    resumes from it) while rank 0's background copy to the run directory may still run: listing the
    run directory alone gave the step before (``None`` after the first save) until the copy ended.
    A RAM copy that ``restore`` would discard (``ramview.stale_reason``) is not counted. A listing that
    fails (an object store's error: botocore's, not an OSError, raised bare before) is a ``CheckpointError``."""
    try:
        steps = committed_steps(mgr.storage, mgr._root)  # listed again if retention deleted what it listed
    except Exception as e:
        if not isinstance(e, OSError) and not is_store_client_error(e):
            raise
        raise CheckpointError(f"latest_step: cannot list {mgr.root}: {error_text(e)}") from e
    newest = steps[-1] if steps else None
    if mgr.ram:
        durable = set(steps)
        for s in reversed(list_steps(mgr.ram.storage, mgr.ram.dir)):
            if s.status == "committed" and (newest is None or s.step > newest):
                if not stale_reason(mgr.ram.dir, mgr.storage, mgr._root, s.step, s.step in durable):
                    return s.step
    return newest


def _info(mgr: CheckpointManager, s: Any, facts: bool) -> CheckpointInfo | None:
    """``retain``: what the policy is told of step ``s`` (``facts``: its manifest's, ``_facts``), or
    None when its manifest could not be read (an OSError: EIO, EACCES). That checkpoint is kept and
    the policy decides over the others, with a warning and an event naming it. Before, the error
    failed the whole retention, at every later save too: nothing was deleted and the disk filled up."""
    if not facts:
        return CheckpointInfo(s.step, 0.0, {})
    try:
        return CheckpointInfo(s.step, *_facts(mgr, s))
    except OSError as e:  # not cached: the next retention reads it again
        log.warning("trainguard: retention keeps %s, whose manifest could not be read (%s); it decides over the "
                    "other checkpoints", s.path, e)
        mgr.events.emit("retention_unreadable", step=s.step, error=str(e)[:2000])
        return None


def _facts(mgr: CheckpointManager, s: Any) -> tuple[float, dict[str, float]]:
    """When step ``s`` was saved (its manifest's ``created``, wall time) and the metrics saved with
    it: cached in ``mgr._created`` and ``mgr._metrics`` (the manager fills both for its own saves);
    read from its manifest once otherwise (0.0 and no metrics when it cannot be read)."""
    if s.step not in mgr._metrics or s.step not in mgr._created:
        try:
            created, metadata = read_facts(mgr.storage, s.path)  # not every tensor validated
            # "metrics" is the manager's dict; a tg.save(..., metadata={"metrics": [...]}) in the run directory (or a
            # hand edit) holds anything: no metrics, as for a checkpoint without them. dict() of it raised TypeError,
            # which failed every later retention (nothing deleted: the disk filled up).
            metrics = metadata.get("metrics")
            mgr._metrics.setdefault(s.step, dict(metrics) if type(metrics) is dict else {})
            mgr._created[s.step] = created
        except CheckpointError:
            mgr._metrics.setdefault(s.step, {})
            mgr._created[s.step] = 0.0
    return mgr._created[s.step], mgr._metrics[s.step]


def _forget(mgr: CheckpointManager, step: int) -> None:
    for facts in (mgr._metrics, mgr._created, mgr.__dict__.get("_damaged", {}), mgr.__dict__.get("_sizes", {})):
        facts.pop(step, None)


def committed_facts(mgr: CheckpointManager, m: Any) -> None:
    """Rank 0, at the commit of its save of step ``m.step`` (``at_commit``'s thread; ``_finish_pending``): what its
    manifest ``m`` says that retention uses: when it was saved (the policy's facts), its files' sizes (``kept_damaged``)."""
    mgr._created[m.step] = m.created
    remember_files(mgr, m)


def unrestored_error(e: CheckpointError, step: int, restored: int | None) -> CheckpointError:
    """Called by ``CheckpointManager.save`` on every rank whose save failed with ``e`` (an async save's
    when ``_finish_pending`` collects it: its "begin" round ran on the save thread). A save of a
    step the run directory already holds, by a manager whose ``restore`` returned no step: say how
    to continue behind it (the ``StepExistsError`` itself names ``overwrite=True``, which a
    manager's ``save`` does not take). Permanent (exit 78 under ``trainguard run``): a restarted
    worker that does not restore meets the same step again. Any other error: ``e`` itself."""
    if restored is not None or not isinstance(e, StepExistsError):
        return e
    return mark(StepExistsError(
        f"save(step={step}): the run directory already holds a checkpoint of step {step}, from an earlier run, and "
        "this manager did not restore() from the directory. To continue this run behind that checkpoint (a "
        "rollback: its newer checkpoints are then removed at the first save), call mgr.restore(state, step=...) "
        "before the loop; to keep that run's checkpoints, save this one into a new directory"
    ))
