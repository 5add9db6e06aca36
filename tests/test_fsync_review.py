"""Crash consistency against a power loss, checked on the real order of the file-system calls.

A process kill (tests/test_crash.py) loses nothing the kernel already holds; a power loss loses
whatever was not made durable. Reasoning as ALICE does (Pillai et al., OSDI'14): a file's bytes
are durable once the file is fsynced after its last write, and a directory entry (a create,
mkdir, rename or unlink) once its directory is fsynced after it; anything else may be lost or
reordered. ``Recorder`` wraps the ``os`` calls of a save (open, write, fsync, mkdir, rename,
unlink...) and logs each against the inodes it touches, and the checks below ask that log, at the
moment that matters (the rename that commits, the return of the save, the first data file a
deletion removes), whether what must be durable was.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard import streams
from trainguard.consolidate import consolidate
from trainguard.export import export
from trainguard.storage import LocalStorage

Key = tuple[int, int]  # (st_dev, st_ino)


def _key(st: os.stat_result) -> Key:
    return (st.st_dev, st.st_ino)


class Trace:
    """A log of ``("entry", dir, name)``, ``("write", inode)``, ``("fsync", inode)``, ``("rename",
    src, dst)``, ``("unlink", dir, name)``, ``("mark", label)``, each with its CLOCK_MONOTONIC time
    (one clock for every process of the machine: the logs of several ranks merge into one)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.times: list[int] = []

    @classmethod
    def merge(cls, *parts: tuple[list[int], list[tuple[Any, ...]]]) -> Trace:
        t = cls()
        for when, ev in sorted(((w, e) for times, log in parts for w, e in zip(times, log)), key=lambda x: x[0]):
            t.times.append(when)
            t.log.append(ev)
        return t

    def part(self) -> tuple[list[int], list[tuple[Any, ...]]]:
        return list(self.times), list(self.log)

    # ------------------------------------------------------------------ the durability model
    def entry_durable(self, d: Key, name: str, at: int) -> bool:
        """The last change of entry ``name`` in directory ``d`` before ``at`` was followed by an
        fsync of ``d`` before ``at`` (an entry this log never changed was there before: durable)."""
        last = max((i for i, e in enumerate(self.log[:at]) if e[0] == "entry" and e[1] == d and e[2] == name), default=None)
        return last is None or any(e == ("fsync", d) for e in self.log[last + 1 : at])

    def data_durable(self, inode: Key, at: int) -> bool:
        """The file was fsynced after its last write (or creation) and before ``at``."""
        last = max((i for i, e in enumerate(self.log[:at]) if e == ("write", inode)), default=-1)
        return any(e == ("fsync", inode) for e in self.log[last + 1 : at])

    def rename_to(self, dst: str | os.PathLike[str]) -> int:
        """Index of the last rename onto ``dst`` (the commit of a checkpoint directory, a file)."""
        dst = os.path.abspath(dst)
        return max(i for i, e in enumerate(self.log) if e[0] == "rename" and e[2] == dst)

    def not_durable(self, path: str | os.PathLike[str], at: int, base: str | os.PathLike[str] | None) -> list[str]:
        """What of ``path`` (a checkpoint directory or a file) a power loss at ``at`` may lose: its
        files' bytes or entries, its own entry, or that of a directory between it and ``base``
        (``base=None``: the files inside only, as at the rename that commits the directory)."""
        path = Path(path).absolute()
        bad = []
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        for f in files:
            if f.is_file():
                if not self.data_durable(_key(f.stat()), at):
                    bad.append(f"bytes of {f}")
                if not self.entry_durable(_key(f.parent.stat()), f.name, at):
                    bad.append(f"entry of {f}")
        if base is None:
            return bad
        p, base = (path if path.is_dir() else path.parent), Path(base).absolute()
        chain = [path] if path.is_file() else []
        while p != base:
            chain.append(p)
            p = p.parent
        for c in chain:
            if not self.entry_durable(_key(c.parent.stat()), c.name, at):
                bad.append(f"entry of {c}")
        return bad

