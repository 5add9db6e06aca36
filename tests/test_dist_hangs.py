"""Hung ranks, not dead ones: rank 0 SIGSTOPped in the middle of a save on real gloo ranks.

The other ranks give up on it after ``TRAINGUARD_DEAD_AFTER`` (its heartbeat stops with it) and
raise. What is checked here is what happens when rank 0 is SIGCONTed afterwards (a node that
was only frozen): it must raise the same error in the same round, commit nothing the others
were told failed, and leave the ranks' collectives in step, so the next save works.

Each rank function publishes rank 0's PID in the store; rank 1 sends the SIGCONT only after its
own save raised, so the order is fixed by the test, not by timing.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "2"}


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": nn.Linear(16, 16), "progress": tg.StateDict(step=1)}


def _attempt(fn: Any) -> dict:
    try:
        fn()
    except tg.RankFailureError as e:
        return {"type": "RankFailureError", "msg": str(e).splitlines()[0], "ranks": sorted(e.failures)}
    except Exception as e:  # noqa: BLE001 - reported to the test as a wrong outcome
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None}


def _save(root: str, step: int, state: dict, async_: bool) -> None:
    out = tg.save(f"{root}/step-{step:09d}", state, timeout=3, async_=async_)
    if async_:
        out.result()


def _stop_rank0_then_resume(rank: int, root: str, step: int, stop: Any, async_: bool) -> dict:
    """Every rank: save ``step`` with ``stop()`` making rank 0 SIGSTOP itself on the way; rank 1,
    once its save raised, SIGCONTs rank 0; then every rank saves ``step + 1``."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if rank == 0:
        store.set("test/pid0", str(os.getpid()))
    state = _state()
    stop()
    out = {"hung": _attempt(lambda: _save(root, step, state, async_))}
    os.environ.pop("TRAINGUARD_CRASH_AT", None)
    if rank == 1:
        os.kill(int(store.get("test/pid0")), signal.SIGCONT)
    out["next"] = _attempt(lambda: _save(root, step + 1, state, async_))
    return out


def stopped_at_commit(rank: int, world: int, root: str, async_: bool) -> dict:
    def stop() -> None:  # rank 0 stops with every rank's data durable, before the manifest
        os.environ.update(TRAINGUARD_CRASH_AT="before_manifest", TRAINGUARD_CRASH_RANK="0", TRAINGUARD_CRASH_KIND="stop")

    tg.save(f"{root}/step-000000001", _state(), timeout=3)
    return _stop_rank0_then_resume(rank, root, 2, stop, async_)


def stopped_in_begin(rank: int, world: int, root: str) -> dict:
    import trainguard.api as api

    real = api.occupied

    def occupied(*args: Any, **kwargs: Any) -> Any:  # rank 0 only, inside the "begin" round, before it publishes
        api.occupied = real
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return real(*args, **kwargs)

    def stop() -> None:
        if rank == 0:
            api.occupied = occupied

    tg.save(f"{root}/step-000000001", _state(), timeout=3)
    return _stop_rank0_then_resume(rank, root, 2, stop, False)


def _committed(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "manifest.json")))


def _check(res: list, root: Path) -> None:
    hung = [r.value["hung"] for r in res]
    # The same error on both ranks, naming rank 0; rank 0 (resumed) raises it too.
    assert all(h["type"] == "RankFailureError" and h["ranks"] == [0] for h in hung), hung
    assert "stopped responding" in hung[1]["msg"] and hung[0] == hung[1], hung
    # The resumed rank 0 committed nothing, removed its temp directory, and the ranks are still
    # in step: the next save commits on both.
    assert [r.value["next"] for r in res] == [{"type": None}] * 2, [r.value for r in res]
    assert _committed(str(root)) == ["step-000000001", "step-000000003"]
    assert sorted(os.listdir(root)) == ["step-000000001", "step-000000003"]
    assert tg.CheckpointManager(str(root)).latest_step() == 3


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_rank0_resumed_after_the_others_gave_up_does_not_commit(tmp_path: Path, async_: bool) -> None:
    res = run_ranks(stopped_at_commit, 2, str(tmp_path), async_, timeout=120, env=ENV)
    _check(res, tmp_path)


def test_rank0_resumed_inside_a_round_leaves_the_ranks_in_step(tmp_path: Path) -> None:
    # Before the fix, rank 1 left the "begin" round while rank 0, resumed, went on to the next
    # one: from then on every collective of that channel paired different rounds and failed.
    res = run_ranks(stopped_in_begin, 2, str(tmp_path), timeout=120, env=ENV)
    _check(res, tmp_path)


