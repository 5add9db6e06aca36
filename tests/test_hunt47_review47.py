"""Review of session 47's merged changes (review47).

``trainguard demo``'s SIGTERM handling (b114b94): the first SIGTERM raised ``Terminated`` and set
SIGTERM back to its default, "a second one ends the demo at once". ``Terminated`` is a
``KeyboardInterrupt``, on which ``Popen.wait`` waits 0.25 s more for the child before re-raising,
so for that time the agent had not been sent its SIGTERM: a second SIGTERM then ended the demo
(exit -15) and its agent and 2 workers trained on, orphaned, in the run directory left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_hunt47_install import _alive, _descendants, _end

ROOT = Path(__file__).resolve().parents[1]


def _catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a handler of its own for SIGTERM (``SigCgt`` in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def _demo_at_step_100(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """``trainguard demo`` (tiny, long) once its first run's log shows step 100."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path))
    demo = subprocess.Popen([sys.executable, "-m", "trainguard", "demo", "--size", "tiny", "--steps", "100000",
                             "--fault-step", "99999", "--save-every", "1000", "--plot", "", *extra],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # SIGINT as in a terminal: a pytest-xdist worker ignores it, and a child inheriting
                            # SIG_IGN gets no KeyboardInterrupt from Python (the Ctrl-C test waited out its timeout)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while not any("step 100 loss" in f.read_text(errors="replace") for f in tmp_path.glob("trainguard-demo-*/kill.log")):
        if demo.poll() is not None or time.monotonic() > deadline:
            demo.kill()
            raise AssertionError(f"the demo's kill run did not reach step 100: {demo.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return demo


def _stopped_and_removed(demo: subprocess.Popen, below: set[int], tmp_path: Path, code: int, line: str) -> None:
    """Wait for the demo; assert its exit ``code``, the stderr ``line``, no traceback, every process
    that was below it gone (the agent stops its workers within seconds of its SIGTERM) and its
    directories removed."""
    _, err = demo.communicate(timeout=180)
    assert demo.returncode == code, err[-3000:]
    assert line in err and "Traceback" not in err and "Aborted" not in err, err[-3000:]
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in below if _alive(p)] == []
    assert list(tmp_path.glob("trainguard-demo-*")) == []


@pytest.mark.slow  # the demo's stop path is in make test (test_demo_interrupted_exits_130..., test_hunt47_install): suite time
def test_demo_second_sigterm_right_after_the_first_still_stops_its_runs(tmp_path):
    demo = _demo_at_step_100(tmp_path)
    below: set[int] = set()
    try:
        below = _descendants(demo.pid)
        assert len(below) >= 3  # the agent and its 2 workers
        assert _catches_sigterm(demo.pid)
        demo.send_signal(signal.SIGTERM)
        while _catches_sigterm(demo.pid) and demo.poll() is None:  # until the demo's handler has run
            pass
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)  # the second, as the demo unwinds from the first
        _stopped_and_removed(demo, below, tmp_path, 143,
                             "terminated: the demo's runs were stopped and their directories removed")
    finally:
        _end(demo, below)


@pytest.mark.slow  # a whole demo run for one line of its output: `make test-slow` (suite time)
def test_demo_keep_terminated_says_its_directories_are_kept(tmp_path):
    """``demo --keep`` stopped by SIGTERM keeps its run directories (as printed on stdout), and said
    on stderr that they were removed."""
    demo = _demo_at_step_100(tmp_path, "--keep")
    below = _descendants(demo.pid)
    try:
        demo.send_signal(signal.SIGTERM)
        out, err = demo.communicate(timeout=180)
        assert demo.returncode == 143, err[-3000:]
        kept = list(tmp_path.glob("trainguard-demo-*"))
        assert len(kept) == 1 and f"run directories kept in {kept[0]}" in out
        assert "terminated: the demo's runs were stopped" in err
        assert "removed" not in err
    finally:
        _end(demo, below)


EPOCH_SAVES = """
import sys
import torch, trainguard as tg
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
batches = [torch.randn(4, 2) for _ in range(5)]
progress = tg.StateDict(epoch=-1)
state = {"model": model, "optim": opt, "plateau": plateau, "progress": progress}
with tg.CheckpointManager(sys.argv[1], handle_signals=False) as mgr:
    mgr.restore(state)
    for epoch in range(progress["epoch"] + 1, 6):
        train_loss = 0.0
        for i, x in enumerate(batches):
            if epoch == int(sys.argv[2]) and i == 2:
                import os; os._exit(9)  # killed in the middle of an epoch
            opt.zero_grad()
            loss = (model(x) ** 2).mean()
            loss.backward()
            opt.step()
            train_loss += loss.item()
        plateau.step(train_loss)
        progress["epoch"] = epoch
        mgr.save(epoch, state)
print(opt.param_groups[0]["lr"], *model.weight.flatten().tolist(), *model.bias.tolist())
"""


def test_doctor_loop_accumulator_quiet_on_an_epoch_sum_saved_after_the_epoch(tmp_path):
    """A training sum over the batches of an epoch, read by the plateau and saved after the epoch
    (``mgr.save`` in the epoch loop, outside the batch loop) ends between two saves: a resume
    starts at an epoch's beginning, as the sum does, and ends as the uninterrupted run (checked
    here by a kill in the middle of an epoch). The check warned on it (its innermost loop calls
    ``backward()``)."""
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    found = [f for f in check_source(Settings(source=EPOCH_SAVES)) if f.check == "loop accumulator"]
    assert found == []
    script = tmp_path / "train.py"
    script.write_text(EPOCH_SAVES)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))

    def run(ckpt: str, kill_epoch: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(tmp_path / ckpt), str(kill_epoch)], env=env,
                              capture_output=True, text=True, timeout=120)

    straight = run("a", -1)
    assert straight.returncode == 0, straight.stderr
    killed = run("b", 3)
    assert killed.returncode == 9, killed.stderr
    resumed = run("b", -1)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == straight.stdout
    # the same script keeps the warning when it saves inside the batch loop, where a save splits the sum
    per_step = EPOCH_SAVES.replace("            train_loss += loss.item()\n",
                                   "            train_loss += loss.item()\n            mgr.save(epoch * 5 + i, state)\n")
    assert [f.check for f in check_source(Settings(source=per_step))].count("loop accumulator") == 1


def test_demo_interrupted_exits_130_and_stops_its_runs(tmp_path):
    """Ctrl-C (SIGINT) on the demo stopped its runs and removed them, then exited 1 with click's
    "Aborted!": the code of a demo that ran and failed. Now 130, with one line saying what was done."""
    demo = _demo_at_step_100(tmp_path)
    below = _descendants(demo.pid)
    try:
        demo.send_signal(signal.SIGINT)
        _stopped_and_removed(demo, below, tmp_path, 130,
                             "interrupted: the demo's runs were stopped and their directories removed")
    finally:
        _end(demo, below)
