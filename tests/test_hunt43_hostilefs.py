"""Hunt 43 (hostile file systems and paths): regressions found by running trainguard on paths and
directories that are not a plain ext4 directory of the user's own."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import trainguard as tg


def _state(v: float = 1.0) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "progress": tg.StateDict(step=0)}


def test_dotdot_after_a_symlink_resolves_as_the_kernel_does(tmp_path):
    """``link/../run`` with ``link`` a symbolic link names the run in the link target's parent (``ls``,
    ``cp``, ``torch.save`` of that path), but ``os.path.abspath`` dropped ``link/..`` by the letters:
    trainguard wrote the checkpoints into the working directory instead, maybe on another file system."""
    real = tmp_path / "lustre" / "user"
    real.mkdir(parents=True)
    work = tmp_path / "home"
    work.mkdir()
    (work / "scratch").symlink_to(real)
    run = os.path.join(str(work / "scratch"), "..", "run")
    one = os.path.join(str(work / "scratch"), "..", "one")
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
    tg.save(one, _state(2.0))
    torch.save({"x": 1}, os.path.join(str(work / "scratch"), "..", "torch.pt"))
    # Where the kernel puts `scratch/..`: next to torch.save's file, not in the directory holding the link.
    assert sorted(os.listdir(tmp_path / "lustre")) == ["one", "run", "torch.pt", "user"]
    assert sorted(os.listdir(work)) == ["scratch"]
    assert tg.verify(os.path.join(run, "step-000000001")).ok
    dst = _state(0.0)
    tg.load(one, dst)
    assert torch.equal(dst["model"]["w"], torch.full((64,), 2.0))
    fresh = _state(0.0)
    with tg.CheckpointManager(tmp_path / "lustre" / "run", handle_signals=False) as mgr:
        assert mgr.restore(fresh) == 1
    assert torch.equal(fresh["model"]["w"], torch.full((64,), 1.0))


def _another_users_dir(base, monkeypatch):
    """``base/trainguard-ram-<uid>`` made (mode 0777) by another user than the current one: chowned to
    ``nobody`` as root, else the current user is made to look like another uid first."""
    if os.getuid() != 0:  # pragma: no cover - CI runs as root
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
    path = base / f"trainguard-ram-{os.getuid()}"
    path.mkdir()
    os.chmod(path, 0o777)
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
    return path


def test_ram_tier_refuses_a_user_directory_made_by_another_user(tmp_path, monkeypatch):
    """The RAM tier lives at ``<base>/trainguard-ram-<uid>``, a name known in advance in a directory every
    user may write (``/dev/shm``). Another user who made it first (mode 0777) could read the job's RAM
    copies and plant a newer step there: ``restore`` loaded it (it prefers the RAM tier) and copied it into
    the run directory. Now the manager's open refuses such a directory and touches nothing in it."""
    base = tmp_path / "shm"
    base.mkdir()
    os.chmod(base, 0o1777)
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
    user_dir = _another_users_dir(base, monkeypatch)
    planted = user_dir / "planted"
    tg.save(planted, _state(-1.0))
    mgr = tg.CheckpointManager(run, save=tg.EveryNSteps(1), ram_tier=str(base), handle_signals=False)
    try:
        mgr.open()
    except tg.CheckpointError as e:
        assert "not a directory of this user" in str(e) and str(user_dir) in str(e), e
    else:
        mgr.close()
        raise AssertionError("a RAM tier directory of another user was used")
    assert sorted(os.listdir(user_dir)) == ["planted"]  # nothing written or removed there
    assert sorted(n for n in os.listdir(run) if n.startswith("step-")) == ["step-000000001"]


def test_ram_tier_user_directory_is_private(tmp_path):
    """Its checkpoints were readable by every user of the node (0755 directories, 0644 files under the
    world-writable ``/dev/shm``); the per-user directory is now 0700, also one an earlier version made 0755."""
    base = tmp_path / "shm"
    base.mkdir()
    user_dir = base / f"trainguard-ram-{os.getuid()}"
    user_dir.mkdir(mode=0o755)
    os.chmod(user_dir, 0o755)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), ram_tier=str(base), handle_signals=False) as mgr:
        mgr.save(1, _state(3.0))
        assert os.stat(user_dir).st_mode & 0o777 == 0o700
        mgr.close(keep_ram_tier=True)
    assert os.stat(user_dir).st_mode & 0o777 == 0o700
    fresh = _state(0.0)
    with tg.CheckpointManager(tmp_path / "run", ram_tier=str(base), handle_signals=False) as mgr:
        assert mgr.restore(fresh) == 1
    assert torch.equal(fresh["model"]["w"], torch.full((64,), 3.0))