class Recorder(Trace):
    """Records the calls of the patched ``os`` functions (any thread of this process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self._patch(monkeypatch)

    def mark(self, label: str) -> int:
        """Log a point of the test (``"returned"``...); returns its index."""
        with self.lock:
            self.times.append(time.monotonic_ns())
            self.log.append(("mark", label))
            return len(self.log) - 1

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = {n: getattr(os, n) for n in (
            "open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir", "fsync", "fdatasync",
            "write", "pwrite", "pwritev", "ftruncate", "posix_fallocate",
        )}
        self.real = real

        def add(*ev: Any) -> None:
            with self.lock:
                self.times.append(time.monotonic_ns())
                self.log.append(ev)

        def parent(path: Any, dir_fd: int | None) -> tuple[Key, str]:
            path = os.fsdecode(path)
            if dir_fd is not None and not os.path.isabs(path):
                return _key(os.fstat(dir_fd)), path
            a = os.path.abspath(path)
            return _key(os.stat(os.path.dirname(a))), os.path.basename(a)

        def w_open(path: Any, flags: int, *a: Any, dir_fd: int | None = None, **k: Any) -> int:
            new = bool(flags & os.O_CREAT) and not os.path.lexists(
                path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{os.fsdecode(path)}")
            fd = real["open"](path, flags, *a, dir_fd=dir_fd, **k)
            if new:
                add("entry", *parent(path, dir_fd))
                add("write", _key(os.fstat(fd)))
            return fd

        def w_mkdir(path: Any, *a: Any, dir_fd: int | None = None, **k: Any) -> None:
            real["mkdir"](path, *a, dir_fd=dir_fd, **k)
            add("entry", *parent(path, dir_fd))

        def w_rename(name: str):
            def f(src: Any, dst: Any, *a: Any, **k: Any) -> None:
                ps = parent(src, None)
                real[name](src, dst, *a, **k)
                add("entry", *ps)
                add("entry", *parent(dst, None))
                add("rename", os.path.abspath(os.fsdecode(src)), os.path.abspath(os.fsdecode(dst)))
            return f

        def w_unlink(name: str):
            def f(path: Any, *a: Any, dir_fd: int | None = None, **k: Any) -> None:
                p = parent(path, dir_fd)
                real[name](path, *a, dir_fd=dir_fd, **k)
                add("entry", *p)
                add("unlink", *p)
            return f

        def w_sync(name: str):
            def f(fd: int) -> None:
                k = _key(os.fstat(fd))
                real[name](fd)
                add("fsync", k)
            return f

        def w_write(name: str):
            def f(fd: int, *a: Any, **k: Any) -> Any:
                try:
                    key = _key(os.fstat(fd))
                except OSError:
                    key = None
                r = real[name](fd, *a, **k)
                if key is not None:
                    add("write", key)
                return r
            return f

        monkeypatch.setattr(os, "open", w_open)
        monkeypatch.setattr(os, "mkdir", w_mkdir)
        for n in ("rename", "replace"):
            monkeypatch.setattr(os, n, w_rename(n))
        for n in ("unlink", "remove", "rmdir"):
            monkeypatch.setattr(os, n, w_unlink(n))
        for n in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, n, w_sync(n))
        for n in ("write", "pwrite", "pwritev", "ftruncate", "posix_fallocate"):
            monkeypatch.setattr(os, n, w_write(n))

def _state(v: float) -> dict:
    return {"w": torch.full((300_000,), v), "b": torch.arange(10.0) + v, "progress": tg.StateDict(step=int(v))}


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.is_file())


# ---------------------------------------------------------------------------- commit order
@pytest.mark.parametrize("two_files", [False, True])
@pytest.mark.parametrize("async_", [False, True])
def test_save_commits_only_durable_bytes_and_is_durable_when_it_returns(tmp_path, monkeypatch, async_, two_files):
    run = tmp_path / "run"
    run.mkdir()
    if two_files:  # a rank writing >= 64 MiB writes two files in parallel: here from 1 MiB
        monkeypatch.setattr(streams, "TWO_FILES_FROM", 1 << 20)
    rec = Recorder(monkeypatch)
    h = tg.save(run / "step-000000001", _state(1.0), async_=async_)
    if async_:
        h.result()
    done = rec.mark("returned")
    ckpt = run / "step-000000001"
    commit = rec.rename_to(ckpt)
    # When the directory is renamed into place (the manifest becomes visible), every file of it,
    # the manifest included, has its bytes and its entry durable ...
    assert rec.not_durable(ckpt, commit, None) == []
    # ... and the rename itself is durable before the save reports success.
    assert rec.not_durable(ckpt, done, run) == []
    names = {p.name for p in _files(ckpt)}  # the check above covered each of them
    assert {"data-00000.bin", "manifest.json"} <= names
    assert ("data-00000-1.bin" in names) == (two_files and not async_)  # the async path writes one file


def _two_ranks_save(rank: int, world: int, run: str) -> tuple[list[int], list[tuple[Any, ...]]]:
    mp = pytest.MonkeyPatch()
    try:
        rec = Recorder(mp)
        tg.save(os.path.join(run, "step-000000001"), _state(1.0), layout="full")
        rec.mark(f"returned-{rank}")
        return rec.part()
    finally:
        mp.undo()


def test_two_ranks_commit_only_bytes_every_rank_made_durable(tmp_path):
    """Rank 1's data file is fsynced (bytes) by rank 1, and its entry made durable by rank 0's
    fsync of the temp directory, both before rank 0 renames the directory into place; merged on
    the machine's monotonic clock, the two logs are one history to check."""
    from dist_helper import run_ranks

    run = tmp_path / "run"
    run.mkdir()
    res = run_ranks(_two_ranks_save, 2, str(run), timeout=60)
    assert all(r.ok for r in res), [r.error for r in res]
    trace = Trace.merge(*(r.value for r in res))
    ckpt = run / "step-000000001"
    assert {p.name for p in _files(ckpt)} == {"data-00000.bin", "data-00001.bin", "manifest.json"}
    assert trace.not_durable(ckpt, trace.rename_to(ckpt), None) == []
    assert trace.not_durable(ckpt, trace.log.index(("mark", "returned-0")), run) == []


