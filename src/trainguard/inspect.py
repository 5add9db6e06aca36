"""Read-only views of checkpoints: ``verify`` every checksum, list a run directory, describe
entries. Safe to run while a job is saving into the same run directory (they never touch
temp directories and take no lock). Used by the CLI and by tests; any process may call them.
Imports no torch, nor does any module it imports (a function given a live state does, when called):
``trainguard ls``, ``inspect`` and ``verify`` run without torch (tests/test_hunt51_cli51.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import layout
from .commit import list_steps, read_manifest
from .commitfail import symlink_to, wrong_size
from .errors import CheckpointError, FormatVersionError, NotACheckpointError, is_media_error
from .fdlimit import ensure_room
from .index import ChunkSource
from .manifest import Manifest
from .storage import Storage, for_path, location
from .tied import aliases_of
from .verifyread import check_chunks, each, one_chunk, prefetch

_READ = 64 << 20
_DELETED = "removed while it was listed (a running job's retention deletes old checkpoints)"
_ROW_THREADS = 16  # list_checkpoints on an object store: step directories looked at at once
_RELISTS = 3  # list_checkpoints: how many times more a run directory is listed when steps vanished while read


@dataclass
class VerifyResult:
    """``verify``'s verdict. ``path``: the checkpoint as given (a URL on an object store), for ``load``."""

    path: str
    ok: bool
    errors: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    step: int | None = None
    newer: bool = False  # the manifest is of a format this trainguard cannot read (FormatVersionError): not corruption


def verify(path: str | os.PathLike[str]) -> VerifyResult:
    """Check one checkpoint: manifest checksum and structure, file sizes, every chunk checksum.

    Reads every data byte once (streaming, bounded memory). Never raises for a bad
    checkpoint: the result lists what is wrong (file and tensor). Any one process, any time:
    no lock, no collective (safe while a job saves into the same run directory).
    """
    storage, target = for_path(path)
    shown = location(storage, target)  # the result's path: a URL on an object store (its key reads as a local path)
    named = layout.parse_step(os.path.basename(target.rstrip("/")))  # the step its name says, for an unreadable manifest
    try:
        manifest = read_manifest(storage, target)
    except CheckpointError as e:
        return VerifyResult(shown, False, [str(e)], 0, named, isinstance(e, FormatVersionError))
    except OSError as e:  # a medium's error (EIO): reported, not raised; EACCES and the like are raised
        _raise_unless_media(e)
        return VerifyResult(shown, False, [f"cannot read {shown}/{layout.MANIFEST}: {type(e).__name__}: {e}"], 0, named)
    errors: list[str] = []
    total = 0
    files = {**manifest.files, **{k: v[0] for k, v in manifest.indexes.items()}}
    # object stores: 8 at once (verifyread.each)
    for (fname, size), have in zip(files.items(), each(storage, lambda f: _size_of(storage, storage.join(target, f)), files)):
        if isinstance(have, BaseException):
            if not isinstance(have, OSError):
                raise have
            _raise_unless_media(have)  # EIO: reported, not raised
            errors.append(f"{fname}: cannot be read: {type(have).__name__}: {have}")
            continue
        if have is None:  # a link whose target is gone is said to be one, as tg.load says it (review57c)
            link = symlink_to(storage, storage.join(target, fname))
            errors.append(f"{fname}: missing" if link is None else f"{fname}: a symbolic link to {link}, which is not there")
        elif have != size:
            errors.append(f"{fname}: {wrong_size(storage, storage.join(target, fname), have, size)}")
    if errors:
        return VerifyResult(shown, False, errors, 0, manifest.step)
    try:
        total = _check_chunks(storage, target, manifest, errors)
    except CheckpointError as e:  # e.g. a data file that is a symlink or not a regular file
        errors.append(str(e))
    except OSError as e:  # a medium's error opening a data file
        _raise_unless_media(e)
        errors.append(f"cannot read a data file of {shown}: {type(e).__name__}: {e}")
    return VerifyResult(shown, not errors, errors, total, manifest.step)


