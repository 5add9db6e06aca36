"""Processes forked around a live ``CheckpointManager`` (hunt 43, "forks"): each scenario runs in
a child interpreter bounded by a timeout (``conftest.run_py``); the processes it forks end with
``sys.exit``/``os._exit`` and are reaped by pid."""

from __future__ import annotations

import json
import textwrap

from conftest import run_py

# A child forked inside the parent's `with` block leaves it by sys.exit(0) (a worker done): its
# exit status is written to the summary, with the parent's view after it.
_MANAGER_IN_CHILD = """
import json, os, sys, threading
import torch
import trainguard as tg
from trainguard import async_save
from trainguard.events import read_events
root, ram = sys.argv[1], sys.argv[2]
state = {"w": torch.ones(1000)}
out = {}

def child_leaves_the_block():
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # SystemExit unwinds the `with` block in the child: its __exit__ calls close()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def child_saves(mgr):
    pid = os.fork()
    if pid == 0:
        try:
            mgr.save(9, state, force=True)
            code = 3
        except tg.CheckpointError as e:
            code = 0 if "forked this one" in str(e) else 4
        except BaseException:
            code = 5
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

gate = threading.Event()
with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, ram_tier=ram, handle_signals=False) as mgr:
    mgr.save(1, state).join(60)  # committed (into RAM), not yet collected by the manager
    mgr.ram.wait()  # its copy to the run directory is done
    out["committed"] = child_leaves_the_block()
    out["ram_after_committed"] = sorted(os.listdir(mgr.ram.dir))
    async_save._before_background_stage = lambda: gate.wait(60)
    h = mgr.save(2, state)  # in flight: held before its background copies
    out["in_flight"] = child_leaves_the_block()
    out["child_save"] = child_saves(mgr)
    gate.set()
    h.join(60)
    mgr.ram.wait()
    out["ram_before_close"] = sorted(os.listdir(mgr.ram.dir))
out["steps"] = sorted(d for d in os.listdir(root) if d.startswith("step-"))
out["events"] = [(e["pid"] == os.getpid(), e["event"], e.get("step")) for e in read_events(root)]
print("OUT " + json.dumps(out))
"""


def test_a_forked_child_leaving_the_with_block_leaves_the_parents_manager_alone(tmp_path):
    """``os.fork`` inside ``with CheckpointManager(...)``, the child ending with ``sys.exit(0)``:
    its ``__exit__`` ran ``close()`` on its copy of the parent's manager. Before: with a save
    committed but not yet collected, the child wrote that save's ``save`` event a second time and
    removed the parent's RAM tier (``ram_tier``); with a save in flight, it wrote a ``save_failed``
    of the parent's save into events.jsonl and exited 1 with a CheckpointError. A ``save()`` in the
    child was refused as if another job held the lock, and logged ``save_failed``. Now the child's
    ``close()`` touches nothing of the parent's, and its ``save()`` says the manager is the parent's."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_MANAGER_IN_CHILD))
    ram = tmp_path / "shm"
    ram.mkdir()
    r = run_py([str(script), str(tmp_path / "run"), str(ram)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line[4:] for line in r.stdout.splitlines() if line.startswith("OUT ")))
    assert out["committed"] == 0 and out["in_flight"] == 0, (out, r.stderr[-3000:])
    assert out["child_save"] == 0, out
    assert "step-000000001" in out["ram_after_committed"], out  # the RAM tier: before, removed by the child
    assert "step-000000002" in out["ram_before_close"], out
    assert out["steps"] == ["step-000000001", "step-000000002"], out
    assert all(mine for mine, _e, _s in out["events"]), out["events"]  # no line of a child's
    saves = [s for _m, e, s in out["events"] if e == "save"]
    assert saves == [1, 2], out["events"]
    assert not [e for _m, e, _s in out["events"] if e == "save_failed"], out["events"]



_TERMINATE = """
import json, multiprocessing as mp, os, signal, sys
import trainguard as tg

def work(ready):
    ready.set()
    mp.Event().wait(60)  # bounded: the parent terminates it

def sigint_kept():
    os._exit(0 if getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_on_signal" else 1)

def run(ctx, target, *args):
    p = ctx.Process(target=target, args=args)
    p.start()
    if args:
        assert args[0].wait(30)
        p.terminate()
    p.join(30)
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    return p.exitcode

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    codes = {}
    with tg.CheckpointManager(sys.argv[1]) as a:
        codes["default"] = run(ctx, work, ctx.Event())
        codes["sigint"] = run(ctx, sigint_kept)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(7))  # the script's own, before two managers
    with tg.CheckpointManager(sys.argv[1]) as a, tg.CheckpointManager(sys.argv[2]) as b:
        codes["chain"] = run(ctx, work, ctx.Event())
        codes["parent"] = signal.getsignal(signal.SIGTERM) == b._on_signal
    print("CODES " + json.dumps(codes))
"""


def test_terminate_stops_a_child_forked_while_a_manager_is_open(tmp_path):
    """``multiprocessing``'s fork children inherited the manager's SIGTERM handler, which only sets a
    flag on the (parent's) manager: ``Process.terminate()`` left the child running (and
    ``Pool.terminate()`` hung). Now a forked child gets back the SIGTERM handler that the managers'
    ``open()`` replaced, through their chain (SIG_DFL: killed by SIGTERM; the script's own: it ran);
    SIGINT keeps the manager's handler (a Ctrl-C to the whole group spares DataLoader workers), and
    the parent's handlers are unchanged."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_TERMINATE))
    r = run_py([str(script), str(tmp_path / "a"), str(tmp_path / "b")], timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = json.loads(next(line[6:] for line in r.stdout.splitlines() if line.startswith("CODES ")))
    assert codes == {"default": -15, "sigint": 0, "chain": 7, "parent": True}, (codes, r.stderr[-3000:])


_SAVE_FROM_A_THREAD_AT_EXIT = """
import sys, threading
import torch
import trainguard as tg
from trainguard import async_save

def train():
    threading.main_thread().join()  # the main thread has ended: the interpreter's exit has begun
    async_save._before_background_stage = trainer.join  # written only once this thread has ended too
    tg.save(sys.argv[1], {"w": torch.arange(1000.0)}, async_=True)

trainer = threading.Thread(target=train)  # not a daemon: the exit joins it
trainer.start()
"""


def test_an_async_save_started_by_a_thread_after_the_main_thread_ended_is_finished_at_exit(tmp_path):
    """docs/async.md: at interpreter exit a save in flight is finished, not dropped. The exit hook
    ran before the non-daemon threads were joined: a save that a training thread started after the
    main thread had ended was killed with the interpreter (its save thread is a daemon), exit 0, only
    a temp directory left. Now the hook runs again after they were joined."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_SAVE_FROM_A_THREAD_AT_EXIT))
    r = run_py([str(script), str(tmp_path / "last")], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "last" / "manifest.json").exists(), (sorted(p.name for p in tmp_path.iterdir()), r.stderr[-3000:])
    import torch

    import trainguard as tg

    got = {"w": torch.zeros(1000)}
    tg.load(str(tmp_path / "last"), got)
    assert torch.equal(got["w"], torch.arange(1000.0))
