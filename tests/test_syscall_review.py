"""An OSError (EIO) at one system call of a save, a load, a manager's open/save/restore/close:
the previous checkpoint stays loadable where it was, the error is a CheckpointError, nothing
leaks, and the next save works. The calls are failed by wrapping ``os`` functions and counting
(``Inject``); the exhaustive sweep over every call is kept out of the suite (bench/.tmp)."""

from __future__ import annotations

import errno
import os
import threading
import warnings

import pytest
import torch

import trainguard as tg


class Inject:
    """Raise ``OSError(err)`` (``err`` an exception class: that) from the ``k``-th call (any thread) of ``os.<name>`` for the names
    in ``funcs`` whose first argument (a path) holds ``match`` and not ``skip``, while the context is entered.
    ``close`` closes first, as Linux does when it reports an error."""

    def __init__(self, funcs: dict[str, int], err: int | type[BaseException] = errno.EIO, match: str = "",
                 skip: str = "\0") -> None:
        self.left = dict(funcs)  # name -> k (1 = its first call)
        self.err, self.match, self.skip = err, match, skip
        self.lock = threading.Lock()
        self.orig: dict[str, object] = {}
        self.hits: list[str] = []

    def _wrap(self, name: str, f):  # noqa: ANN001, ANN202
        def w(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            if not a or self.match not in str(a[0]) or self.skip in str(a[0]):
                return f(*a, **kw)
            with self.lock:
                self.left[name] -= 1
                hit = self.left[name] == 0
            if hit:
                self.hits.append(name)
                if name == "close":
                    f(*a, **kw)
                if isinstance(self.err, type):  # KeyboardInterrupt: Ctrl-C at this call
                    raise self.err()
                raise OSError(self.err, f"{os.strerror(self.err)} (injected: {name})")
            return f(*a, **kw)

        return w

    def __enter__(self) -> Inject:
        for name in self.left:
            self.orig[name] = getattr(os, name)
            setattr(os, name, self._wrap(name, self.orig[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, f in self.orig.items():
            setattr(os, name, f)


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "s": [torch.randn(10, generator=g)], "progress": tg.StateDict(step=step)}


def blank() -> dict:
    return {"w": torch.zeros(300_000), "s": [torch.zeros(10)], "progress": tg.StateDict(step=-1)}


def assert_holds(path: str | os.PathLike[str], step: int) -> None:
    st, want = blank(), state_for(step)
    tg.load(path, st)
    assert torch.equal(st["w"], want["w"]) and torch.equal(st["s"][0], want["s"][0]) and st["progress"]["step"] == step
    assert tg.verify(path).ok


@pytest.mark.parametrize("call", [("rename", 2), ("fsync", 1)])
def test_failed_overwrite_leaves_previous_checkpoint_in_place(tmp_path, call):
    """tg.save(overwrite=True): the previous checkpoint is renamed to ``<name>.old-<id>``, then the
    new one into place. An error in between (the second rename, or the fsync of the parent after
    the first) left ``<name>`` empty: every load of the path failed until someone renamed it back."""
    a = tmp_path / "a"
    tg.save(a, state_for(1))
    # The first rename is a -> a.old-<id>, the second a.tmp-<id> -> a. The fsync failed is the
    # parent's right after the first rename (armed by it: a count alone would hit a data file).
    name, k = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "rename":
            with Inject({"rename": k}, match=str(tmp_path)), pytest.raises(tg.CheckpointError, match="failed"):
                tg.save(a, state_for(2), overwrite=True)
        else:
            orig_rename = os.rename
            moved = []

            def rename(src, dst, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
                orig_rename(src, dst, *a, **kw)
                moved.append(dst)
                if ".old-" in str(dst):  # the parent's fsync right after this rename fails
                    inj.__enter__()

            inj = Inject({"fsync": 1})
            os.rename = rename
            try:
                with pytest.raises(tg.CheckpointError, match="failed"):
                    tg.save(a, state_for(2), overwrite=True)
            finally:
                os.rename = orig_rename
                inj.__exit__()
            assert inj.hits == ["fsync"]
    assert_holds(a, 1)  # still there, bit for bit
    assert sorted(os.listdir(tmp_path)) == ["a"]  # the temp directory removed, nothing set aside left
    tg.save(a, state_for(3), overwrite=True)  # the next save works
    assert_holds(a, 3)
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_listing_error_of_managed_save_is_a_checkpoint_error_and_warn_continues(tmp_path):
    """The save's first look into its target (``commit.occupied``: a listing) failing with EIO
    escaped one process as a bare OSError: ``on_error="warn"`` (which catches CheckpointError)
    did not apply, and the training loop died on a save the manager promised to only warn about."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
        with Inject({"listdir": 1}, match="step-000000002"), pytest.warns(UserWarning, match="step-000000002"):
            assert mgr.save(2, state_for(2)) is None  # warned, training goes on
        mgr.save(3, state_for(3))  # the next save works
    with Inject({"listdir": 1}, match=str(tmp_path / "b")), pytest.raises(tg.CheckpointError, match="Input/output"):
        tg.save(tmp_path / "b", state_for(1))  # tg.save: a CheckpointError too, naming the path
    assert_holds(run / "step-000000003", 3)
    assert_holds(run / "step-000000001", 1)


def test_stat_error_at_open_never_deletes_a_committed_checkpoint(tmp_path):
    """A manager's open removes step directories without a manifest (debris of crashed saves). Whether
    the manifest is there was asked with os.path.exists, which answers False on any OSError: one EIO
    on the stat of a committed step's manifest.json, and open deleted that checkpoint."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    (run / "step-000000003").mkdir()  # debris: a step directory without a manifest
    with Inject({"stat": 1}, match="step-000000002/manifest.json"), pytest.raises(tg.CheckpointError, match="Input/output"):
        tg.CheckpointManager(run, handle_signals=False).open()
    assert_holds(run / "step-000000002", 2)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:  # the next start works
        st = blank()
        assert mgr.restore(st) == 2
        mgr.save(3, state_for(3))
    assert_holds(run / "step-000000003", 3)
    assert_holds(run / "step-000000001", 1)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("cold", [False, True])
def test_load_failing_at_fstat_or_close_leaks_no_descriptor(tmp_path, monkeypatch, cold):
    """An fstat that fails after a checkpoint file was opened (the regular-file check, the page-cache
    probe, the O_DIRECT descriptor's inode check: EIO, or ESTALE on NFS) left that descriptor open;
    a close that reported an error (Linux releases the number anyway) skipped the reader's other
    descriptor and every later reader's. A job that retries its restore leaked one or two a try."""
    from trainguard.storage import _pagecache

    # Cold: not in the page cache, a second (O_DIRECT) descriptor is opened; hot: one. The probe
    # keeps its fstat (one of the calls failed below).
    monkeypatch.setattr(_pagecache, "cached_fraction", lambda fd: os.fstat(fd) and (0.0 if cold else 1.0))
    a = tmp_path / "a"
    tg.save(a, state_for(1))
    tg.load(a, blank())  # warm up (imports, thread pools, bounce buffers)
    hit = []
    for name, k in [("fstat", k) for k in range(1, 8)] + [("close", k) for k in range(1, 5)]:
        before = _open_fds()
        with Inject({name: k}) as inj:
            try:
                tg.load(a, blank())
            except (OSError, tg.CheckpointError):
                pass
        hit += inj.hits
        assert _open_fds() == before, f"{name} #{k} leaked {_open_fds() - before} descriptor(s)"
    assert hit.count("fstat") >= (5 if cold else 4) and hit.count("close") >= (2 if cold else 1)
    assert_holds(a, 1)


def test_io_error_reading_a_checkpoint_is_a_checkpoint_error_and_restore_falls_back(tmp_path, caplog):
    """An I/O error reading a checkpoint (EIO at the open or the read of its data file) escaped
    tg.load and CheckpointManager.restore as a bare OSError, and verify raised it instead of
    reporting: a restarted job whose newest checkpoint sits on a failing sector crashed at every
    restart, though an older checkpoint that verifies was there. Now tg.load raises a
    CorruptCheckpointError naming the checkpoint, verify reports it, and restore falls back."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    bad = run / "step-000000002"
    with Inject({"open": 1}, match="step-000000002/data"), pytest.raises(tg.CorruptCheckpointError, match="step-000000002"):
        tg.load(bad, blank())
    with Inject({"open": 1}, match="step-000000002/data"):
        report = tg.verify(bad)
    assert not report.ok and "Input/output" in report.errors[0]
    with Inject({"preadv": 1}):  # the first read of step 2's data (the manifest is read by os.read)
        report = tg.verify(bad)
    assert not report.ok and "data-00000.bin" in report.errors[0] and "Input/output" in report.errors[0]
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        st = blank()
        with Inject({"open": 1}, match="step-000000002/data"):
            assert mgr.restore(st) == 1  # the newest that can be read
        assert torch.equal(st["w"], state_for(1)["w"]) and st["progress"]["step"] == 1
        assert "step 2" in caplog.text and "Input/output" in caplog.text
        mgr.save(2, state_for(2))  # training goes on from step 1; its step 2 replaces the unreadable one
    assert_holds(bad, 2)



def test_an_error_of_the_process_not_the_medium_reading_the_newest_checkpoint_is_raised_not_skipped(tmp_path):
    """EACCES (a remount without permission), EMFILE, ESTALE: not the checkpoint's fault, likely
    gone at the next start. Falling back to an older checkpoint would make this run's first save
    remove the newer one (the restored step is then a rollback): restore raises it instead."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        with Inject({"open": 1}, errno.EACCES, match="step-000000002/data"), pytest.raises(tg.CheckpointError) as raised:
            mgr.restore(blank())
        assert not isinstance(raised.value, tg.CorruptCheckpointError) and "step-000000002" in str(raised.value)
        st = blank()
        assert mgr.restore(st) == 2  # the cause gone: the newest loads
    assert_holds(run / "step-000000002", 2)


@pytest.mark.parametrize("name", ["ftruncate", "pwrite", "fsync"])
def test_run_lock_failing_to_write_its_holder_leaks_no_descriptor(tmp_path, name):
    """The manager's lock file is locked, then its holder info written (ftruncate, pwrite, fsync).
    An I/O error there failed open with CheckpointError but left the descriptor open, and with
    it the POSIX lock, for as long as the process lived (a job that retried open held its own
    run directory against the next job). At close, an error truncating it escaped close() as a
    bare OSError."""
    run = tmp_path / "run"
    run.mkdir()
    before = _open_fds()
    with Inject({name: 1}), pytest.raises(tg.CheckpointError, match="Input/output"):
        tg.CheckpointManager(run, handle_signals=False).open()
    assert _open_fds() == before
    mgr = tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False).open()
    mgr.save(1, state_for(1))
    with Inject({"ftruncate": 1}):
        mgr.close()  # the holder info is advisory: its truncation failing is no error of close()
    assert _open_fds() == before
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.restore(blank()) == 1


def test_ctrl_c_in_open_write_or_close_leaves_no_lock_nor_descriptor(tmp_path):
    """KeyboardInterrupt at a system call of the main thread. In a manager's open after the lock was
    taken (the debris cleanup), the lock stayed held: the next manager on the directory in that
    process (a notebook, a retry loop) got LockedError 'already used by another CheckpointManager
    in this process' for good. In the lock's own reads, the O_DIRECT open of a data file, and the
    manifest's write, the descriptor already open leaked (and the manifest's temp file stayed)."""
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
    before = _open_fds()
    for call in [{"listdir": 1}, {"pread": 1}]:  # clean_debris's listing; the lock's holder read
        with Inject(call, err=KeyboardInterrupt) as inj, pytest.raises(KeyboardInterrupt):
            tg.CheckpointManager(run, handle_signals=False).open()
        assert inj.hits and _open_fds() == before
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:  # not LockedError
        assert mgr.restore(blank()) == 1
    for call in [{"open": 2}, {"write": 1}]:  # the data file's O_DIRECT descriptor; the manifest's bytes
        with Inject(call, err=KeyboardInterrupt, match="" if "open" not in call else "b.tmp-") as inj:
            with pytest.raises(KeyboardInterrupt):
                tg.save(tmp_path / "b", state_for(2))
        assert inj.hits and _open_fds() == before, call
        assert not [n for d, _, files in os.walk(tmp_path) for n in files if "manifest.json.tmp-" in n]
        assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]  # nor the save's temp directory
    tg.save(tmp_path / "b", state_for(2))  # the next save works
    assert_holds(tmp_path / "b", 2)


@pytest.mark.parametrize("call", [{"open": 1}, {"fsync": 1}])
def test_consolidate_failing_leaves_no_temp_directory(tmp_path, call):
    """consolidate created its temp directory (``full.tmp-<id>``: no manager cleans that name) and
    opened its data file outside the block that removes it on failure: an EIO at the data file's
    open, or at the fsync of the parent that makes the new directory durable, left the directory
    for good, and the error came out as a bare OSError (a traceback from ``trainguard consolidate``)."""
    from trainguard.consolidate import consolidate

    a = tmp_path / "a"
    tg.save(a, state_for(1))
    if "fsync" in call:  # the parent's fsync of a new directory: armed right after the temp directory is made
        orig_mkdir = os.mkdir

        def mkdir(path, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            orig_mkdir(path, *args, **kw)
            if "full.tmp-" in str(path):
                inj.__enter__()

        inj = Inject(call)
        os.mkdir = mkdir
        try:
            with pytest.raises(tg.CheckpointError, match="Input/output"):
                consolidate(a, tmp_path / "full")
        finally:
            os.mkdir = orig_mkdir
            inj.__exit__()
    else:
        # not the writer's owner file (full.tmp-<id>.owner, best effort since session 58's outtemp.py): its data file
        with Inject(call, match="full.tmp-", skip=".owner") as inj, pytest.raises(tg.CheckpointError, match="Input/output"):
            consolidate(a, tmp_path / "full")
    assert inj.hits and sorted(os.listdir(tmp_path)) == ["a"]
    consolidate(a, tmp_path / "full")
    assert_holds(tmp_path / "full", 1)


def test_remove_tree_never_raises_when_closing_a_directory_fails(tmp_path):
    """``_durable.remove_tree`` promises never to raise (callers run it on error paths, after
    another error): shutil.rmtree(ignore_errors=True) still raised a directory descriptor's
    failed close (EIO) in Python 3.11 (seen in the syscall sweep of an overwrite)."""
    from trainguard.storage import _durable

    for k in (2, 3):  # rmtree's closes (1: the fsync of the directory after the manifest's unlink)
        d = tmp_path / f"c{k}"
        (d / "sub").mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
        (d / "sub" / "data-00000.bin").write_bytes(b"x")
        with Inject({"close": k}) as inj:
            _durable.remove_tree(str(d))
        assert inj.hits == ["close"] and not (d / "manifest.json").exists()