def test_ram_copy_of_a_deleted_run_that_cannot_be_removed_fails_open(tmp_path, monkeypatch):
    """A RAM copy of a run directory deleted since (the user starts over) is removed at open. When its
    removal is refused (EACCES unlinking its manifest: ``LocalStorage.remove_tree`` warns and goes on),
    the open went on, wrote the new run's id into the RAM tier, and the copy became the new run's:
    ``restore`` of the fresh run returned the deleted run's step (one that never reached disk) and copied
    it into the new run directory. docs/storage.md promised that the open fails; now it does."""
    import glob
    import shutil

    base, root = tmp_path / "shm", tmp_path / "run"
    base.mkdir()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(base), handle_signals=False) as mgr:
        mgr.save(3, _state(3.0))
        mgr.close(keep_ram_tier=True)
    (marker,) = glob.glob(str(base / "trainguard-ram-*" / "*" / ".trainguard-on-disk"))
    os.unlink(marker)  # as if the job was killed before its copy of step 3 reached the run directory
    shutil.rmtree(root)  # the user starts over
    real_unlink = os.unlink

    def refused(path, *a, **kw):
        p = os.fsdecode(path)
        if p.startswith(str(base)) and p.endswith(os.path.join("step-000000003", "manifest.json")):
            raise PermissionError(13, "Permission denied", p)
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", refused)
    fresh = _state(0.0)
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(base), handle_signals=False)
    try:
        mgr.open()
        got = mgr.restore(fresh)
    except tg.CheckpointError as e:
        assert "step-000000003" in str(e) and "could not be removed" in str(e), e
    else:
        mgr.close()
        raise AssertionError(f"the new run restored {got} from the deleted run's RAM copy")
    assert torch.equal(fresh["model"]["w"], torch.zeros(64))
    assert not [n for n in os.listdir(root) if n.startswith("step-")]
    monkeypatch.setattr(os, "unlink", real_unlink)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(base), handle_signals=False) as mgr:
        assert mgr.restore(fresh) is None  # removable now: discarded, a fresh start


def test_debris_that_cannot_be_removed_is_not_reported_removed(tmp_path, monkeypatch, caplog):
    """A crashed save's temp directory whose files cannot be removed (a directory chmod 555 by another
    user, an NFS ``.nfsXXXX`` file still open: EACCES, EBUSY) stayed, silently (``rmtree(ignore_errors=
    True)``), while the open's warning and its ``debris`` event said it was removed, at every open."""
    import json
    import logging

    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, _state(1.0))
    debris = root / "step-000000002.tmp-0123456789abcdef"
    debris.mkdir()
    (debris / "data-00000.bin").write_bytes(b"x" * 100)
    real_unlink = os.unlink

    def busy(path, *a, **kw):
        if os.fsdecode(path) in ("data-00000.bin", str(debris / "data-00000.bin")):
            raise OSError(16, "Device or resource busy", os.fsdecode(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", busy)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            pass
    assert debris.exists()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "removed debris" not in said, said
    assert "could not remove" in said and str(debris) in said, said
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("event") == "debris"], events
    monkeypatch.setattr(os, "unlink", real_unlink)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            pass
    assert not debris.exists()  # left for the next cleanup, which removed it
    assert "removed debris" in " ".join(r.getMessage() for r in caplog.records)


def test_doctor_judges_the_directory_the_manager_writes_to_not_an_expanded_home(tmp_path, monkeypatch):
    """``CheckpointManager("~/ckpts")`` wrote to ``./~/ckpts`` (``~`` is not expanded; refused since session 46), but ``doctor`` expanded it and judged the home directory's file system: "ok, on
    ext4" for checkpoints that went to a tmpfs or a container's overlay under the working directory."""
    from trainguard.doctor import Settings, check

    home, work = tmp_path / "home", tmp_path / "job"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    mounts = (f"1 0 0:1 / / rw - ext4 /dev/vda rw\n"
              f"2 1 0:2 / {home} rw - lustre fs rw\n"
              f"3 1 0:3 / {work} rw - tmpfs tmpfs rw\n")
    state = {"model": torch.nn.Linear(2, 2)}
    with pytest.raises(tg.CheckpointError, match="does not expand"):  # session 46: refused, it wrote to ./~/ckpts
        tg.CheckpointManager("~/ckpts", save=tg.EveryNSteps(1), handle_signals=False)
    assert not (work / "~").exists()
    (f,) = [f for f in check(state, Settings(root="~/ckpts", mountinfo=mounts)) if f.check == "storage"]
    assert f.severity == "error" and "tmpfs" in f.message and str(work / "~" / "ckpts") in f.message, f
    assert "expanduser" in f.fix
    (f,) = [f for f in check(state, Settings(root=str(home / "ckpts"), mountinfo=mounts)) if f.check == "storage"]
    assert f.severity == "ok" and "lustre" in f.message
    mounts_ok = mounts.replace("- tmpfs tmpfs", "- ext4 /dev/vdb")
    (f,) = [f for f in check(state, Settings(root="~/ckpts", mountinfo=mounts_ok)) if f.check == "storage"]
    assert f.severity == "error" and "does not expand" in f.message, f  # the manager refuses it (session 46)


def _mount_ext2(img, mnt) -> bool:
    """A 32 MiB ext2 file system (no fallocate(2): EOPNOTSUPP) loop-mounted at ``mnt``; False when this
    machine cannot (not root, no mkfs.ext2, no loop device)."""
    import shutil
    import subprocess

    if os.getuid() != 0 or shutil.which("mkfs.ext2") is None:
        return False
    with open(img, "wb") as f:
        f.truncate(32 << 20)
    mnt.mkdir()
    if subprocess.run(["mkfs.ext2", "-q", "-F", str(img)], capture_output=True, timeout=60).returncode:
        return False
    return subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, timeout=60).returncode == 0


