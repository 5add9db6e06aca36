"""Failures across real ranks: a rank raising in its write, a rank SIGKILLed mid-save, and the
consistency checks (different step, different entries, save vs load, save on rank 0 only).

Each case must end with no manifest, the previous checkpoint intact, and the same
``RankFailureError`` on every surviving rank, naming the culprit, without hanging.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import trainguard as tg

from dist_helper import attempt, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": nn.Linear(64, 64), "rng": tg.RNGState(), "progress": tg.StateDict(step=1)}


def _crash(point: str, rank: int, kind: str) -> None:
    os.environ.update(TRAINGUARD_CRASH_AT=point, TRAINGUARD_CRASH_RANK=str(rank), TRAINGUARD_CRASH_KIND=kind)


def _no_crash() -> None:
    for k in ("TRAINGUARD_CRASH_AT", "TRAINGUARD_CRASH_RANK", "TRAINGUARD_CRASH_KIND"):
        os.environ.pop(k, None)


def consistency_group(rank: int, world: int, root: str) -> dict:
    from torch.distributed.distributed_c10d import _get_default_store

    state = make_state()
    tg.save(f"{root}/step-000000001", state)
    out = {}
    _crash("write_begin", 1, "raise")
    out["raise"] = attempt(lambda: tg.save(f"{root}/step-000000002", state))
    _no_crash()
    step = 4 if rank == 1 else 3
    out["step"] = attempt(lambda: tg.save(f"{root}/step-{step:09d}", state))
    extra = {**state, "extra": tg.StateDict(a=1)} if rank == 2 else state
    out["entries"] = attempt(lambda: tg.save(f"{root}/step-000000005", extra))
    if rank == 1:
        out["op"] = attempt(lambda: tg.load(f"{root}/step-000000001", make_state(3)))
    else:
        out["op"] = attempt(lambda: tg.save(f"{root}/step-000000006", state))
    # The classic deadlock: `if rank == 0: save(...)`. The others wait outside trainguard.
    store = _get_default_store()
    if rank == 0:
        out["rank0_only"] = attempt(lambda: tg.save(f"{root}/step-000000007", state, timeout=3))
        store.set("test/done", "1")
    else:
        store.wait(["test/done"])
    return out


def kill_group(rank: int, world: int, root: str) -> dict:
    state = make_state()
    # Async saves every step: the background commit's collectives interleave with the manager's
    # per-step "decide" broadcast in a different order on each rank (they use separate channels).
    with tg.CheckpointManager(f"{root}/mgr", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True,
                              timeout=60) as mgr:
        for step in range(6):
            state["model"].weight.data.add_(1.0)
            state["progress"]["step"] = step
            mgr.save(step, state)
    last = mgr.last_saved_step
    state = make_state()
    tg.save(f"{root}/step-000000001", state)
    _crash("write_piece", 1, "kill")
    return {"kill": attempt(lambda: tg.save(f"{root}/step-000000002", state, timeout=120)), "last": last}


def _committed(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "manifest.json")))


def _restores(root: str) -> None:
    ref = make_state()
    fresh = make_state(9)
    assert not torch.equal(fresh["model"].weight, ref["model"].weight)
    tg.load(f"{root}/step-000000001", fresh, only=["model", "progress"])
    assert torch.equal(fresh["model"].weight, ref["model"].weight)


def test_rank_failure_and_consistency_errors(tmp_path: Path) -> None:
    root = str(tmp_path)
    res = run_ranks(consistency_group, 3, root, timeout=120, env=ENV)
    out = [r.value for r in res]
    # One rank raised in its write: every rank raises the same error, with rank 1's traceback.
    assert all(o["raise"]["type"] == "RankFailureError" and o["raise"]["ranks"] == [1] for o in out)
    assert all("injected failure at write_begin on rank 1" in o["raise"]["msg"] for o in out)
    assert len({o["raise"]["msg"] for o in out}) == 1
    # Different steps / different entries: a clear error on every rank naming the odd one out.
    assert all(o["step"]["type"] == "RankFailureError" and "disagree on the step" in o["step"]["msg"] for o in out)
    assert all(o["step"]["ranks"] == [1] for o in out)
    assert all(o["entries"]["ranks"] == [2] and "different set of entries" in o["entries"]["msg"] for o in out)
    # Save on some ranks, load on another: same error everywhere, at once (no timeout).
    assert all(o["op"]["type"] == "RankFailureError" and "'load'" in o["op"]["msg"] for o in out), out
    assert len({o["op"]["msg"] for o in out}) == 1
    # Save on rank 0 only: rank 0 gets an error naming the ranks that never came.
    r0 = out[0]["rank0_only"]
    assert r0["type"] == "RankFailureError" and r0["ranks"] == [1, 2] and "did not arrive" in r0["msg"]
    assert _committed(root) == ["step-000000001"]
    assert os.listdir(root) == ["step-000000001"] or all(".tmp-" not in n for n in os.listdir(root))
    _restores(root)


def test_rank_killed_mid_save(tmp_path: Path) -> None:
    root = str(tmp_path)
    res = run_ranks(kill_group, 3, root, timeout=120, env=ENV, check=False)
    assert res[1].exitcode == -9 and not res[1].timed_out
    for r in (res[0], res[2]):
        assert r.ok, r.error
        k = r.value["kill"]
        # Found by the heartbeat (TRAINGUARD_DEAD_AFTER=3), not by the 120 s timeout.
        assert k["type"] == "RankFailureError" and k["ranks"] == [1] and "stopped responding" in k["msg"], k
    assert res[0].value == res[2].value and res[0].value["last"] == 5
    assert _committed(root) == ["step-000000001"]
    assert _committed(f"{root}/mgr") == ["step-000000004", "step-000000005"]
    _restores(root)


_STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(60)
"""


