"""Session 48's leftovers: small defects earlier sessions saw and left alone, each test checked
to fail on the code before its fix."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from trainguard.demo import driver
from trainguard.elastic.reap import running

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