def test_direct_writer_does_not_emulate_fallocate_on_a_file_system_without_it(tmp_path):
    """``reserve`` called ``os.posix_fallocate``: on a file system without fallocate (ext2, vfat, NFSv3, many
    FUSE mounts) glibc emulates it by writing a zero byte into every 4 KiB block through the page cache, so
    every direct save wrote its bytes twice (a 500 MB save on ext2: 2.6-3.6 s against 0.75-0.89 s without;
    48,828 one-byte pwrites for 200 MB). fallocate(2) says EOPNOTSUPP there and nothing is written."""
    import subprocess

    import pytest

    from trainguard.storage import LocalStorage

    mnt = tmp_path / "ext2"
    if not _mount_ext2(tmp_path / "ext2.img", mnt):
        pytest.skip("cannot make and mount an ext2 file system here")
    try:
        w = LocalStorage().open_write(str(mnt / "f"), direct=True)
        try:
            if not w.direct_ok:
                pytest.skip("this ext2 refuses O_DIRECT")
            w.reserve(8 << 20)
            assert os.stat(mnt / "f").st_blocks == 0  # the emulation had allocated and written every block
        finally:
            w.abort()  # its descriptors closed: else the umount fails (busy)
        state = {"w": torch.randn(2 << 20)}
        tg.save(mnt / "ck", state)
        out = {"w": torch.zeros(2 << 20)}
        tg.load(mnt / "ck", out)
        assert torch.equal(out["w"], state["w"])
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)


def test_reserve_allocates_where_supported_without_posix_fallocate(tmp_path, monkeypatch):
    """Where the file system has fallocate (ext4, xfs, tmpfs), ``reserve`` still allocates up front (a full
    disk found before any byte is written), through the system call, not glibc's emulating wrapper."""
    import pytest

    from trainguard.storage import LocalStorage

    def emulating(*a):
        raise AssertionError("os.posix_fallocate emulates fallocate by writing every block where it is missing")

    monkeypatch.setattr(os, "posix_fallocate", emulating)
    w = LocalStorage().open_write(str(tmp_path / "f"), direct=True)
    if not w.direct_ok:
        pytest.skip("this file system refuses O_DIRECT")
    w.reserve(8 << 20)
    assert os.stat(tmp_path / "f").st_size == 8 << 20
    assert os.stat(tmp_path / "f").st_blocks * 512 >= 8 << 20
    w.abort()


@contextlib.contextmanager
def _tmpfs(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (made) for the block; the test is skipped where mounting is not allowed."""
    import subprocess

    import pytest

    path.mkdir()
    if os.getuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                          capture_output=True, timeout=60).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=60)


def test_disk_full_through_fsspec_local_names_no_none(tmp_path):
    """A save through fsspec (``local://`` here; any store whose file object writes to a disk) that runs out
    of space raised "no space left on device creating None": its write error names no file."""

    import pytest

    pytest.importorskip("fsspec")
    fs = tmp_path / "fs"
    with _tmpfs(fs, "4m"):
        with pytest.raises(tg.DiskFullError) as ei:
            tg.save(f"local://{fs}/ck", {"w": torch.zeros(2 << 20)})  # 8 MiB
        msg = str(ei.value)
        assert "no space left" in msg and "None" not in msg, msg
        assert not os.path.exists(fs / "ck" / "manifest.json")


def test_save_to_a_mount_point_is_refused_before_writing(tmp_path):
    """``tg.save("/ckpt", state)`` with a volume mounted at ``/ckpt`` (a container's, a Kubernetes PVC's) wrote
    the whole checkpoint into ``/ckpt.tmp-<id>`` on the file system holding the mount point, then failed with
    "OSError: [Errno 16] Device or resource busy" renaming the mount point. Now it is refused up front,
    saying what to do; a manager whose run directory is the mount point is fine."""

    import pytest

    vol = tmp_path / "vol"
    with _tmpfs(vol, "16m"):
        for overwrite in (False, True):
            with pytest.raises(tg.CheckpointError, match="is a mount point") as ei:
                tg.save(vol, _state(1.0), overwrite=overwrite)
            assert "Device or resource busy" not in str(ei.value)
            assert sorted(os.listdir(tmp_path)) == ["vol"] and os.listdir(vol) == []
        tg.save(vol / "ckpt", _state(2.0))  # what the message says to do
        with tg.CheckpointManager(vol, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            mgr.save(1, _state(3.0))
        assert tg.verify(vol / "step-000000001").ok and tg.verify(vol / "ckpt").ok