def test_a_store_whose_host_died_gives_rank_failure_error(tmp_path: Path) -> None:
    # With env:// rendezvous rank 0 hosts the store: when it dies, the others' store calls fail
    # with torch's DistNetworkError, which used to leave trainguard's collectives as it was.
    import subprocess
    import sys
    from datetime import timedelta

    from trainguard.dist import StoreDistContext

    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        ctx = StoreDistContext(store, 1, 2, dead_after_s=2.0)
        host.kill()
        host.wait(timeout=30)
        try:
            ctx.broadcast("decide", None, timeout=5)
        except tg.RankFailureError as e:
            assert "store stopped answering" in str(e)
        else:
            raise AssertionError("broadcast returned although the store's host is dead")
        finally:
            ctx.close()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(timeout=30)


def unshared_group(rank: int, world: int, root: str) -> dict:
    """Each rank resolves the relative run directory in its own working directory: what node-local
    disks (or ranks launched in different directories) look like to trainguard."""
    own = Path(root) / f"node{rank}"
    own.mkdir(parents=True, exist_ok=True)
    os.chdir(own)
    out = attempt(lambda: tg.save("ckpts/step-000000001", make_state()))
    out["left"] = sorted(p.name for p in (own / "ckpts").iterdir()) if (own / "ckpts").exists() else []
    return out


def test_a_run_directory_that_ranks_do_not_share_is_refused(tmp_path: Path) -> None:
    res = run_ranks(unshared_group, 2, str(tmp_path), timeout=120, env=ENV)
    for r in res:
        assert r.value["type"] == "CheckpointError", r.value
        assert "rank 1 wrote and fsynced data-00001.bin" in r.value["msg"]
        assert "storage every rank shares" in r.value["msg"] and "absolute path" in r.value["msg"]
    # Rank 0 committed nothing: no step directory, and its temp directory is gone.
    assert res[0].value["left"] == []
    assert not list((tmp_path / "node0").rglob("manifest.json"))