def store_host_frozen(rank: int, world: int, root: str) -> dict:
    """Like ``env://`` rendezvous: rank 0 hosts the c10d store of the process group (the helper's
    store only passes the port). Rank 0 freezes in an async save's commit; rank 1 must get
    an error, not a hang, from ``close()`` (it waits for that save), and then SIGCONTs rank 0."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    helper = _get_default_store()
    dist.destroy_process_group()
    if rank == 0:
        host = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=60), wait_for_workers=False)
        helper.set("test/port", str(host.port))
        helper.set("test/pid0", str(os.getpid()))
    else:
        host = dist.TCPStore("127.0.0.1", int(helper.get("test/port")), world, False, timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg2", host), rank=rank, world_size=world)
    state = _state()
    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=True, timeout=3, handle_signals=False).open()
    mgr.save(1, state)
    mgr.wait()
    os.environ.update(TRAINGUARD_CRASH_AT="before_manifest", TRAINGUARD_CRASH_RANK="0", TRAINGUARD_CRASH_KIND="stop")
    mgr.save(2, state)
    out = {"close": _attempt(mgr.close)}  # waits for save 2, then raises its error
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("trainguard-async-save"))
    if rank == 1:
        os.kill(int(helper.get("test/pid0")), signal.SIGCONT)
    return out


def test_a_frozen_store_host_gives_errors_not_a_hang(tmp_path: Path) -> None:
    # Before the fix, rank 1 waited in wait() until the helper killed it (the store's calls block
    # while its host is stopped, whatever the store's or trainguard's timeout).
    res = run_ranks(store_host_frozen, 2, str(tmp_path), timeout=120, env=ENV)
    r1 = res[1].value
    assert r1["close"]["type"] == "RankFailureError" and r1["close"]["ranks"] == [0], r1
    assert "commit: the c10d store stopped answering" in r1["close"]["msg"], r1
    assert "did not answer check within 2 s" in r1["close"]["msg"], r1
    # Rank 0 may commit once it resumes (below): the error does not call the save failed for sure.
    assert "step-000000002 may or may not be committed: rank 0" in r1["close"]["msg"], r1
    assert r1["threads"] == [], r1
    # Rank 0, resumed, finished on its own (it may have committed step 2: every rank's data was
    # durable and nobody could tell it otherwise through the frozen store).
    assert res[0].value["threads"] == []
    assert "step-000000001" in _committed(str(tmp_path))


def stalled_write(rank: int, world: int, root: str) -> dict:
    """Rank 1's filesystem stalls as it starts to write (its heartbeat keeps beating): it blocks
    at the "begin" fault point, before it creates the temp directory, until rank 0's save has
    raised; then every rank saves the next step."""
    import time

    import trainguard.api as api

    tg.save(f"{root}/step-000000001", _state(), timeout=3)
    real, release = api.fault, f"{root}.release"

    def stall(point: str, r: int = 0) -> None:
        if point == "begin" and rank == 1:
            while not os.path.exists(release):  # bounded by run_ranks' timeout
                time.sleep(0.02)
        real(point, r)

    api.fault = stall
    out = {"hung": _attempt(lambda: _save(root, 2, _state(), False))}
    api.fault = real
    if rank == 0:
        Path(release).touch()
    out["next"] = _attempt(lambda: _save(root, 3, _state(), False))
    return out


def test_a_rank_stuck_in_its_write_is_named_as_such_and_cleans_up(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    res = run_ranks(stalled_write, 2, str(root), timeout=120, env=ENV)
    hung = [r.value["hung"] for r in res]
    # Rank 0 gives up after timeout=3 (rank 1's heartbeat beats) with an error naming rank 1 as
    # stuck in its write, not as a rank that never called save; rank 1 raises the same.
    assert all(h["type"] == "RankFailureError" and h["ranks"] == [1] for h in hung), hung
    assert hung[0] == hung[1] and "rank(s) [1] did not finish writing its data within 3 s" in hung[0]["msg"], hung
    assert [r.value["next"] for r in res] == [{"type": None}] * 2, [r.value for r in res]
    assert _committed(str(root)) == ["step-000000001", "step-000000003"]
    # Rank 1 resumed after rank 0 had removed the temp directory and created it again for its
    # data file; told it failed, it removes it too: no step-000000002.tmp-* left behind.
    assert sorted(os.listdir(root)) == ["step-000000001", "step-000000003"]


def stopped_in_restore(rank: int, world: int, root: str) -> dict:
    """Rank 0 stops while it lists the run directory for the resume decision (before its
    "candidates" broadcast); rank 1 SIGCONTs it once its restore raised; both restore again."""
    import threading

    from torch.distributed.distributed_c10d import _get_default_store

    import trainguard.relist as retention  # restore_candidates lists the run directory (relist.committed_steps)

    store = _get_default_store()
    if rank == 0:
        store.set("test/pid0", str(os.getpid()))
    state = _state()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), timeout=3, handle_signals=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    real = retention.list_steps

    def list_steps(*args: Any) -> Any:
        retention.list_steps = real
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return real(*args)

    if rank == 0:
        retention.list_steps = list_steps
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), timeout=3, handle_signals=False) as mgr:
        out = {"hung": _attempt(lambda: mgr.restore(state))}
        if rank == 1:
            os.kill(int(store.get("test/pid0")), signal.SIGCONT)
        out["again"] = mgr.restore(state)
        mgr.save(3, state)
    return out


def test_rank0_resumed_inside_the_resume_decision_leaves_restore_working(tmp_path: Path) -> None:
    # Before the fix: rank 0, resumed, went on to "load" while rank 1 had left "candidates";
    # the second restore and the next save failed too.
    res = run_ranks(stopped_in_restore, 2, str(tmp_path), timeout=120, env=ENV)
    hung = [r.value["hung"] for r in res]
    assert all(h["type"] == "RankFailureError" and h["ranks"] == [0] for h in hung) and hung[0] == hung[1], hung
    assert "candidates: rank(s) [0] stopped responding" in hung[0]["msg"], hung
    assert [r.value["again"] for r in res] == [2, 2]
    assert _committed(str(tmp_path)) == ["step-000000001", "step-000000002", "step-000000003"]
