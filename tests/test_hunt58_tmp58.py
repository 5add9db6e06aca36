"""Hunt 58 (tmp58): temporary outputs of ``export``/``convert``/``consolidate`` that a killed writer left.

- A writer SIGKILLed mid-write left ``.NAME.tmp-<id>`` (export, convert to a file or DCP) or ``NAME.tmp-<id>``
  (consolidate) beside the target for good (GBs each, one per retry). The next write of the same target now removes
  those of dead writers (``outtemp``: each writer holds a locked owner file), and leaves a live writer's.
- One it cannot tell (no owner file; another host's on a network file system) is left with a warning naming it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.consolidate import consolidate
from trainguard.convert import convert
from trainguard.export import export

SRC = str(Path(__file__).resolve().parents[1] / "src")

try:
    from test_storage_s3 import weed  # noqa: F401  (the session's SeaweedFS server)
except BaseException:  # noqa: BLE001 - pytest's Skipped: no `weed` binary; only the S3 test skips

    @pytest.fixture
    def weed() -> None:
        pytest.skip("SeaweedFS `weed` binary not installed")

# Three writers, each stopped after its bytes are written and before its rename (the output's commit); then
# "ready" on stdout, and a wait on stdin that only the parent's SIGKILL ends.
_CHILD = textwrap.dedent("""
    import sys, threading
    import torch.distributed.checkpoint as dcp
    import trainguard.api as api
    import trainguard.consolidate as cons
    import trainguard.stwrite as stwrite
    from trainguard.consolidate import consolidate
    from trainguard.convert import convert
    from trainguard.export import export
    from trainguard.storage.local import LocalStorage

    ck, out = sys.argv[1], sys.argv[2]
    written = threading.Semaphore(0)
    forever = threading.Event()

    def stop_after(real):
        def f(*a, **k):
            got = real(*a, **k)
            written.release()
            forever.wait()
            return got
        return f

    stwrite.write = stop_after(stwrite.write)
    dcp.save = stop_after(dcp.save)
    real_commit, real_rename = cons.commit_dir, LocalStorage.rename_dir
    cons.commit_dir = lambda st, parent, name, *a: (stop_after(lambda: None)() if name.startswith("step-")
                                                    else real_commit(st, parent, name, *a))
    api.commit_dir = stop_after(lambda *a: None)
    LocalStorage.rename_dir = lambda st, a, b: (stop_after(real_rename) if ".old-" in b else real_rename)(st, a, b)
    for fn in (lambda: export(ck, out + "/m.safetensors"), lambda: convert(ck, out + "/m.dcp", dst_format="dcp"),
               lambda: consolidate(ck, out + "/run/step-000000003"),
               lambda: consolidate(ck, out + "/over", overwrite=True),  # stopped between its two renames
               lambda: convert(sys.argv[3], out + "/imp")):  # a plain tg.save: stopped before its commit
        threading.Thread(target=fn, daemon=True).start()
    for _ in range(5):
        if not written.acquire(timeout=120):
            sys.exit("a writer did not get to its rename")
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("src") / "step-000000003")
    tg.save(d, {"model": torch.nn.Linear(8, 4)})
    return d


def _weight(path: Path | str) -> torch.Tensor:
    m = torch.nn.Linear(8, 4)
    tg.load(str(path), {"model": m})
    return m.weight.detach().clone()


def _temps(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp-" in n) + sorted(n for n in os.listdir(d / "run") if ".tmp-" in n)


def _open_close(run: Path) -> None:
    tg.CheckpointManager(str(run), handle_signals=False).open().close()


def test_killed_writers_temps_removed_by_next_write_live_ones_left(ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)
    tg.save(str(tmp_path / "before"), {"model": torch.nn.Linear(8, 4)})
    consolidate(tmp_path / "before", out / "over")  # the output an overwrite killed between its renames set aside
    before = _weight(out / "over")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    export(ckpt, tmp_path / "src.pt")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, ckpt, str(out), str(tmp_path / "src.pt")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 180)  # bounded: the handshake, not a sleep
        assert ready and child.stdout.readline() == b"ready\n", child.poll()
        left = _temps(out)
        assert len([n for n in left if not n.endswith(".owner")]) == 5, left  # over.old-<id> and 4 temps
        assert "over" not in os.listdir(out)
        # A live writer's temporary output stays while another writer of the same target goes on, and while a
        # manager opens the run directory it consolidates into (its debris cleanup: the run lock is not its).
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no warning: it is known to be alive
            export(ckpt, out / "m.safetensors")
            _open_close(out / "run")
        assert _temps(out) == left
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
    assert _temps(out) == left  # SIGKILL: nothing ran to remove them
    # The overwrite's previous output is put back whole (before: left aside as over.old-<id> for good).
    with pytest.raises(tg.StepExistsError, match="--overwrite"):
        consolidate(ckpt, out / "over")
    assert torch.equal(_weight(out / "over"), before)
    consolidate(ckpt, out / "over", overwrite=True)
    convert(tmp_path / "src.pt", out / "imp")
    export(ckpt, out / "m.safetensors")
    convert(ckpt, out / "m.dcp", dst_format="dcp")
    _open_close(out / "run")  # the manager's cleanup: a dead consolidate's directory, and its owner file
    assert _temps(out) == []
    consolidate(ckpt, out / "run" / "step-000000003")
    assert sorted(os.listdir(out)) == ["imp", "m.dcp", "m.safetensors", "over", "run"]
    assert sorted(os.listdir(out / "run")) == [".lock", "events.jsonl", "step-000000003"]
    assert torch.equal(_weight(out / "run" / "step-000000003"), _weight(Path(ckpt)))
    assert torch.equal(_weight(out / "over"), _weight(Path(ckpt)))


