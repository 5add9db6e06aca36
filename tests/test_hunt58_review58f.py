"""Hunt 58 (review58f): a hostile review of ``outtemp`` (tmp58: owner files beside temporary outputs, swept by the
next writer of the same target).

- ``owned`` created the owner file under its final name, empty and unlocked, and only then locked it and wrote its
  record: a sweep of another process in that instant took it for a dead writer's (a free lock, no host: "dead" on a
  local file system) and removed it, with the temp output that the live writer was about to write; that writer
  then went on with no owner file (its temp unprotected, or removed under it when the sweep's ``_remove`` came
  after its ``makedirs``). Now the owner file is locked and written under a staging name and renamed into place.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest

from trainguard import outtemp


def _sweep_in_another_process(target: str) -> list[str]:
    """``outtemp.sweep(target)`` in a forked child (another process: its lock tests see this one's locks), bounded;
    returns what the child reported removed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no writer of its own (the parent's are another process's now)
        code = 1
        try:
            os.close(r)
            outtemp._MINE.clear()
            got = outtemp.sweep(target)
            os.write(w, "\n".join(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the sweep in the child did not end in 30 s")
        time.sleep(0.01)  # polling a bounded wait, not synchronisation
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0
    return [line for line in out.split("\n") if line]


def test_owner_file_never_seen_unlocked_by_another_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's sweep of the same target, in the instant between ``owned`` creating the owner file and
    locking it: the live writer keeps its owner file, and a later sweep still sees it live (its temp is left)."""
    target = str(tmp_path / "model.safetensors")
    tmp = str(tmp_path / ".model.safetensors.tmp-abc123")
    real_lockf = outtemp.fcntl.lockf
    seen: list[list[str]] = []

    def lockf(fd: int, how: int) -> None:
        seen.append(_sweep_in_another_process(target))  # the other writer's sweep, before this one's lock
        real_lockf(fd, how)

    monkeypatch.setattr(outtemp.fcntl, "lockf", lockf)
    with warnings.catch_warnings(), outtemp.owned(tmp):
        warnings.simplefilter("error")  # a "cannot tell" warning here would mean the owner file was lost
        monkeypatch.setattr(outtemp.fcntl, "lockf", real_lockf)
        Path(tmp).write_bytes(b"x" * 10)  # the writer's temporary output
        assert os.path.exists(tmp + outtemp.OWNER), "the live writer's owner file was removed by another's sweep"
        assert _sweep_in_another_process(target) == []
        assert os.path.exists(tmp), "a live writer's temporary output was removed"
        os.unlink(tmp)
    assert seen == [[]]
    assert sorted(os.listdir(tmp_path)) == []  # no owner file, no staging file left



def test_refused_upload_listing_asked_and_warned_once(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A bucket policy without s3:ListBucketMultipartUploads: every plain ``tg.save`` onto S3 (``commit.occupied``,
    ``_stale.abort_under``) paid a refused request and logged a warning. Now once per bucket and process."""
    import logging
    import types

    from trainguard.storage import _stale

    monkeypatch.setattr(_stale, "_UNLISTED", set(), raising=False)
    calls: list[str] = []

    def call_s3(op: str, **kw: object) -> dict[str, object]:
        calls.append(op)
        raise PermissionError("Access Denied")

    storage = types.SimpleNamespace(_s3=True, io=types.SimpleNamespace(_bound=1.0, call_s3=call_s3))
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        for i in range(3):
            assert _stale.abort_under(storage, f"bkt/run/ck-{i}") == []
    assert calls == ["list_multipart_uploads"]
    assert caplog.text.count("could not list the incomplete multipart uploads") == 1


def test_writer_in_another_pid_namespace_of_this_host_is_not_judged_by_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer in a container with this host's name (host networking) and other pids, on a mount without locks
    (F_GETLK fails): its pid, unknown here, said nothing about it, and its live temp output was removed. Now the
    record names its PID namespace; one of another namespace is left, with the warning naming it."""
    import json
    import socket

    d = tmp_path / "full.tmp-00000000000000bb"
    d.mkdir()
    (d / "data-00000.bin").write_bytes(b"z")
    pid = 4_000_000  # above any pid_max: no process of this namespace
    ns = os.stat("/proc/self/ns/pid").st_ino + 1  # another PID namespace
    (tmp_path / (d.name + ".owner")).write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                            "since": time.time(), "pidns": ns}))
    monkeypatch.setattr(outtemp, "_held", lambda fd: None)
    with pytest.warns(UserWarning, match="another PID namespace"):
        assert outtemp.sweep(str(tmp_path / "full")) == []
    assert (d / "data-00000.bin").read_bytes() == b"z"