def _raise_unless_media(e: OSError) -> None:
    """``verify`` reports a medium's read error (EIO: the checkpoint's bytes are not to be had) as
    what is wrong with the checkpoint; any other (EACCES: run as another user; EMFILE) is the
    command's problem, raised (the CLI prints it as one line, exit 2), never called corruption."""
    if not is_media_error(e):
        raise e


def _size_of(storage: Storage, path: str) -> int | None:
    """``path``'s size, or None when it is not there (also when it goes between the lookup and
    the stat: a running job's retention deleting the checkpoint). ``verify``, ``list_checkpoints``."""
    try:
        return storage.size(path) if storage.exists(path) else None
    except FileNotFoundError:
        return None


def deleted_while_read(storage: Storage, directory: str) -> bool:
    """Whether a checkpoint whose manifest was read has none any more: retention (or an operator)
    deleted it while ``list_checkpoints`` or ``trainguard verify`` checked it. Deletion removes
    the manifest first (``Storage.remove_tree``), so a checkpoint half deleted answers True too,
    and what its missing files showed is not corruption."""
    try:
        return not storage.exists(storage.join(directory, layout.MANIFEST))
    except OSError:
        return False


def _check_chunks(storage: Storage, directory: str, m: Manifest, errors: list[str]) -> int:
    # Format 2: every index is read and validated (size, checksum, fields) before any data.
    src = ChunkSource.of(storage, directory, m)
    src._read = prefetch(storage, src._read, m.indexes)  # object stores: every index at once (verifyread)
    # Format 3: an alias has no bytes of its own; its target's are read once, an error names both.
    aka = {p: f"{p!r} (and its alias(es) {', '.join(map(repr, a))})" for p, a in aliases_of(m.tensors).items()}
    every = [(aka.get(path, repr(path)), c) for path, e in m.tensors.items() if e.alias is None for c in src.all_chunks(path, e)]
    # Whole blocks, but never more than the longest chunk: a small checkpoint (or a hostile
    # block_size) must not cost a 64 MiB-1 GiB zero-filled buffer per verify.
    longest = max((c.length for _p, c in every), default=0)
    size = max(1, min(max(_READ // m.block_size, 1) * m.block_size, longest))
    total = 0
    readers = {}
    ensure_room(len(m.files))
    try:
        for f in m.files:  # opened one by one: a file that cannot be opened leaves none of them open
            readers[f] = storage.open_read(storage.join(directory, f))
        if not storage.atomic_rename:  # an object store: several reads at once, the same results (verifyread)
            return check_chunks(readers, every, m.block_size, size, errors, _raise_unless_media)
        view = memoryview(bytearray(size))
        for path, c in every:
            total += one_chunk(readers[c.file], path, c, view, m.block_size, errors, _raise_unless_media)
    finally:
        for r in readers.values():  # every one, even after a close that raised
            with contextlib.suppress(OSError):
                r.close()
    return total


@dataclass
class StepInfo:
    step: int
    name: str
    path: str
    status: str  # valid | corrupt | incomplete | deleted (while it was listed: retention) | newer format (FormatVersionError)
    created: float | None = None
    size: int = 0
    entries: int = 0
    detail: str = ""


def list_checkpoints(root: str | os.PathLike[str], *, verify_data: bool = False) -> list[StepInfo]:
    """Every step directory under ``root`` (a run directory) with its status. ``verify_data``
    checks all bytes; otherwise a checkpoint whose manifest validates and whose file sizes match
    is "valid". ``root`` being one checkpoint (a step directory) raises NotACheckpointError
    saying so (``describe``, ``trainguard inspect``, shows one) instead of listing nothing."""
    storage, r = for_path(root)
    if not storage.exists(r):
        from .commit import absent

        raise NotACheckpointError(f"{root}: no such directory{absent(storage, r)}")
    try:
        steps = list_steps(storage, r, media_ok=True)
    except NotADirectoryError:
        inside = layout.file_given(storage, r)  # a checkpoint's own file (`verify .../data-00000.bin`): its directory
        raise NotACheckpointError(inside if " is a file of the checkpoint " in inside else
                                  f"{root} is a file; pass a run directory (the one holding step-* directories)") from None
    if not steps:
        try:
            read_manifest(storage, r)
        except CheckpointError:
            pass  # an empty run directory (or not a checkpoint at all): nothing to list
        else:
            raise NotACheckpointError(
                f"{root} is a checkpoint, not a run directory: `trainguard inspect {root}` shows it, "
                "`trainguard ls` (list_checkpoints) takes the directory that holds the step-* directories"
            )
    rows: dict[str, StepInfo] = {}
    for _ in range(1 + _RELISTS):
        fresh = _rows(storage, [s for s in steps if s.name not in rows or rows[s.name].status == "incomplete"], verify_data)
        rows.update((x.name, x) for x in fresh)
        if not any(x.status == "deleted" for x in fresh):
            break
        # Retention deleted steps listed here while they were read (``verify_data``: checked): the job committed
        # newer ones since. Before, a job with KeepLatest(2) saving fast left ``ls --verify`` no valid row.
        steps = list_steps(storage, r, media_ok=True)
        for gone in rows.keys() - {s.name for s in steps}:  # listed without a manifest: half deleted then
            if rows[gone].status == "incomplete":
                rows[gone].status, rows[gone].detail = "deleted", _DELETED
    return sorted(rows.values(), key=lambda x: x.step)


def _rows(storage: Storage, steps: list[Any], verify_data: bool) -> list[StepInfo]:
    """``_row`` of each of ``steps``; on an object store (no local files) ``_ROW_THREADS`` at a time, the
    data not read (``verify_data``: one checkpoint's bytes at a time, as ``verify``). Each row is a few
    requests (the manifest's HEAD and GET, a HEAD per data file): one after another, ``trainguard ls`` of
    553 checkpoints took 61 s against an S3 endpoint 20 ms away, 10.7 s on loopback."""
    if storage.atomic_rename or verify_data or len(steps) < 2:
        return [_row(storage, s, verify_data) for s in steps]
    from concurrent.futures import ThreadPoolExecutor

    # each call is bounded (TRAINGUARD_STORE_TIMEOUT): no thread hangs the exit
    with ThreadPoolExecutor(max_workers=min(_ROW_THREADS, len(steps)), thread_name_prefix="trainguard-ls") as ex:
        return list(ex.map(lambda s: _row(storage, s, verify_data), steps))


def _row(storage: Storage, s: Any, verify_data: bool) -> StepInfo:
    """``list_checkpoints``' row of step directory ``s`` (``commit.list_steps``')."""
    addr = location(storage, s.path)  # what for_path maps back (a URL on object stores)
    if s.status == "incomplete":
        return StepInfo(s.step, s.name, addr, "incomplete", detail=f"no {layout.MANIFEST}")
    try:  # a medium's error (EIO) on one step is that step's verdict, as verify's, not the listing's end
        m = read_manifest(storage, s.path)  # of an "unreadable" step (its stat's EIO) too: that error again
    except CheckpointError as e:  # a newer trainguard's manifest is not corruption: upgrade to read it (review56d)
        status = "newer format" if isinstance(e, FormatVersionError) else "corrupt"
        return _bad(storage, s.path, StepInfo(s.step, s.name, addr, status, detail=str(e)))
    except OSError as e:
        _raise_unless_media(e)
        return StepInfo(s.step, s.name, addr, "corrupt", detail=f"cannot read its {layout.MANIFEST}: {e}")
    status, detail = "valid", ""
    if verify_data:
        v = verify(addr)
        if not v.ok:
            status, detail = "corrupt", "; ".join(v.errors[:3])
    else:
        for f, size in {**m.files, **{k: v[0] for k, v in m.indexes.items()}}.items():
            try:
                have = _size_of(storage, storage.join(s.path, f))
            except OSError as e:
                _raise_unless_media(e)
                status, detail = "corrupt", f"{f}: cannot be read: {e}"
                break
            if have is None:  # deleted by hand (or a copy that left it out): say so, as verify does
                status, detail = "corrupt", f"{f}: missing"
                break
            if have != size:
                status, detail = "corrupt", f"{f}: {wrong_size(storage, storage.join(s.path, f), have, size)}"
                break
    return _bad(storage, s.path, StepInfo(s.step, s.name, addr, status, m.created, m.total_bytes, len(m.objects), detail))


def _bad(storage: Storage, directory: str, row: StepInfo) -> StepInfo:
    """``row`` (of step directory ``directory``), or when it is corrupt because the job's retention
    deleted it while it was listed (``deleted_while_read``), the same step marked "deleted": not
    corruption, and restore never reads it."""
    if row.status == "corrupt" and deleted_while_read(storage, directory):
        row.status, row.detail = "deleted", _DELETED
    return row


def set_aside(root: str | os.PathLike[str]) -> list[str]:
    """What ``trainguard ls`` says under its table about the checkpoints of run directory ``root``
    that it does not list, but the next manager on ``root`` may put back (``clean_debris``): one
    line per ``step-N.old-<id>`` (an overwrite cut short, step N without a manifest) and
    ``step-N.abandoned-<token>`` (set aside by a rollback) that holds a manifest. Never raises."""
    try:
        storage, r = for_path(root)
        names = [n for n in storage.listdir(r) if layout.OLD_RE.match(n) or layout.ASIDE_RE.match(n)]
        held = [n for n in names if storage.exists(storage.join(r, n, layout.MANIFEST))]
        olds = {n for n in held if (m := layout.OLD_RE.match(n))
                and not storage.exists(storage.join(r, layout.step_dir(int(m.group(1))), layout.MANIFEST))}
    except Exception:  # noqa: BLE001 - the listing above is the answer; this is only a note
        return []
    out = []
    for n in held:
        if n in olds and (m := layout.OLD_RE.match(n)):  # else its step committed again: clean_debris drops it
            out.append(f"{n}: step {int(m.group(1))}'s previous checkpoint, left by an overwrite cut short; "
                       "the next CheckpointManager on this directory puts it back (or load that path)")
        elif m := layout.ASIDE_RE.match(n):
            out.append(f"{n}: step {int(m.group(1))}, set aside by a rollback; removed once a save after the "
                       "rollback commits, else put back by the next CheckpointManager")
    return out


def describe(path: str | os.PathLike[str]) -> Manifest:
    """The validated manifest of one checkpoint (for ``trainguard inspect``)."""
    storage, target = for_path(path)
    return read_manifest(storage, target)


def touched_tensors(path: str, state: Mapping[str, Any], error: BaseException | None = None) -> dict[str, list[int] | None]:
    """The tensors (path -> shape) of ``state``'s entries that a failed load of ``path`` may
    have written into: bytes are read in place, before the load can fail on a checksum. Each such
    entry that holds no tensor in the checkpoint (a ``ResumableSampler``, a progress dict: its
    ``load_state_dict`` had run) is there by its key, with ``None``.
    ``CheckpointManager.restore`` calls it on every rank after a load it skipped, with the load's
    ``error``: none when that load failed before it wrote anything (``partly_loaded`` False, the same
    on every rank: partread.py), e.g. for a missing data file; else those of the entries it names
    (``touched_entries``, every rank's union; None or absent: every entry). Before, those counted too,
    and an older checkpoint that lacked one of them was refused ("partly read from a newer checkpoint")."""
    if error is not None and not getattr(error, "partly_loaded", True):
        return {}
    keys = getattr(error, "touched_entries", None)
    wrote = state if keys is None else set(keys)
    try:
        m = read_manifest(*for_path(path))
    except (CheckpointError, OSError):  # OSError: a medium's error (EIO) again, as at the load it ends
        return {}  # no manifest could be read: nothing was read into the state
    out: dict[str, list[int] | None] = {p: e.shape for p, e in m.tensors.items() if p.split("/")[0].split("@")[0] in wrote}
    heads = {p.split("/")[0].split("@")[0] for p in out}
    out.update((k, None) for k in wrote if k in state and k in m.objects and k not in heads)  # its JSON values only
    return out


def not_overwritten(touched: Mapping[str, list[int] | None], manifest: Manifest, state: Mapping[str, Any]) -> list[str]:
    """``CheckpointManager.restore`` (every rank), once an older checkpoint ``manifest`` loaded after
    skipped ones: the ``touched`` tensors (``touched_tensors``) that this load did not overwrite, as
    it holds none of that path and shape, and the touched entries without tensors that it does not
    hold (``strict=False``: a sampler added since it was saved kept the newer checkpoint's position,
    and restore returned the older step, silently). An optimizer's per-parameter state that the older checkpoint
    lacks is not one of them: its ``load_state_dict`` replaces the optimizer's whole state (a
    parameter frozen or without gradients until after that step has none, and the restart was
    refused: its fresh optimizer had read nothing in place)."""
    import torch

    def replaced(p: str) -> bool:
        key, _, rest = p.partition("/")
        return (rest.startswith("state/") and key in manifest.objects
                and isinstance(state.get(key), torch.optim.Optimizer))

    def local(p: str, shape: list[int]) -> tuple[str, str, tuple[int, ...]] | None:
        head, _, rest = p.partition("/")
        return (head.split("@")[0], rest, tuple(shape)) if "@" in head else None

    # A rank-local entry's tensors (``rng@3/torch_cpu``) by the part after the saved rank: a rank reads one
    # saved rank's of them (rankload.py), and the older checkpoint's load gives it some rank's too (or re-seeds
    # it). Before, each saved rank's path had to be in it: a run that grew to 2 ranks at its newest checkpoint
    # could not fall back past it on 1 (no ``rng@1`` in the older one), although no rank had read ``rng@1``.
    held = {k for p, e in manifest.tensors.items() if (k := local(p, e.shape)) is not None}

    def kept(p: str, shape: list[int] | None) -> bool:
        if shape is None:  # an entry without tensors (touched_tensors)
            return p not in manifest.objects
        if (k := local(p, shape)) is not None:
            return k not in held
        return p not in manifest.tensors and not replaced(p) or p in manifest.tensors and manifest.tensors[p].shape != shape

    return sorted(p for p, shape in touched.items() if kept(p, shape))


def partly_read_refusal(left: list[str], touched: Mapping[str, list[int] | None], step: int) -> CheckpointError:
    """``CheckpointManager.restore``'s error when the older checkpoint of ``step`` that loaded does not
    overwrite ``left`` (``not_overwritten``): tensors, and entries without tensors (``None`` in ``touched``)."""
    tensors, entries = [p for p in left if touched.get(p) is not None], [p for p in left if touched.get(p) is None]
    what = [f"tensors {tensors[:20]}"] * bool(tensors)
    what += [f"entries {entries[:20]} (no tensors: their load_state_dict() had run)"] * bool(entries)
    return CheckpointError(
        f"restore: {' and '.join(what)} were partly read from a newer checkpoint that is not usable, and the checkpoint "
        f"of step {step} does not hold them{' with that shape' * bool(tensors)}; they hold no consistent state. Restore a "
        "state without them, then add them fresh"
    )


def unmatched_entries(state: Mapping[str, Any], manifest: Manifest, split_state: bool = False) -> str:
    """``CheckpointManager.restore(strict=False)`` (rank 0, once a checkpoint loaded): a line naming the
    state's entries that the checkpoint holds no state for (left as they were: an optimizer or scheduler
    added since the save) and, without ``split_state``, the checkpoint's entries the state lacks (not
    read), or "" when there are none. Before, ``strict=False`` left them so without a word."""
    fresh = [k for k in state if k not in manifest.objects]
    unread = [] if split_state else [k for k in manifest.objects if k not in state]
    parts = [f"holds no state for entries {fresh[:20]} (left as they are)"] * bool(fresh)
    parts += [f"holds entries {unread[:20]} that the state lacks (not read)"] * bool(unread)
    return f"restore(strict=False): the checkpoint of step {manifest.step} " + " and ".join(parts) if parts else ""
