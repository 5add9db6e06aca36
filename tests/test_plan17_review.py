"""Review of "how often to save": DalyInterval inside a real CheckpointManager, and `trainguard plan`'s inputs.

The manager tests run real async saves of a small model on a virtual clock: the training
thread's clock (``manager.time``) moves only when the test says (one step = STEP_S, a save's
blocking part = STALL_S), and a background save commits at the virtual time the test
scheduled (its start + WRITE_S), read by ``handle.time`` on the save thread. A manager that
collects a save still in flight advances the training clock to that commit, as blocking would.
No sleeps, no timing assertion on the real clock.
"""

from __future__ import annotations

import math
import threading
import time
import types

import torch

import trainguard as tg
from trainguard import handle as handle_mod
from trainguard import manager as manager_mod
from trainguard.events import read_events
from trainguard.handle import SaveHandle
from trainguard.reliability import daly_interval

STEP_S, STALL_S, WRITE_S, MTBF_S = 1.0, 2.0, 300.0, 625.0


def _virtual_clock(monkeypatch) -> list[float]:
    """Install the virtual clocks described in the module docstring; returns the training clock [now]."""
    vt = [0.0]
    commit_at = [0.0]
    main = threading.main_thread()
    monkeypatch.setattr(manager_mod, "time", types.SimpleNamespace(monotonic=lambda: vt[0], time=time.time))
    monkeypatch.setattr(handle_mod, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() if threading.current_thread() is main else commit_at[0]))
    real_start, real_result = manager_mod.start_save, SaveHandle.result

    def start_save(*a, **k):
        vt[0] += STALL_S  # the blocking part of the save
        commit_at[0] = vt[0] + WRITE_S  # the background write commits WRITE_S later
        h = real_start(*a, **k)
        assert h._done.wait(60), "the background save did not finish"  # committed at commit_at (virtual)
        return h

    def result(self, *a, **k):
        out = real_result(self, *a, **k)
        vt[0] = max(vt[0], self.finished_at or vt[0])  # blocked until the commit
        return out

    real_done = SaveHandle.done

    def done(self):  # committed once the training clock passed its (virtual) commit: the manager collects it then
        return real_done(self) and (self.finished_at is None or vt[0] >= self.finished_at)

    monkeypatch.setattr(manager_mod, "start_save", start_save)
    monkeypatch.setattr(SaveHandle, "result", result)
    monkeypatch.setattr(SaveHandle, "done", done)
    return vt


def test_async_save_longer_than_the_interval_sets_the_floor_at_once_in_a_real_manager(tmp_path, monkeypatch):
    """A background write longer than Daly's interval: the interval must rise to one save's duration
    as soon as that duration is measured, and no later save may wait for its predecessor.

    Before: the manager collects an async save only at the next save, so its (exact) duration was
    capped at the gap between the two saves (meant for managers that report the whole gap), and
    the floor never rose above the current interval; the wait for the still-running save was then
    fed to Daly as stall, which overshot the interval for the next saves (5x here)."""
    vt = _virtual_clock(monkeypatch)
    policy = tg.DalyInterval(node_mtbf_s=MTBF_S, nodes=1, initial_steps=10)
    state = {"model": torch.nn.Linear(4, 4)}
    saved = []
    with tg.CheckpointManager(tmp_path / "ck", save=policy, keep=tg.KeepLatest(2), async_save=True) as mgr:
        for step in range(0, 1600):
            vt[0] += STEP_S
            if mgr.save(step, state) is not None:
                saved.append(step)
    floor = math.ceil((STALL_S + WRITE_S) / STEP_S)
    assert floor > round(daly_interval(STALL_S, MTBF_S) / STEP_S)  # the floor is the binding rule here
    gaps = [b - a for a, b in zip(saved[:-1], saved[1:], strict=True)]
    assert saved[0] == 10 and gaps[0] == 10  # the second save was decided before the first was measured
    assert gaps[1:] == [floor] * (len(gaps) - 1), gaps
    assert policy.interval_steps == floor and policy.measurements()["stall_s"] == STALL_S
    stalls = {e["step"]: e["stall_s"] for e in read_events(tmp_path / "ck") if e["event"] == "save"}
    assert stalls[saved[1]] > WRITE_S / 2  # the one save that did wait (logged: training was blocked)
    assert all(stalls[s] < WRITE_S / 2 for s in saved[2:] if s in stalls), stalls


BASE = "--nodes 256 --node-failures-per-day 0.0065 --save-stall 30s --restart 10m"


def test_plan_cli_says_error_not_traceback_for_numbers_it_cannot_count_in_steps() -> None:
    """A step time so short that an interval is not a finite number of steps, and an `--every` step
    count too large for a float: `error:` with exit 2, naming the option. Before: an OverflowError
    traceback, exit 1 (from Plan.steps and from parse_every)."""
    import shlex

    from click.testing import CliRunner

    from trainguard.commands.plan import plan_cmd

    for extra, option in (("--step-time 1e-320", "--step-time"), ("--step-time 1e-320 --every 5", "--step-time"),
                          ("--step-time 2s --every " + "9" * 5000, "--every"), ("--step-time 2s --every ²", "--every"), ("--every 1e400s", "--every 1e400s: an interval must be a finite"),
                          ("--every 1e400", "--every 1e400: steps are a whole number")):  # a bare number: steps (test_left48)
        res = CliRunner().invoke(plan_cmd, shlex.split(f"{BASE} {extra} --json"))
        assert res.exit_code == 2 and option in res.output, (extra, res.output)


def test_a_failure_rate_too_small_for_a_float_names_its_own_option() -> None:
    """``--node-failures-per-day 1e-320``: a node MTBF past a float. Before: "--node-mtbf inf must
    be a finite number > 0", an option the user never gave."""
    from click.testing import CliRunner

    from trainguard.commands.plan import plan_cmd

    res = CliRunner().invoke(plan_cmd, ["--nodes", "4", "--node-failures-per-day", "1e-320", "--save-stall", "30s", "--restart", "10m"])
    assert res.exit_code == 2 and "--node-failures-per-day 1e-320 is too small" in res.output, res.output
    assert "--node-mtbf" not in res.output