def test_overwrite_keeps_the_old_checkpoint_durable_until_the_new_one_is(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    tg.save(run / "step-000000001", _state(1.0))
    rec = Recorder(monkeypatch)
    tg.save(run / "step-000000001", _state(2.0), overwrite=True)
    done = rec.mark("returned")
    ckpt = run / "step-000000001"
    commit = rec.rename_to(ckpt)
    old = [e for e in rec.log[:commit] if e[0] == "rename" and e[1] == str(ckpt.absolute())]
    assert len(old) == 1 and ".old-" in old[0][2]
    # The old checkpoint was moved aside durably (recovered by the next manager) before the new
    # one took its name, and the new one was complete and durable when it did.
    moved = rec.log.index(old[0])
    assert rec.entry_durable(_key(run.stat()), os.path.basename(old[0][2]), commit)
    assert moved < commit
    assert rec.not_durable(ckpt, commit, None) == []
    assert rec.not_durable(ckpt, done, run) == []


def test_ram_tier_copy_commits_only_durable_bytes(tmp_path, monkeypatch):
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir()
    shm.mkdir()
    rec = Recorder(monkeypatch)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), ram_tier=str(shm), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
        mgr.ram.wait()
        done = rec.mark("persisted")
    ckpt = run / "step-000000001"
    assert rec.not_durable(ckpt, rec.rename_to(ckpt), None) == []
    assert rec.not_durable(ckpt, done, run) == []


def test_consolidate_commits_only_durable_bytes_into_new_directories(tmp_path, monkeypatch):
    tg.save(tmp_path / "src" / "step-000000001", _state(1.0))
    rec = Recorder(monkeypatch)
    dst = tmp_path / "full" / "step-000000001"
    consolidate(str(tmp_path / "src" / "step-000000001"), str(dst))
    done = rec.mark("returned")
    assert rec.not_durable(dst, rec.rename_to(dst), None) == []
    assert rec.not_durable(dst, done, tmp_path) == []


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_replaces_its_output_durably(tmp_path, monkeypatch, suffix):
    tg.save(tmp_path / "step-000000001", {"model": torch.nn.Linear(4, 4)})
    out = tmp_path / f"model{suffix}"
    out.write_bytes(b"an earlier export")
    rec = Recorder(monkeypatch)
    export(str(tmp_path / "step-000000001"), str(out))
    done = rec.mark("returned")
    rename = rec.rename_to(out)
    assert rec.data_durable(_key(out.stat()), rename)  # never a renamed file whose bytes may be lost
    assert rec.not_durable(out, done, tmp_path) == []


