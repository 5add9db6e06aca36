"""Session 58, review58j: a hostile review of review58g (the lock record's command line), review58f (outtemp's
owner files) and review58h (``keptseen._member_picks``).

- ``stopwait._shown``'s URL pattern backtracked over every ``?`` of an argument without white space, ``=`` or ``&``:
  ``'?token' * 1700`` (10,200 characters) took 58 s in the manager's ``open``, ``'?' * 10_000`` 6 s, 100,000
  characters hours (cubic); each pattern now scans once;
- secrets inside an argument were shown: JSON (``--config '{"api_key": "x"}'``), a header (``Authorization: Bearer
  x``), an override list (``a=1,hf_token=x``), and the part before the last ``=`` of ``Authorization: Basic
  dXNlcjpwdw==`` (most of a base64 user:password).

In-process, except the first test: a regex holds the GIL, so only a subprocess can bound it (it loads
stopwait.py alone, without torch).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard import stopwait


def test_a_long_argument_of_questions_is_shown_at_once() -> None:
    """Before: over 90 s for this argument (cubic in its length); now milliseconds. The bound (30 s) is not a timing
    assert of the fix: it stops the old code."""
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('sw', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(len(m._shown(['--prompt', '?token' * 2000])))")
    try:
        out = subprocess.run([sys.executable, "-c", code, stopwait.__file__], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "PYTHONPATH": ""})
    except subprocess.TimeoutExpired:
        pytest.fail("stopwait._shown ran for over 30 s on one 12,000-character argument")
    assert out.returncode == 0 and out.stdout.strip() == "2", out


@pytest.mark.parametrize(("arg", "secret"), [
    ('{"api_key": "sk-JSON1", "lr": 1}', "sk-JSON1"),
    ("{'hf_token':'hf_PY2'}", "hf_PY2"),
    ("Authorization: Bearer eyBEARER3", "eyBEARER3"),
    ("Authorization: Basic dXNlcjpwdw==", "dXNlcjpwdw"),
    ("optim.lr=1e-3,wandb.api_key=WB4", "WB4"),
    ("trainer.token: TK5", "TK5"),
    ("--password:PW6", "PW6"),
])
def test_the_lock_record_hides_secrets_inside_an_argument(arg: str, secret: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stopwait.sys, "argv", ["train.py", "--set", arg, "--lr", "3e-4"])
    cmd = stopwait.who()["cmd"]
    assert secret not in cmd and "3e-4" in cmd, cmd


def test_the_lock_record_keeps_what_names_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train.py", '{"lr": 0.1, "name": "run-7"}', "--url=https://h/x?a=1&b=2", "a:b", "", "x\udcff"]
    monkeypatch.setattr(stopwait.sys, "argv", argv)
    assert stopwait.who()["cmd"].endswith(" ".join(argv)), stopwait.who()


@pytest.mark.parametrize("record", [b'{"pid": 1, "host": "h", "since": 1e300}',
                                    b'{"pid": 1, "host": "h", "since": 1, "stopping": Infinity, "signal": 15}',
                                    b'{"pid": 1, "host": "h", "since": 1, "stopping": 1' + b"0" * 400 + b"}"])
def test_an_odd_lock_record_is_named_not_raised(record: bytes, tmp_path: Path) -> None:
    """Before: a record whose times are past ``time_t`` (``time.ctime`` raises OverflowError, which no caller caught)
    made the manager's open raise OverflowError instead of LockedError; a 400-digit int, ``stopwait.since`` too."""
    from trainguard import runlock

    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, record)
        assert isinstance(runlock._read_holder(fd), str)
        stopwait.budget(fd, 10.0), stopwait.stale(fd, 10.0)  # no exception
    finally:
        os.close(fd)


def test_an_interrupt_while_the_owner_file_is_made_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a KeyboardInterrupt between creating ``<temp>.owner.new`` and renaming it left it for good (its
    ``finally`` removed ``<temp>.owner`` only, and no sweep matches the staged name)."""
    from trainguard import outtemp

    def interrupted(*_a: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(outtemp.fcntl, "lockf", interrupted)
    with pytest.raises(KeyboardInterrupt), outtemp.owned(str(tmp_path / ".out.pt.tmp-0123abcd")):
        pass
    assert os.listdir(tmp_path) == []


def test_a_sweep_removes_an_old_staged_owner_file_of_a_killed_writer(tmp_path: Path) -> None:
    """Before: ``<temp>.owner.new`` of a writer killed (SIGKILL) before its rename stayed for good beside the output;
    now a sweep removes it once it is older than ``STAGE_AGE`` and unlocked. A fresh one (a live writer's, in that
    instant) stays."""
    from trainguard import outtemp

    old, fresh = tmp_path / ".out.pt.tmp-0123abcd.owner.new", tmp_path / ".out.pt.tmp-4567abcd.owner.new"
    old.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(old, (1.0, 1.0))
    outtemp.sweep(str(tmp_path / "out.pt"))
    assert sorted(os.listdir(tmp_path)) == [fresh.name]


def test_a_users_step_policy_without_keepbest_still_gets_its_gone_step_replaced(tmp_path: Path) -> None:
    """review58h's case without a policy that reads metadata: ``KeepLatest(2) | KeepFirst()``,
    step 1's manifest removed by hand. Before, the save of step 4 deleted step 2, the oldest valid checkpoint, which
    KeepFirst keeps now."""
    import trainguard as tg
    from trainguard import layout
    from trainguard.policies import RetentionPolicy

    class KeepFirst(RetentionPolicy):
        reads_metadata = False

        def select(self, checkpoints):  # noqa: ANN001, ANN202
            return {min(c.step for c in checkpoints)} if checkpoints else set()

    root = tmp_path / "run"
    keep = tg.KeepLatest(2) | KeepFirst()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"p": tg.StateDict(step=step)})
        mgr.wait()
        (root / layout.step_dir(1) / layout.MANIFEST).unlink()  # by hand (or a cleanup job)
        mgr.save(4, {"p": tg.StateDict(step=4)})
        mgr.wait()
    held = {layout.parse_step(p.name) for p in root.iterdir() if (p / layout.MANIFEST).exists()}
    assert 2 in held, held
