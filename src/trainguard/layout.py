"""Every on-disk name in one place: step directories, temp directories, data files, the lock.

::

    <root>/
      step-000000700/            committed: holds manifest.json (written last)
        manifest.json
        data-00000.bin           raw bytes written by rank 0
        data-00000.idx           format 2: where rank 0's regular parts sit in data-00000.bin
      step-000000800.tmp-<id>/   a save in progress or a crashed one: never read, cleaned at start
      step-000000600.old-<id>/   an overwritten checkpoint being replaced (recovered if the new one is missing)
      step-000000900.abandoned-<token>/  a rollback's abandoned checkpoint, set aside before this run's first save
                                 (deleted once a save carrying <token> commits, else put back)
      .lock                      one writing job per run directory
      events.jsonl               the event log
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any

from .errors import nonneg_int

MANIFEST = "manifest.json"
LOCK = ".lock"
STEP_RE = re.compile(r"^step-(\d{9,})\Z", re.ASCII)
TMP_RE = re.compile(r"^step-(\d{9,})\.tmp-([0-9a-f]{1,32})\Z", re.ASCII)
OLD_RE = re.compile(r"^step-(\d{9,})\.old-([0-9a-f]{1,32})\Z", re.ASCII)
ASIDE_RE = re.compile(r"^step-(\d{9,})\.abandoned-([0-9a-f]{1,32})\Z", re.ASCII)
DATA_RE = re.compile(r"^data-\d{5}(-[1-9])?\.bin\Z", re.ASCII)  # data-RRRRR.bin, data-RRRRR-S.bin (stream S)
IDX_RE = re.compile(r"^data-\d{5}\.idx\Z", re.ASCII)
# A small file being written atomically (``Storage.write_atomic``: ``<name>.tmp-<pid>``).
ATOMIC_TMP_RE = re.compile(r"^(manifest\.json|data-\d{5}\.idx)\.tmp-\d+\Z", re.ASCII)


# Where a manager's ``ram_tier=True`` keeps its RAM copies (``tiers.DEFAULT_BASE``; ``ls``/``verify --ram-tier``).
RAM_BASE = "/dev/shm"

# The largest step a manifest holds (``manifest.validate`` refuses a larger one as corrupt).
MAX_STEP = 1 << 62


def check_step(step: Any) -> int:
    """The ``step`` given to ``CheckpointManager.save``/``restore``, or named by the directory of
    ``tg.save`` (``api.start_save``): an integer in [0, 2**62] (numpy and 0-d tensor ints too)."""
    from .permanent import config_errors

    with config_errors():  # a bad argument: no restart fixes it
        n = nonneg_int(step, f"step={step!r}: pass the training step as an int >= 0")
        if n > MAX_STEP:
            raise ValueError(f"step={n}: a checkpoint's step is at most 2**62 ({MAX_STEP}); a larger one could not be loaded")
    return n


def step_dir(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:09d}"


def check_target(target: str, step: int | None) -> None:
    """``api.start_save``, every rank, before anything is written: the step (given, or named by
    the directory: :func:`check_step`), and a name short enough for the temporary and the aside
    names the save gives it (``<name>.tmp-<id>``, ``<name>.old-<id>``) on a filesystem whose
    names hold 255 bytes."""
    name = os.path.basename(target.rstrip("/"))
    check_step(step if step is not None else parse_step(name) or 0)
    if len(os.fsencode(name)) > NAME_MAX - 21:
        from .permanent import config_errors

        with config_errors():
            raise ValueError(f"checkpoint name {name[:40]!r}... is {len(os.fsencode(name))} bytes: while it saves, "
                             f"trainguard names it '<name>.tmp-<16 hex>' (21 bytes more), and a file name holds at "
                             f"most {NAME_MAX} bytes; use a name of at most {NAME_MAX - 21} bytes")


def open_run_root(storage: Any, root: str) -> None:
    """``CheckpointManager.open``, rank 0, before it takes the lock: create the run directory
    ``root``, and refuse one that is itself a checkpoint (it holds ``manifest.json``: a manager
    pointed at ``ckpts/run1/step-000000700``). There the manager put its lock and event log into
    that checkpoint, ``restore`` found no step directory in it and returned None (a fresh start over
    the checkpoint the run meant to resume from), and its saves nested ``step-N`` directories inside
    it. Permanent: no restart fixes it. A ``manifest.json`` of another tool (not ``{"checksum":"...``,
    the start of every trainguard manifest) is left alone. An I/O error looking is raised: the manager's
    open fails on every rank with it, as for any of rank 0's errors there."""
    if refused := inside_checkpoint(storage, root, every_level=True):
        from .errors import CheckpointError
        from .permanent import mark

        raise mark(CheckpointError(refused["refused"]))
    storage.makedirs(root)
    path = storage.join(root, MANIFEST)
    if storage.exists(path) and storage.read_bytes(path, 31).startswith(b'{"checksum":"'):
        from .errors import CheckpointError
        from .permanent import mark

        step = parse_step(os.path.basename(root.rstrip("/")))
        raise mark(CheckpointError(
            f"{root} is one checkpoint{'' if step is None else f' (step {step})'}, not a run directory: a "
            f"CheckpointManager there would restore nothing and save inside it. Pass the run directory that holds "
            f"it ({os.path.dirname(root.rstrip('/')) or '.'}), whose restore() resumes from its newest valid "
            f"checkpoint; or load this one with tg.load({root!r}, state)"
        ))


NAME_MAX = 255


def tmp_dir(name: str, save_id: str) -> str:
    return f"{name}.tmp-{save_id}"


def old_dir(name: str, save_id: str) -> str:
    return f"{name}.old-{save_id}"


def is_old_of(entry: str, name: str) -> bool:
    """Whether ``entry`` is ``old_dir(name, <id>)``: ``commit.moved_aside`` finds the checkpoint an
    overwrite of ``name`` cut short left aside."""
    return entry.startswith(f"{name}.old-") and re.fullmatch(r"[0-9a-f]{1,32}", entry[len(name) + 5:], re.ASCII) is not None


def aside_dir(name: str, token: str) -> str:
    return f"{name}.abandoned-{token}"


def data_file(rank: int, stream: int = 0) -> str:
    """Rank ``rank``'s data file; a rank writing several files in parallel adds ``-<stream>``."""
    return f"data-{rank:05d}.bin" if stream == 0 else f"data-{rank:05d}-{stream}.bin"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def index_file(rank: int) -> str:
    """Format 2: where rank ``rank``'s regular parts sit in its data file (see index.py)."""
    return f"data-{rank:05d}.idx"


def own_file(name: str) -> bool:
    """Whether ``name`` is a file a checkpoint directory of ours may hold (``api`` refuses to
    save into, and so to delete, a directory holding anything else)."""
    return name == MANIFEST or bool(DATA_RE.match(name) or IDX_RE.match(name) or ATOMIC_TMP_RE.match(name))


def file_given(storage: Any, path: str) -> str:
    """``commit.read_manifest``'s error for a file given as a checkpoint (``tg.load``, ``tg.verify``,
    ``trainguard inspect``...): before, "not a committed checkpoint (no manifest.json); it may be a
    save that crashed or is still running", for the manifest itself too."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and storage.exists(storage.join(parent, MANIFEST)):
        return f"{path} is a file of the checkpoint {parent}: pass that directory"
    return (f"{path} is a file, not a checkpoint directory: pass the directory that holds {MANIFEST} (a torch.save or "
            "safetensors file is imported with `trainguard convert`)")


def inside_checkpoint(storage: Any, path: str, *, every_level: bool = False) -> dict[str, str]:
    """Why ``path`` may not be a save's directory (``commit.occupied``: its parent) or a manager's run
    directory (:func:`open_run_root`, ``every_level``: every directory above it): it lies inside a
    committed checkpoint (trainguard's ``manifest.json`` there). The run's retention or an
    ``overwrite=True`` of that checkpoint deletes its directory whole, and what was saved inside it
    with it: before, a ``CheckpointManager("ckpts/run/step-000000100/eval")`` opened and saved there.
    ``{}`` when it may be."""
    head = path.rstrip("/")
    while (parent := os.path.dirname(head)) and parent != head:
        manifest = storage.join(parent, MANIFEST)
        try:  # a directory above that cannot be read (an object store's bucket root outside the user's prefix: 403)
            found = storage.exists(manifest) and storage.read_bytes(manifest, 31).startswith(b'{"checksum":"')
        except Exception:  # is left to the operations that need it: this check does not fail a save
            return {}
        if found:
            return {"refused": f"{path} is inside the checkpoint {parent}, which is deleted whole by its run's retention "
                               f"or an overwrite, and what is saved inside it with it: save outside that directory"}
        if not every_level:
            break
        head = parent
    return {}


def other_steps(storage: Any, path: str, shown: str) -> str:
    """For a "no such checkpoint directory" error (``commit.absent``: ``tg.load``, ``trainguard inspect``,
    ``export``, ``consolidate``, ``convert``) of a step directory that is not there: `` (RUN holds step(s)
    ...: `trainguard ls RUN` shows which are valid)`` naming the run directory's steps (the newest 6),
    or ``""`` when ``path`` names no step or its parent holds none; ``shown``: the parent as the user
    wrote it (an object store's URL). Before, a mistyped step number
    (``step-00000070`` for ``step-000000700``, a step retention had deleted) said nothing of the ones there."""
    parent, name = os.path.split(path.rstrip("/"))
    if not name.startswith("step-") or not parent:  # a step's name, or one mistyped (step-00000070: a digit short)
        return ""
    try:
        steps = sorted({s for n in storage.listdir(parent) if (s := parse_step(n)) is not None}, reverse=True)
    except Exception:  # a parent that is not there or cannot be listed: the error stays as it was
        return ""
    if not steps:
        return ""
    listed = ", ".join(str(s) for s in steps[:6]) + (f" and {len(steps) - 6} older" if len(steps) > 6 else "")
    return f" ({shown} holds step(s) {listed}: `trainguard ls {shlex.quote(shown)}` shows which are valid)"