def test_unknown_writer_left_with_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard import outtemp

    target = str(tmp_path / "m.pt")
    old = tmp_path / ".m.pt.tmp-0123456789ab"  # no owner file: a writer of an earlier trainguard, maybe alive
    old.write_bytes(b"x")
    other = tmp_path / ".m.pt.tmp-aaaaaaaaaaaa"  # an owner of another host, its lock free
    other.write_bytes(b"y")
    (tmp_path / ".m.pt.tmp-aaaaaaaaaaaa.owner").write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": 0}))
    monkeypatch.setattr(outtemp, "_local_fs", lambda p: False)  # a network file system: its locks may be local
    with pytest.warns(UserWarning) as rec:
        assert outtemp.sweep(target) == []
    text = " ".join(str(w.message) for w in rec)
    assert str(old) in text and str(other) in text and "rm -rf" in text and "elsewhere" in text
    assert old.exists() and other.exists()
    monkeypatch.undo()  # a local file system: another host's free lock is a dead writer's
    with pytest.warns(UserWarning, match="no owner file"):
        assert outtemp.sweep(target) == [str(other)]
    assert not other.exists() and not (tmp_path / ".m.pt.tmp-aaaaaaaaaaaa.owner").exists()


def test_same_host_dead_pid_removed_without_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount without locks (F_GETLK fails): a record of this host whose pid is gone is a dead writer's."""
    from trainguard import outtemp

    d = tmp_path / "full.tmp-00000000000000aa"
    d.mkdir()
    (d / "data-00000.bin").write_bytes(b"z")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (tmp_path / (d.name + ".owner")).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                            "since": 0}))
    monkeypatch.setattr(outtemp, "_held", lambda fd: None)
    assert outtemp.sweep(str(tmp_path / "full")) == [str(d)]
    assert os.listdir(tmp_path) == []


def test_convert_to_dcp_on_a_full_disk_says_so(ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's torch.save of an item turns ENOSPC into "[enforce fail at inline_container.cc:672] . unexpected pos":
    before, `convert --to dcp` onto a full disk said only that. A full disk simulated: each write past the first
    64 bytes of a file raises ENOSPC, and the file system reports no free space."""
    import errno
    import shutil

    from torch.distributed.checkpoint.filesystem import FileSystem

    class Full:
        def __init__(self, f: object) -> None:
            self.f, self.n = f, 0

        def write(self, b: bytes) -> int:
            self.n += len(b)
            if self.n > 64:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)  # type: ignore[attr-defined]

        def __getattr__(self, k: str) -> object:
            return getattr(self.f, k)

    real = FileSystem.create_stream

    @__import__("contextlib").contextmanager
    def full_stream(self, path, mode):  # type: ignore[no-untyped-def]
        with real(self, path, mode) as f:
            yield Full(f)

    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(FileSystem, "create_stream", full_stream)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: free._replace(free=0))
    out = tmp_path / "m.dcp"
    with pytest.raises(tg.DiskFullError, match="no space left on device"):
        convert(ckpt, out, dst_format="dcp")
    assert os.listdir(tmp_path) == []


def test_read_only_file_system_named(ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A destination on a read-only mount (root too: EROFS, not EACCES). Before, consolidate and convert's import
    said "OSError: [Errno 30] Read-only file system: '<dst>.tmp-<id>'" (a temporary name, nothing to change),
    export "this user may not write in DIR". A read-only mount simulated: creating anything in it is EROFS."""
    import errno

    ro = tmp_path / "ro"
    ro.mkdir()
    export(ckpt, tmp_path / "src.pt")
    real_open, real_mkdir, real_statvfs, real_access = os.open, os.mkdir, os.statvfs, os.access

    def inside(p: object) -> bool:
        return os.path.abspath(os.fsdecode(p)).startswith(str(ro) + os.sep)  # type: ignore[arg-type]

    def erofs(p: object) -> OSError:
        return OSError(errno.EROFS, "Read-only file system", os.fsdecode(p))  # type: ignore[arg-type]

    def fake_open(p, flags, *a, **k):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT and inside(p):
            raise erofs(p)
        return real_open(p, flags, *a, **k)

    def fake_mkdir(p, *a, **k):  # type: ignore[no-untyped-def]
        if inside(p):
            raise erofs(p)
        return real_mkdir(p, *a, **k)

    class RoStat:
        def __init__(self, st: os.statvfs_result) -> None:
            self.st = st
            self.f_flag = st.f_flag | os.ST_RDONLY

        def __getattr__(self, k: str) -> object:
            return getattr(self.st, k)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "statvfs", lambda p: RoStat(real_statvfs(p)) if os.fspath(p) == str(ro) else real_statvfs(p))
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if os.fspath(p) == str(ro) and m & os.W_OK
                        else real_access(p, m, **k))
    for f in (lambda: export(ckpt, ro / "m.pt"), lambda: consolidate(ckpt, ro / "full"),
              lambda: convert(Path(ckpt), ro / "imp.dcp", dst_format="dcp"), lambda: convert(tmp_path / "src.pt", ro / "imp")):
        with pytest.raises(tg.CheckpointError, match=f"{ro} is on a read-only file system"):
            f()
    assert os.listdir(ro) == []



