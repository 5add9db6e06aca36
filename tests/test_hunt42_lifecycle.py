"""A CheckpointManager misused or stressed over its lifecycle (hunt 42, "lifecycle"): bad input
gets a clear error that says what to change, and nothing is lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.permanent import is_permanent


def test_a_manager_pointed_at_one_checkpoint_is_refused_and_leaves_it_untouched(tmp_path: Path) -> None:
    # Before: open() put .lock and events.jsonl into step-000000007, restore() returned None (a fresh
    # start over the checkpoint the run meant to resume from) and save(8) nested step-000000008 in it.
    root = tmp_path / "run1"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(7, {"model": nn.Linear(2, 2)})
    step_dir = root / "step-000000007"
    before = sorted(os.listdir(step_dir))
    mgr = tg.CheckpointManager(step_dir, save=tg.EveryNSteps(1), handle_signals=False)
    with pytest.raises(tg.CheckpointError, match="is one checkpoint \\(step 7\\), not a run directory") as err:
        mgr.open()
    assert str(root) in str(err.value) and "tg.load(" in str(err.value)  # what to pass instead
    assert is_permanent(err.value)  # `trainguard run` does not restart into it (exit 78)
    assert sorted(os.listdir(step_dir)) == before  # no lock, no event log, nothing nested
    with tg.CheckpointManager(root, handle_signals=False) as mgr:  # the run directory is not locked by it
        assert mgr.restore({"model": nn.Linear(2, 2)}) == 7
    other = tmp_path / "outputs"  # a manifest.json of another tool is no checkpoint: the directory is a run directory
    other.mkdir()
    (other / "manifest.json").write_text('{"files": []}')
    with tg.CheckpointManager(other, handle_signals=False) as mgr:
        assert mgr.restore({"model": nn.Linear(2, 2)}) is None


def _closed_in_another_thread(root: Path) -> tg.CheckpointManager:
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1)).open()  # the main thread: its handlers are set
    mgr.save(1, {"model": nn.Linear(2, 2)})
    t = threading.Thread(target=mgr.close)  # Python lets only the main thread set handlers: they stay
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    return mgr


def test_ctrl_c_after_a_close_in_another_thread_raises_keyboard_interrupt_again(tmp_path: Path) -> None:
    # Before: the closed manager's handler stayed installed and only set a flag nobody read, so every
    # later Ctrl-C (and SIGTERM, below) was swallowed for the rest of the process.
    # Ctrl-C as in an interactive Python (a test run started in the background with `&` inherits
    # SIGINT ignored, which no handler of the manager's changes: then no KeyboardInterrupt at all)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        mgr = _closed_in_another_thread(tmp_path / "run")
        with tg.CheckpointManager(tmp_path / "other", save=tg.EveryNSteps(1)) as other:  # opened over it: chained
            signal.raise_signal(signal.SIGINT)  # the open manager's preemption, no KeyboardInterrupt
            assert other.save(1, {"model": nn.Linear(2, 2)}) is not None and other.should_stop
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert {sig: signal.getsignal(sig) for sig in before} == before  # the handlers from before open() are back
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
        if inherited is not None:  # None: set outside Python, cannot be put back
            signal.signal(signal.SIGINT, inherited)
    assert not mgr.should_stop


_SIGTERM_AFTER_THREAD_CLOSE = """
import signal, sys, threading
sys.path.insert(0, sys.argv[2])
import trainguard as tg
from torch import nn
mgr = tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1)).open()
mgr.save(1, {"model": nn.Linear(2, 2)})
t = threading.Thread(target=mgr.close)
t.start()
t.join()
signal.raise_signal(signal.SIGTERM)
print("still alive after SIGTERM")
"""


def test_sigterm_after_a_close_in_another_thread_ends_the_process(tmp_path: Path) -> None:
    src = str(Path(__file__).resolve().parent.parent / "src")
    r = subprocess.run([sys.executable, "-c", _SIGTERM_AFTER_THREAD_CLOSE, str(tmp_path / "run"), src],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "still alive" not in r.stdout
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        assert mgr.latest_step() == 1


def test_policies_take_numpy_and_tensor_ints_as_the_steps_do(tmp_path: Path) -> None:
    # Before: EveryNSteps(np.int64(5)) raised "n must be a positive integer number of steps" for a positive
    # integer (save() takes numpy and 0-d tensor steps), and so did KeepLatest, KeepEvery, KeepBest, DalyInterval.
    every, keep = tg.EveryNSteps(np.int64(2)), tg.KeepLatest(np.int32(2)) | tg.KeepEvery(torch.tensor(4))
    assert type(every.n) is int and repr(every) == "EveryNSteps(2)"
    assert tg.KeepBest("loss", np.int64(2)).n == 2
    daly = tg.DalyInterval(node_failures_per_day=1, initial_steps=np.int64(3), min_steps=np.int64(2), max_steps=np.int64(9))
    assert (daly.interval_steps, daly.min_steps, daly.max_steps) == (3, 2, 9)
    with tg.CheckpointManager(tmp_path, save=every, keep=keep, handle_signals=False) as mgr:
        for step in range(1, 9):
            mgr.save(step, {"model": nn.Linear(2, 2)})
    assert sorted(os.listdir(tmp_path)) == [".lock", ".trainguard-run-id", "events.jsonl", "step-000000004", "step-000000006", "step-000000008"]
    for bad in (True, 2.0, np.float64(2.0), "2"):  # still refused, saying what an n must be
        with pytest.raises(ValueError, match="positive integer"):
            tg.EveryNSteps(bad)
    with pytest.raises(ValueError, match="at least 2"):
        tg.KeepLatest(np.int64(1))


def test_sys_exit_0_inside_the_with_block_closes_as_a_clean_end(tmp_path: Path, monkeypatch) -> None:
    # Before: SystemExit(0) was taken for a failure: the RAM tier's copy stayed in /dev/shm for good (a job that
    # ends without a restart), no closing round ran, and a failed last save was only logged: the script exited 0.
    from trainguard import api

    root, base = tmp_path / "run", tmp_path / "shm"
    base.mkdir()
    with pytest.raises(SystemExit) as done:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(base), async_save=True,
                                  handle_signals=False) as mgr:
            mgr.save(1, {"model": nn.Linear(2, 2)})
            sys.exit(0)
    assert done.value.code == 0 and mgr.latest_step() == 1
    assert not os.path.exists(mgr.ram.dir)  # removed, as by a clean close()

    def failing_write(*args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(api, "write_batches", failing_write)
    with pytest.raises(tg.CheckpointError, match="injected"):  # the failed last save, not a silent exit 0
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
            mgr.save(2, {"model": nn.Linear(2, 2)})
            sys.exit()
    with pytest.raises(SystemExit) as stopped:  # another exit code is a failure, as before: the block's exit goes on
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
            mgr.save(3, {"model": nn.Linear(2, 2)})
            sys.exit(143)
    assert stopped.value.code == 143 and mgr.latest_step() == 1
