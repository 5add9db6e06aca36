"""Session 48's leftovers: small defects earlier sessions saw and left alone, each test checked
to fail on the code before its fix."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.demo import driver
from trainguard.elastic.reap import running

ROOT = Path(__file__).resolve().parents[1]

# An "agent" that does not end on SIGTERM (as a SIGSTOPped or hung one), with a worker leading a
# session of its own (as trainguard run's --run-path workers do) and that worker's own child (a
# DataLoader process). It prints the two pids once SIGTERM is ignored.
_AGENT = r"""
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
loader = subprocess.Popen([sys.executable, "-c", "import time; [time.sleep(1) for _ in iter(int, 1)]"])
print(loader.pid, flush=True)
while True: time.sleep(1)
'''], start_new_session=True, stdout=subprocess.PIPE)
print(worker.pid, worker.stdout.readline().decode().strip(), flush=True)
while True: signal.pause()
"""


def test_demo_stop_kills_the_agents_workers_with_it():
    # The demo's stop() SIGKILLed an agent that had not ended on SIGTERM within its grace, alone:
    # its workers (own sessions) kept saving into the run directory after the demo removed it.
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], stdout=subprocess.PIPE)
    pids: list[int] = []
    try:
        line = agent.stdout.readline().decode().split()
        assert len(line) == 2, line
        pids = [int(p) for p in line]
        assert all(running(p) for p in pids)
        driver.stop(agent, grace_s=0)
        assert agent.returncode == -signal.SIGKILL
        assert [p for p in pids if running(p)] == []
    finally:
        for p in [agent.pid, *pids]:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        agent.wait(timeout=30)
        agent.stdout.close()


LIST_PLATEAU = """
import torch, trainguard as tg
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
state = {"model": model, "optim": opt, "plateau": plateau}
with tg.CheckpointManager("ck", handle_signals=False) as mgr:
    step = 0
    for epoch in range(3):
        losses = []
        for x in [torch.randn(4, 2)] * 5:
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            opt.step()
            %s
            step += 1
            mgr.save(step, state)
        val = []
        with torch.no_grad():
            for x in [torch.randn(4, 2)] * 3:
                val.append(model(x).sum().item())
        plateau.step(%s)
"""


@pytest.mark.parametrize("train_line,arg,warned", [
    ("losses.append(loss.item())", "sum(losses) / len(losses)", True),   # a list across saves: a resume empties it
    ("losses.extend([loss.item()])", "max(losses)", True),
    ("losses.append(loss.item())", "sum(val) / len(val)", False),        # the plateau reads the validation pass's list
    ("pass", "sum(val) / len(val)", False),
    ("losses.append(loss.item())", "0.5", False),                       # the list is never fed to the plateau
])
def test_doctor_loop_accumulator_sees_a_list_of_losses(train_line: str, arg: str, warned: bool) -> None:
    # The check warned on `epoch_loss += loss.item()` ... `plateau.step(epoch_loss / n)` but not on the
    # same sum kept as a list, `losses.append(loss.item())` ... `plateau.step(sum(losses) / len(losses))`.
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    found = [f for f in check_source(Settings(source=LIST_PLATEAU % (train_line, arg))) if f.check == "loop accumulator"]
    assert len(found) == warned
    if warned:
        assert train_line in found[0].message and "losses_sum" in found[0].fix


def _interrupted_at(point: str, argv: list[str], tmp_path: Path) -> tuple[int, str]:
    """``argv`` (a trainguard command) stopped at the fault point ``point``, sent a SIGINT (Ctrl-C)
    there, then continued. (returncode, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
           "TRAINGUARD_CRASH_AT": point, "TRAINGUARD_CRASH_KIND": "stop"}
    p = subprocess.Popen([sys.executable, "-m", "trainguard", *argv], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # xdist workers ignore it
    try:
        _, status = os.waitpid(p.pid, os.WUNTRACED)  # blocks until it stopped (or ended)
        assert os.WIFSTOPPED(status), f"{argv} ended before it stopped: {status}"
        os.kill(p.pid, signal.SIGINT)
        os.kill(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err


def test_convert_ctrl_c_after_the_rename_says_the_output_is_complete(tmp_path: Path) -> None:
    # A Ctrl-C handled once convert had renamed DST into place ended in click's "Aborted!", exit 1,
    # without the "converted" line, although DST was complete and loadable. Now it says DST was
    # written whole (exit 130).
    torch.save({"w": torch.arange(1000.0)}, tmp_path / "w.pt")
    rc, err = _interrupted_at("after_rename", ["convert", "w.pt", "out/step-000000000"], tmp_path)
    assert rc == 130, err
    assert "interrupted: out/step-000000000 was written whole before the signal" in err and "Aborted" not in err, err
    got = {"model": tg.StateDict(w=torch.zeros(1000))}
    tg.load(str(tmp_path / "out" / "step-000000000"), got)
    assert torch.equal(got["model"]["w"], torch.arange(1000.0))


def test_convert_ctrl_c_before_the_rename_says_the_output_was_not_written(tmp_path: Path) -> None:
    # Before the rename: DST was not written (it was "Aborted!", exit 1), and no temporary directory is left.
    torch.save({"w": torch.arange(1000.0)}, tmp_path / "w.pt")
    rc, err = _interrupted_at("after_manifest", ["convert", "w.pt", "other/step-000000000"], tmp_path)
    assert rc == 130 and "interrupted: other/step-000000000 was not written" in err, err
    assert not (tmp_path / "other" / "step-000000000").exists()
    assert [p.name for p in (tmp_path / "other").iterdir()] == []  # no temporary directory left


@pytest.mark.parametrize("bad", [[1e308, -1e308], [1e308]])
def test_report_refuses_timestamps_no_run_has(tmp_path: Path, bad: list[float]) -> None:
    # A garbled event log whose t are finite (read_events takes them) but +-1e308 printed "wall time inf s"
    # (--json: "Infinity", no JSON), and 1e308 among ordinary times a wall time of 309 digits, exit 0.
    from click.testing import CliRunner

    from trainguard.cli import main

    ev = [{"t": 100.0 + s, "event": "step", "rank": 0, "pid": 7, "step": s} for s in range(5)]
    ev += [{"t": t, "event": "step", "rank": 0, "pid": 7, "step": 5 + i} for i, t in enumerate(bad)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    for args in ([], ["--json"]):
        res = CliRunner().invoke(main, ["report", *args, str(tmp_path)])
        assert res.exit_code == 2, res.output
        assert "timestamps in" in res.output and "are invalid" in res.output and "inf" not in res.output, res.output
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev[:5]))  # the ordinary part
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 0 and "wall time          4.00 s" in res.output, res.output


def _epoch(sampler: tg.ResumableSampler, count: Callable[[int], int], num_workers: int = 0) -> list[str]:
    """One epoch of a DataLoader over 100 samples (batches of 10) reading ``sampler``, each batch
    advanced by ``count(len(x))``; the ResumableSampler warnings it gave."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(100.0)), batch_size=10, sampler=sampler, num_workers=num_workers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for (x,) in loader:
            sampler.advance(count(len(x)))
        sampler.next_epoch()
    return [str(w.message) for w in seen if "ResumableSampler" in str(w.message)]


@pytest.mark.parametrize("world", [1, 2])
def test_sampler_warns_when_advance_counts_more_than_the_iterator_gave(world: int) -> None:
    # advance() capped an over-count at the epoch's end silently: advance(len(x) * 2) reached position 100
    # at step 5 of 10, a checkpoint there resumed with the epoch done and its last 50 samples never read.
    over = _epoch(tg.ResumableSampler(100, rank=0, world_size=world), lambda n: 2 * n)
    assert len(over) == 1 and "advance() counted 20 sample(s) in 1 call(s)" in over[0], over
    assert "more than the 10 it gave this rank" in over[0] and "not the global batch" in over[0], over
    # Counted right: nothing, also with worker processes that read ahead, and from a restored position
    assert _epoch(tg.ResumableSampler(100, rank=0, world_size=world), lambda n: n) == []
    assert _epoch(tg.ResumableSampler(100, rank=0, world_size=world), lambda n: n, num_workers=2) == []
    s = tg.ResumableSampler(100, rank=0, world_size=world)
    s.advance(30 // world)  # a fresh sampler skips data: no iterator began
    s.load_state_dict({**s.state_dict(), "position": 40})
    assert _epoch(s, lambda n: n) == []


def test_sampler_skipping_data_after_a_rollback_is_no_over_count() -> None:
    # docs/data.md: after a rollback inside the loop, advance(n) skips the spike's data before the next
    # iterator: not counted against the iterator that was reading.
    s = tg.ResumableSampler(100, world_size=1, rank=0)
    it = iter(s)
    for _ in range(20):
        next(it)
    s.advance(20)
    saved = s.state_dict()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s.load_state_dict({**saved, "position": 10})  # the rollback
        s.advance(30)  # skip the spike's data
        s.next_epoch()
        s.advance(50)  # a new epoch's skip before its iterator
    assert [str(w.message) for w in seen if "advance() counted" in str(w.message)] == []
