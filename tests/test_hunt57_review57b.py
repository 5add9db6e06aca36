"""Crash safety of saves, hostile review (hunt57, review57b): SIGKILL at points the crash matrices did not reach.

Each child is killed by SIGKILL (it sends it to itself at the chosen moment: the moment is exact, and
no sleep synchronises anything); its exit is waited for with a bound (``forked``). After the kill: the
previous checkpoints load bit-identical, nothing that ``trainguard ls``/``verify`` or a restore sees
as a checkpoint has lost its data, and the same step saves again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch

import trainguard as tg
from trainguard.inspect import list_checkpoints


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(50_000, generator=g), "b": torch.randn(300, generator=g)},
            "progress": tg.StateDict(step=step)}


def same(a: dict, b: dict) -> bool:
    return (a["progress"]["step"] == b["progress"]["step"] and torch.equal(a["model"]["w"], b["model"]["w"])
            and torch.equal(a["model"]["b"], b["model"]["b"]))


KILL_IN_RAM_TIER_REMOVAL = r"""
import os, signal, sys
import test_hunt57_review57b as t
import trainguard as tg
run, ram = sys.argv[1], sys.argv[2]
mgr = tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=ram, handle_signals=False)
mgr.open()
mgr.save(1, t.state_for(1))
mgr.save(2, t.state_for(2))
mgr.wait()
mgr.ram.wait()
unlink = os.unlink
def killing_unlink(path, *a, **k):  # close() removes the RAM tier: killed once its first data file is gone
    unlink(path, *a, **k)
    if os.path.basename(os.fsdecode(path)).startswith("data-"):
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = killing_unlink
mgr.close()
print("close returned")
"""


def _torn_ram_steps(ram: Path) -> list[str]:
    """RAM-tier step directories that hold a manifest whose data files are not all there."""
    out = []
    for d, _dirs, files in os.walk(ram):
        if "manifest.json" in files:
            wanted = json.loads(Path(d, "manifest.json").read_text())["manifest"]["files"]
            if any(not Path(d, f).exists() for f in wanted):
                out.append(f"{d}: {sorted(files)}")
    return out


def test_kill_while_close_removes_the_ram_tier_leaves_no_manifest_without_its_data(tmp_path, forked, caplog):
    """SIGKILL while ``close()`` removes the RAM tier (its last copy already on disk). Before, the tier was
    removed by one ``rmtree`` of its directory: the data file of a step went before that step's manifest,
    and the kill left ``step-N/manifest.json`` alone in RAM. The next open took it for a checkpoint: the
    restore tried it first, said "checkpoint of step 2 is not usable (data file is missing), trying an
    older one", and only then loaded the copy on disk. Found by killing a RAM-tier run at each of its 87
    write/rename/unlink/fsync calls. Now each step's manifest is removed (durably) before its data."""
    run, ram = tmp_path / "run", tmp_path / "ram"
    ram.mkdir()
    code = forked(KILL_IN_RAM_TIER_REMOVAL, run, ram, log=tmp_path / "child.log")
    assert code == -signal.SIGKILL, (tmp_path / "child.log").read_text()
    assert _torn_ram_steps(ram) == []
    assert [r.step for r in list_checkpoints(run) if r.status == "valid"] == [1, 2]
    got = state_for(99)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=str(ram),
                              handle_signals=False) as mgr:
        with caplog.at_level("WARNING", logger="trainguard"):
            assert mgr.restore(got) == 2
        assert "not usable" not in caplog.text, caplog.text
        assert same(got, state_for(2))
        mgr.save(3, state_for(3))
        mgr.wait()
        mgr.ram.wait()
    fresh = state_for(99)
    tg.load(run / "step-000000003", fresh)
    assert same(fresh, state_for(3))