def test_consolidate_onto_s3_aborts_a_killed_writers_idle_upload(ckpt: str, weed, monkeypatch, caplog) -> None:  # noqa: F811
    """A consolidate (or plain tg.save) to S3 killed mid-upload left an incomplete multipart upload under its
    destination: parts billed, no object, and no manager's open looks there. The next write of that destination aborts
    it once idle (``_stale``); one active within the idle limit (maybe a live writer's) is left, with a warning saying
    how to abort it. The uploads are made as a killed writer leaves them."""
    import logging
    import uuid

    import s3fs

    from trainguard.storage import _stale

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    base = uuid.uuid4().hex[:10]

    def upload(name: str) -> str:
        key = f"{base}/{name}/data-00000.bin"
        uid = fs.call_s3("create_multipart_upload", Bucket="tgtest", Key=key)["UploadId"]
        fs.call_s3("upload_part", Bucket="tgtest", Key=key, UploadId=uid, PartNumber=1, Body=b"x" * (5 << 20))
        return uid

    def uploads(name: str) -> list[str]:
        got = fs.call_s3("list_multipart_uploads", Bucket="tgtest", Prefix=f"{base}/{name}/")
        return [u["UploadId"] for u in got.get("Uploads") or []]

    live = upload("live")
    upload("dead")
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        monkeypatch.setattr(_stale, "IDLE_BOUNDS", 1e9)  # active within the idle limit: maybe a live writer's
        consolidate(ckpt, f"s3://tgtest/{base}/live")
        assert uploads("live") == [live]
        assert f"--upload-id {live}" in caplog.text
        monkeypatch.setattr(_stale, "IDLE_BOUNDS", -1.0)  # idle for long enough
        consolidate(ckpt, f"s3://tgtest/{base}/dead")
    assert uploads("dead") == []
    assert uploads("live") == [live]  # another destination's: not looked at
    assert torch.equal(_weight(f"s3://tgtest/{base}/dead"), _weight(ckpt))


def test_own_writer_seen_through_another_path_is_left_alone(tmp_path: Path) -> None:
    """A writer of this process (another thread's export) seen through a symbolic link to its directory: not opened
    (closing a descriptor of its owner file here would drop its POSIX lock), not warned about, not removed."""
    from trainguard import outtemp

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    tmp = real / ".m.pt.tmp-0123456789ab"
    with outtemp.owned(str(tmp)):
        tmp.write_bytes(b"x")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert outtemp.sweep(str(tmp_path / "link" / "m.pt")) == []
        assert tmp.exists()
        tmp.unlink()
    assert os.listdir(real) == []


def test_consolidate_out_of_inodes_is_a_disk_full_error(ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC creating the destination's directory (a file system out of inodes, or full): a DiskFullError, as
    tg.save's; before, "CheckpointError: ... OSError: [Errno 28] No space left on device: 'DST.tmp-<id>'"."""
    import errno

    real_mkdir = os.mkdir

    def full(p, *a, **k):  # type: ignore[no-untyped-def]
        if os.fsdecode(p).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device", os.fsdecode(p))
        return real_mkdir(p, *a, **k)

    monkeypatch.setattr(os, "mkdir", full)
    with pytest.raises(tg.DiskFullError, match="out of space or of inodes"):
        consolidate(ckpt, tmp_path / "full")
    assert os.listdir(tmp_path) == []


def test_overwrite_killed_while_removing_the_old_one(ckpt: str, tmp_path: Path) -> None:
    """A consolidate --overwrite killed after its commit, while it removed the previous output it had set aside
    (``full.old-<id>``, its manifest removed first): that directory stayed for good. The next write of ``full``
    removes it (its writer, named by the owner file of the same id, is dead: a pid that has exited)."""
    consolidate(ckpt, tmp_path / "full")
    old = tmp_path / "full.old-00000000000000ab"
    old.mkdir()
    (old / "data-00000.bin").write_bytes(b"z" * 4096)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (tmp_path / "full.tmp-00000000000000ab.owner").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                                         "since": 0}))
    consolidate(ckpt, tmp_path / "full", overwrite=True)
    assert os.listdir(tmp_path) == ["full"]
    assert torch.equal(_weight(tmp_path / "full"), _weight(ckpt))
