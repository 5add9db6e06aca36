"""Threads, forks and signals around async saves (review): each scenario runs in a child
interpreter bounded by a timeout (``conftest.run_py``); the processes it forks are joined with a
timeout and killed by pid."""

from __future__ import annotations

import os
import textwrap
import threading

from conftest import run_py

# An async save held in flight (its background copies wait on a gate) while the script forks.
_PRELUDE = """
import json, os, sys, threading, multiprocessing as mp
import torch
from torch import nn
import trainguard as tg
from trainguard import async_save
root = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear(64, 64)
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 64)).sum().backward()
opt.step()
state = {"model": model, "optim": opt}
tg.save(f"{root}/base", state)
gate = threading.Event()
async_save._before_background_stage = lambda: gate.wait(60)
h = tg.save(f"{root}/inflight", state, async_=True)
"""


def _script(tmp_path, body: str) -> str:
    p = tmp_path / "script.py"
    p.write_text(_PRELUDE + textwrap.dedent(body))
    return str(p)


def test_forked_child_loads_steps_and_saves_while_parent_saves(tmp_path):
    """A process forked while an async save is in flight (an eval process, a Hogwild worker) has
    no save thread. Before: ``tg.load`` and ``optimizer.step()`` there waited forever for that
    save's staging, and an async ``tg.save`` there failed: 'the staging pool is held'."""
    script = _script(tmp_path, """
        def child():
            async_save._before_background_stage = None
            torch.set_num_threads(1)  # torch's own thread pool is not fork-safe (not trainguard's)
            done = []
            def mark(what):
                done.append(what)
                with open(f"{root}/child.json", "w") as f:
                    json.dump(done, f)
            tg.load(f"{root}/base", state); mark("load")
            opt.step(); mark("step")
            tg.save(f"{root}/child-async", state, async_=True).result(); mark("async")
            try:
                h.result(timeout=5)
            except tg.CheckpointError as e:
                mark("parent-handle:" + ("forked" if "forked" in str(e) else str(e)))
        p = mp.get_context("fork").Process(target=child)
        p.start()
        p.join(40)  # bounded (within the 90 s run); 20 s was tight on a loaded 2-core machine
        if p.is_alive():
            os.kill(p.pid, 9)
            p.join()
        gate.set()
        h.result()
        print("EXIT", p.exitcode)
    """)
    r = run_py([script, str(tmp_path)], timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    done = (tmp_path / "child.json").read_text() if (tmp_path / "child.json").exists() else "[]"
    assert done == '["load", "step", "async", "parent-handle:forked"]', (done, r.stderr[-3000:])
    assert "EXIT 0" in r.stdout
    assert (tmp_path / "inflight" / "manifest.json").exists()  # the parent's save committed
    assert (tmp_path / "child-async" / "manifest.json").exists()


def test_dataloader_workers_forked_during_async_save(tmp_path):
    """DataLoader workers (num_workers=2, forked at each epoch's ``iter()``) while an async save is
    in flight: they write nothing, and their exit runs none of trainguard's exit logic. Before,
    each worker's exit (multiprocessing runs threading's exit hooks) logged 'the interpreter is
    exiting; waiting for the async save'."""
    script = _script(tmp_path, """
        data = torch.utils.data.TensorDataset(torch.arange(64.0))
        loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
        seen = [float(x) for epoch in range(2) for (b,) in loader for x in b]
        assert sorted(seen) == sorted(list(range(64)) * 2), seen
        gate.set()
        h.result()
        print("SAVED", sorted(os.listdir(root)))
    """)
    r = run_py([script, str(tmp_path)], timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SAVED ['base', 'inflight', 'script.py']" in r.stdout, r.stdout
    assert "interpreter is exiting" not in r.stderr, r.stderr[-3000:]


def test_async_saves_from_two_threads_take_turns(tmp_path):
    """Two threads of the user each run async ``tg.save`` calls (one save in flight per process:
    the second waits for the first). Before, a save started while the other thread's save was
    between taking the slot and starting its thread failed with 'RuntimeError: cannot join thread
    before it is started' (or found the staging pool held): 14 of 30 saves in a run here."""
    import threading

    import torch

    import trainguard as tg

    states = [{"w": torch.full((64, 64), float(k)), "b": torch.arange(100.0) + k} for k in range(2)]
    barrier = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        for i in range(6):
            try:
                barrier.wait()  # both threads start a save at once
                tg.save(str(tmp_path / f"t{k}-{i}"), states[k], async_=True).result(timeout=30)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, [repr(e) for e in errors]
    for k in range(2):
        for i in range(6):
            out = {"w": torch.zeros(64, 64), "b": torch.zeros(100)}
            tg.load(str(tmp_path / f"t{k}-{i}"), out)
            assert torch.equal(out["w"], states[k]["w"]) and torch.equal(out["b"], states[k]["b"])


class _Blocking:
    """A state entry whose ``state_dict()`` (called inside the save call) waits for ``release``."""

    def __init__(self) -> None:
        import threading

        self.entered, self.release = threading.Event(), threading.Event()
        self.block = True

    def state_dict(self) -> dict:
        if self.block:
            self.entered.set()
            assert self.release.wait(30)
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_manager_refuses_a_second_thread_inside_it(tmp_path):
    """A ``CheckpointManager`` is used from one thread at a time. Before, a second thread's
    ``mgr.save`` ran alongside the first: with async saves one handle was collected twice and
    another never (``save`` events duplicated and missing). Now the second thread gets a
    ``CheckpointError`` and the first thread's save is recorded once; the manager is free again
    afterwards."""
    import json
    import threading

    import torch

    import trainguard as tg

    blocker = _Blocking()
    state = {"w": torch.ones(8), "b": blocker}
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    first = threading.Thread(target=lambda: mgr.save(1, state), daemon=True)
    first.start()
    try:
        assert blocker.entered.wait(30)  # the first thread is inside mgr.save
        errors: list[BaseException] = []

        def second() -> None:
            try:
                mgr.save(2, {"w": torch.zeros(8)})
            except BaseException as e:  # noqa: BLE001 (asserted below)
                errors.append(e)

        t2 = threading.Thread(target=second, daemon=True)
        t2.start()
        t2.join(30)
        assert not t2.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], tg.CheckpointError), errors
        assert "one thread at a time" in str(errors[0])
    finally:
        blocker.release.set()
        first.join(30)
    assert not first.is_alive()
    blocker.block = False
    mgr.save(3, state)  # the main thread may use it now
    mgr.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in events if e["event"] == "save") == [1, 3]


def test_a_child_forked_while_another_thread_saves_has_gc_on_and_free_locks():
    """Another thread inside a save (gc paused, the byte counters' lock held) when the process
    forks: only the forking thread lives on in the child, so that pause would keep the garbage
    collector off there for good, and the lock would stay held (the child's first tg.load hangs
    counting its bytes). The child now starts with both as the forking thread left them."""
    import gc

    from trainguard import gcpause
    from trainguard import io as tg_io

    inside, leave = threading.Event(), threading.Event()

    def saving() -> None:
        with gcpause.gc_paused(), tg_io._COUNTERS_LOCK:
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=saving)
    t.start()
    try:
        assert inside.wait(30) and not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # the child: report by exit code, never return into pytest
            ok = gc.isenabled() and tg_io._COUNTERS_LOCK.acquire(timeout=5)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        leave.set()
        t.join(30)
    assert gc.isenabled()