# ---------------------------------------------------------------------------- deletion order
def test_retention_removes_the_manifest_durably_before_any_data(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
        victim = _key((run / "step-000000001").stat())
        rec = Recorder(monkeypatch)
        mgr.save(3, _state(3.0))
    assert not (run / "step-000000001").exists()
    gone = [i for i, e in enumerate(rec.log) if e[0] == "unlink" and e[1] == victim]
    assert rec.log[gone[0]][2] == "manifest.json" and len(gone) >= 2
    # The manifest's removal is durable before the first data file goes.
    assert rec.entry_durable(victim, "manifest.json", gone[1])
    # ... and only after step 3 was committed durably.
    commit = rec.rename_to(run / "step-000000003")
    assert commit < gone[0]
    assert rec.not_durable(run / "step-000000003", gone[0], run) == []


# ---------------------------------------------------------------------------- new directories
def test_save_into_new_directories_makes_them_durable(tmp_path, monkeypatch):
    """tg.save into ``a/b/step-1`` creates ``a`` and ``b``: a save that reported success must not
    lose them (and so the checkpoint) to a power loss. Before the fix only ``b`` was fsynced (after
    the rename): the entries of ``a`` in tmp_path and of ``b`` in ``a`` were never made durable."""
    rec = Recorder(monkeypatch)
    ckpt = tmp_path / "a" / "b" / "step-000000001"
    tg.save(ckpt, _state(1.0))
    assert rec.not_durable(ckpt, rec.mark("returned"), tmp_path) == []


def test_manager_run_directory_it_creates_is_durable_before_the_first_save_returns(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    run = tmp_path / "ckpts" / "run1"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
        done = rec.mark("returned")
    assert rec.not_durable(run / "step-000000001", done, tmp_path) == []


def test_a_parent_that_cannot_be_read_does_not_fail_the_save(tmp_path, monkeypatch):
    """A directory one may write into but not read (mode -wx, as root no mode stops this test, so
    its open is refused here) cannot be opened to fsync: a warning, not a failed save."""
    drop = tmp_path / "drop"
    drop.mkdir()
    real_open = os.open

    def refuse(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if os.path.abspath(os.fsdecode(path)) == str(drop) and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse)
    with tg.CheckpointManager(drop / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
    assert (drop / "run" / "step-000000001" / "manifest.json").exists()


def test_a_save_fsyncs_its_run_directory_no_more_than_before(tmp_path, monkeypatch):
    """The temp directory's own entry need not be durable (it is renamed, and that is fsynced):
    making new directories durable costs nothing per save in an existing run directory."""
    run = tmp_path / "run"
    run.mkdir()
    rec = Recorder(monkeypatch)
    tg.save(run / "step-000000001", _state(1.0))
    assert rec.log.count(("fsync", _key(run.stat()))) == 1  # after the rename


# ---------------------------------------------------------------------------- deletion that fails
@pytest.mark.parametrize("fail", ["unlink", "fsync"])
def test_remove_tree_deletes_no_data_while_the_manifest_may_survive(tmp_path, monkeypatch, fail):
    """Retention and debris cleanup delete a checkpoint's manifest first, durably, then its data.
    When the manifest cannot be removed (EIO, EPERM), or its removal cannot be made durable (the
    directory's fsync fails), the data files must stay: deleted, they would leave a manifest (now,
    or back after a power loss) that lists the checkpoint as committed and points at nothing.
    Before the fix both errors were swallowed and the data files removed anyway."""
    ckpt = tmp_path / "step-000000001"
    tg.save(ckpt, _state(1.0))
    data = [p for p in ckpt.iterdir() if p.name != "manifest.json"]
    ckpt_key = _key(ckpt.stat())
    real_unlink, real_fsync = os.unlink, os.fsync

    def unlink(path: Any, *a: Any, **k: Any) -> None:
        if fail == "unlink" and os.path.basename(os.fsdecode(path)) == "manifest.json":
            raise OSError(errno.EIO, "Input/output error", os.fsdecode(path))
        real_unlink(path, *a, **k)

    def fsync(fd: int) -> None:
        if fail == "fsync" and _key(os.fstat(fd)) == ckpt_key:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "fsync", fsync)
    LocalStorage().remove_tree(str(ckpt))
    monkeypatch.undo()
    assert data and all(p.exists() for p in data)
    if fail == "unlink":  # nothing was removed: still a whole checkpoint, retention tries again
        assert tg.verify(ckpt).ok
    LocalStorage().remove_tree(str(ckpt))  # once the disk answers again, it goes
    assert not ckpt.exists()
