"""RAM tier copies that a ``CheckpointManager`` does not find where it looks: left by an older
trainguard under another name (``adopt_legacy``, rank 0 at the RAM tier's open), or by a run with
``ram_tier=True`` when this manager has none (``unused_copies``, rank 0 in ``restore``). Both are what a
user meets after upgrading, or changing options, in the middle of a run (session 46's hunt "upgrade")."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from .commit import list_steps
from .errors import CheckpointError

log = logging.getLogger("trainguard")


def legacy_dir(ram: str, root: str) -> str | None:
    """The RAM directory that trainguard before 2026-12-04 (b0beff4) gave the run ``root`` (a local path)
    next to ``ram``, the one it has now: named by ``root``'s absolute path, not its real path. None where
    both are the same (no link on the way) or for a URL."""
    if "://" in root:
        return None
    old = os.path.join(os.path.dirname(ram), hashlib.sha1(os.fsencode(os.path.abspath(root))).hexdigest()[:16])
    return None if old == ram else old


def read_id(path: str) -> bytes | None:
    """The run id in the file ``path`` (a RAM tier's ``RUN_ID``: its first 64 bytes), None without one;
    another ``OSError`` is raised. ``run_id``, ``adopt_legacy`` and ``ramroom.left_behind`` read it so.
    O_NONBLOCK: a FIFO of that name reads as an empty id at once instead of waiting for a writer."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            return f.read(64)
    except FileNotFoundError:
        return None


def run_id(path: str) -> str | None:
    """``RamTier._check_run``: :func:`read_id` as text, as the run directory's id is compared."""
    raw = read_id(path)
    return None if raw is None else raw.decode(errors="replace")


def unclaimed(ram_storage: Any, ram: str, durable: Any, root: str) -> bool:
    """``RamTier._check_run``, rank 0: whether the RAM tier ``ram``, which holds no run id (written by trainguard
    before 2026-12-01), is a deleted run directory's, when the run directory ``root`` has no id either: it holds
    RAM copies and ``root`` no committed checkpoint, the run directory removed to start over. Before, a new
    version's restore loaded that deleted run's newest RAM copy into the new run (the id's check cannot
    tell without ids). It may also be an old run whose first save crashed before its copy to disk: that one
    copy is discarded too (with the warning and event ``ram_discard``), as for a run directory deleted since."""
    return bool(list_steps(ram_storage, ram)) and not any(s.status == "committed" for s in list_steps(durable, root))


def found_dir(root: str, base: str) -> str:
    """``ramview.ram_copies`` (``trainguard ls``, ``verify``): the RAM directory of the run ``root`` under ``base``,
    or, where that does not exist, the one an older version named (``legacy_dir``), which the next open adopts."""
    from .ramview import ram_dir

    here = ram_dir(root, base)
    old = legacy_dir(here, root)
    return old if old is not None and not os.path.isdir(here) and os.path.isdir(old) else here


def adopt_legacy(tier: Any) -> None:
    """``opened``, rank 0, before ``RamTier.prepare``: a run reached through a link (``ckpts -> /scratch/u``)
    whose RAM tier an older trainguard wrote has it under ``legacy_dir``; it is renamed to ``tier.dir``
    (event ``ram_adopted``) when ``tier.dir`` holds no checkpoint yet and the old directory carries the run
    directory's id (or none: trainguard before 2026-12-01 wrote no id; the older code used it as this run's).
    Before, an upgrade in the middle of a run ignored it: ``restore`` went back to the newest step on disk,
    losing the newest ones, saved in RAM only before the crash, and the copies held memory until removed
    by hand (``left_behind`` named them as "moved")."""
    from .ramview import RUN_ID
    from .storage import location

    old = legacy_dir(tier.dir, location(tier.durable, tier.durable_root))
    if old is None or os.path.islink(old) or not os.path.isdir(old) or not list_steps(tier.storage, old):
        return
    if os.path.isdir(tier.dir) and list_steps(tier.storage, tier.dir):
        return  # this code's own RAM copies: the old ones are left_behind's
    marker = tier.durable.join(tier.durable_root, RUN_ID)
    theirs = tier.durable.read_bytes(marker, 64) if tier.durable.exists(marker) else None
    mine = read_id(os.path.join(old, RUN_ID))  # a FIFO there blocked the open before
    if mine is not None and mine != theirs:
        return  # another run's (the link leads elsewhere now): left to the code that wrote it
    if os.path.isdir(tier.dir):
        tier.storage.remove_tree(tier.dir)  # no checkpoint in it: ids, markers, debris
    os.rename(old, tier.dir)
    steps = [s.name for s in list_steps(tier.storage, tier.dir)]
    log.warning("trainguard: the RAM tier of %s was under %s (its name before trainguard 2026-12-04, from the path "
                "given, not the real one); moved to %s, its copies %s are used", tier.durable_root, old, tier.dir, steps)
    tier.events.emit("ram_adopted", path=old, steps=steps)


def unused_copies(mgr: Any, durable: list[int]) -> None:
    """``retention.restore_candidates``, rank 0, of a manager without ``ram_tier`` on a local run directory
    (``durable``: its committed steps): warn, with the event ``ram_unused``, when this node's default RAM
    tier of the run (``/dev/shm``: ``ramview.ram_copies``, which checks the run's id) holds checkpoints newer
    than the run directory's newest, which a run with ``ram_tier=True`` saved and did not copy to disk before
    it ended (a crash, an upgrade). Before, restore went back to the step on disk without a word and the
    copies held memory until the node restarted. They are not removed: the next open with ``ram_tier=True``
    resumes from them. Nothing said when the RAM tier cannot be read."""
    from .ramview import ram_copies, stale_reason
    from .storage import LocalStorage

    if not mgr.storage.atomic_rename:
        return
    newest = max(durable, default=-1)
    try:
        here = ram_copies(mgr.root)
        newer = [] if here is None else [s.step for s in list_steps(LocalStorage(), here) if s.status == "committed"
                                         and s.step > newest and not stale_reason(here, mgr.storage, mgr._root, s.step, False)]
    except (OSError, CheckpointError):
        return
    if newer:
        log.warning("trainguard: %s, this node's RAM tier of %s, holds steps %s, newer than the run directory's newest "
                    "(%s), saved with ram_tier=True and never copied to disk; this manager has no ram_tier, so restore "
                    "does not see them. To resume from them, open the manager with ram_tier=True; else remove them: "
                    "rm -rf %s", here, mgr.root, newer, "none" if newest < 0 else newest, here)
        mgr.events.emit("ram_unused", path=here, steps=newer)