KILL_AT_CALL = r"""
import os, signal, sys, threading
import test_hunt57_review57b as t
import trainguard as tg
run, mode, k, countfile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
lock, n = threading.Lock(), [0]
def counted(orig):
    def call(*a, **kw):
        with lock:
            n[0] += 1
            if n[0] == k:  # before the k-th call: it does not happen
                os.kill(os.getpid(), signal.SIGKILL)
            if not k:
                with open(countfile, "w") as f:
                    f.write(str(n[0]))
        return orig(*a, **kw)
    return call
for name in t.FS_CALLS:
    if hasattr(os, name):
        setattr(os, name, counted(getattr(os, name)))
with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=mode == "async",
                          handle_signals=False) as mgr:
    s = t.state_for(3)
    mgr.save(3, s)
    s["model"]["w"].add_(1.0)  # training goes on (an async save persists what it had when save() returned)
    mgr.wait()
"""

FS_CALLS = ("open", "write", "pwrite", "pwritev", "writev", "fsync", "fdatasync", "ftruncate", "posix_fallocate",
            "rename", "replace", "unlink", "rmdir", "mkdir", "link", "symlink")


def _after_kill(run: Path) -> list[str]:
    """What a kill may not leave: a valid-looking step that fails verify or loads other bytes, step 2 harmed,
    debris after the next open, a restore of anything but the newest valid step, a step 3 that cannot be saved."""
    problems = []
    valid = [r for r in list_checkpoints(run) if r.status == "valid"]
    if [r.step for r in valid][-2:] not in ([1, 2], [2, 3]):
        problems.append(f"valid steps {[r.step for r in valid]}")
    for r in valid:
        got = state_for(99)
        tg.load(r.path, got)
        if not tg.verify(r.path).ok or not same(got, state_for(r.step)):
            problems.append(f"{r.name} is listed valid but does not verify or load its own state")
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        left = [n for n in os.listdir(run) if ".tmp-" in n or ".old-" in n]
        got = state_for(99)
        step = mgr.restore(got)
        if left or step != valid[-1].step or not same(got, state_for(step)):
            problems.append(f"after the next open: debris {left}, restored {step}")
        if step != 3:
            mgr.save(3, state_for(3))
    got = state_for(99)
    tg.load(run / "step-000000003", got)
    return problems + ([] if same(got, state_for(3)) else ["step 3 saved after the kill does not load"])


def test_sigkill_before_each_file_system_call_of_a_save_and_its_retention(tmp_path, forked):
    """A manager's save of step 3 over steps 1 and 2 (``KeepLatest(2)``: its retention deletes step 1)
    SIGKILLed before each of its file system calls in turn (open, write, fsync, rename, unlink,
    ...: 30 to 40 of them, the named fault points and the deletes of retention among them). After each kill:
    ``_after_kill``. The named fault points and random byte counts (test_reliability_crash.py) left out the
    calls between them: the temp manifest's write and rename, the directory fsyncs, each file of retention's
    delete, the run lock's and the event log's writes."""
    template = tmp_path / "template"
    with tg.CheckpointManager(template, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    problems, trials = [], 0
    for mode in ("sync",):  # async: the same calls in another thread (37 more trials, about 35 s here; 0 problems)
        count = tmp_path / f"count-{mode}"
        run = tmp_path / f"{mode}-0"
        shutil.copytree(template, run)
        assert forked(KILL_AT_CALL, run, mode, 0, count, log=tmp_path / "child.log") == 0, (tmp_path / "child.log").read_text()
        calls = int(count.read_text())
        assert calls > 20, calls  # the patched calls are the ones the save makes
        for k in range(1, calls + 1):
            run = tmp_path / f"{mode}-{k}"
            shutil.copytree(template, run)
            code = forked(KILL_AT_CALL, run, mode, k, count, log=tmp_path / "child.log")
            trials += 1
            found = ([] if code == -signal.SIGKILL else [f"exit {code}"]) + _after_kill(run)
            problems += [f"{mode} kill before call {k}/{calls}: {p}" for p in found]
            shutil.rmtree(run)
    print(f"review57b sweep: trials={trials} problems={len(problems)}")
    assert problems == []
