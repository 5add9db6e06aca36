"""Review of ranks, threads and async failures (threads16): what the per-operation rounds
(``dist.StoreDistContext.operation``, ``distwait.py``) left open.

Every scenario runs real gloo ranks on 127.0.0.1 (``dist_helper.run_ranks``), bounded in time.
"""

from __future__ import annotations

import contextlib

import trainguard as tg
from test_rejoin import ENV, _same, _state

from dist_helper import run_ranks


def _outcome(fn) -> dict:  # noqa: ANN001
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared by the test
        return {"type": type(e).__name__, "permanent": tg.exit_code_for(e) == 78, "msg": str(e)}
    return {"type": None}


def _bad_step_on_rank_1(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False, timeout=20).open()
    out = _outcome(lambda: mgr.save(-1 if rank == 1 else 1, _state(1)))
    dist.barrier()  # rank 1 stays alive (its heartbeat beats): only its mark can tell the others
    return out


def test_a_permanent_error_on_one_rank_fails_the_others_at_once_with_a_permanent_error(tmp_path):
    # Before: rank 1's ValueError (exit 78) was never exchanged; ranks 0 and 2 waited in "begin"
    # for the whole timeout (20 s here, TRAINGUARD_TIMEOUT) and then failed with a transient
    # "did not arrive" error: under `trainguard run` a restart or exit 78 depending on which
    # worker's exit the agent saw first.
    res = run_ranks(_bad_step_on_rank_1, 3, str(tmp_path), timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["type"] == "ValueError" and vals[1]["permanent"], vals
    for v in (vals[0], vals[2]):  # rank 2 gets rank 0's verdict through the store: permanent too
        assert v["type"] == "RankFailureError" and v["permanent"], vals
        assert "rank(s) [1] failed with an error that no restart fixes" in v["msg"] and "step=-1" in v["msg"], vals
    assert vals[0]["msg"] == vals[2]["msg"], vals


def _ctrl_c_after_the_save_thread_started(rank: int, world: int, root: str) -> dict:
    import threading
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    import trainguard.async_save as asv
    import trainguard.distwait as dw

    store, out = _get_default_store(), {}
    if rank == 0:  # say when it looked at rank 1's "at" key after rank 1 caught its Ctrl-C
        real_check = dw._check_left

        def check_left(*a):  # noqa: ANN002, ANN202
            try:
                return real_check(*a)
            finally:
                if store.check(["t16/caught"]):
                    store.set("t16/looked", "1")

        dw._check_left = check_left
        out["first"] = _outcome(lambda: tg.save(f"{root}/a", _state(1), async_=True, timeout=20).result())
        dw._check_left = real_check
    else:
        real = threading.Thread.start

        def start_then_ctrl_c(self) -> None:  # noqa: ANN001
            real(self)
            if self.name == "trainguard-async-save":
                threading.Thread.start = real
                asv._INFLIGHT.go.set()  # as start_async_save does once start() returned: the thread may begin
                while asv._INFLIGHT is not None and asv._INFLIGHT.began is False:  # until its thread owns the rounds
                    threading.Event().wait(0.001)
                raise KeyboardInterrupt  # after start(), before the call returns

        # The save thread writes its data only once rank 0 looked at where rank 1 is.
        asv._before_background_stage = lambda: store.wait(["t16/looked"], timedelta(seconds=30))
        threading.Thread.start = start_then_ctrl_c
        try:
            tg.save(f"{root}/a", _state(1), async_=True, timeout=20)
            out["first"] = {"type": None}
        except KeyboardInterrupt:
            out["first"] = {"type": "KeyboardInterrupt"}
        store.set("t16/caught", "1")
        asv._INFLIGHT.handle.join()
        asv._before_background_stage = None
    out["second"] = _outcome(lambda: tg.save(f"{root}/b", _state(2), async_=True, timeout=20).result())
    out["loads"] = _outcome(lambda: _same(root, "a", 1) or 1 / 0)
    return out


def test_a_ctrl_c_after_the_async_save_thread_started_does_not_fail_that_save(tmp_path):
    # Before: the call's operation marked rank 1 LEFT although its save thread was running the
    # save's rounds: rank 0 failed the save ("rank(s) [1] left this trainguard call"), and so did
    # rank 1's own thread; nothing was committed.
    res = run_ranks(_ctrl_c_after_the_save_thread_started, 2, str(tmp_path), timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["first"] == {"type": "KeyboardInterrupt"}, vals
    assert vals[0]["first"] == {"type": None}, vals
    assert [v["second"] for v in vals] == [{"type": None}] * 2, vals
    assert [v["loads"] for v in vals] == [{"type": None}] * 2, vals


def _two_threads(rank: int, world: int, root: str) -> dict:
    import threading

    out: dict = {}
    made = threading.Lock()  # _state seeds torch's global generator: two threads building at once mixed their draws

    def state(seed: int) -> dict:
        with made:
            return _state(seed)

    def manager(name: str, then_direct: bool) -> None:
        mgr = tg.CheckpointManager(f"{root}/{name}", save=tg.EveryNSteps(1), handle_signals=False, timeout=15).open()
        res = [_outcome(lambda: mgr.restore(state(0)))]
        res += [_outcome(lambda s=s: mgr.save(s, state(s))) for s in (1, 2, 3)]
        res.append(_outcome(mgr.close))
        if then_direct:  # tg.save in this thread while the main thread's manager saves
            res += [_outcome(lambda s=s: tg.save(f"{root}/direct/{s}", state(s), timeout=15)) for s in (1, 2, 3)]
        out[name] = [r["type"] for r in res]

    other = threading.Thread(target=manager, args=("b", True))
    other.start()
    manager("a", False)
    other.join(45)
    out["loads"] = _outcome(lambda: (_same(f"{root}/a", "step-000000003", 3) and _same(f"{root}/b", "step-000000003", 3)
                                     and _same(f"{root}/direct", "3", 3)) or 1 / 0)
    return out


def test_two_managers_used_from_two_threads_and_a_direct_save_in_one_do_not_mix_their_rounds(tmp_path):
    # Before: both managers (and tg.save) numbered their rounds on one channel of the process,
    # whose operation() nesting counter the threads shared: thread b's call counted as nested in
    # thread a's, each rank interleaved the threads' rounds in its own order, and the two threads'
    # first calls could even create two contexts; every open/save failed after the timeout
    # ("did not arrive within 15 s"). Now each manager has its own channel (its root), a
    # manager's nested tg.load uses it, and the context is created once.
    res = run_ranks(_two_threads, 2, str(tmp_path), timeout=90, env=ENV)
    vals = [r.value for r in res]
    assert [v["a"] for v in vals] == [[None] * 5] * 2, vals
    assert [v["b"] for v in vals] == [[None] * 8] * 2, vals
    assert [v["loads"] for v in vals] == [{"type": None}] * 2, vals


def _failing_once(monkeypatch) -> None:  # noqa: ANN001
    import trainguard.async_save as asv

    real = asv.persist_and_commit

    def fail(*a, **k):  # noqa: ANN002, ANN003, ANN202
        monkeypatch.setattr(asv, "persist_and_commit", real)
        raise OSError(5, "injected write error")

    monkeypatch.setattr(asv, "persist_and_commit", fail)


def test_an_async_failure_collected_with_result_is_not_raised_again_by_the_manager(tmp_path, monkeypatch):
    import json

    # Before: the manager raised the failure of step 1 again at save(2) although the loop had
    # collected and handled it with handle.result(): step 2 was not saved and the run stopped.
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    _failing_once(monkeypatch)
    h = mgr.save(1, _state(1))
    assert _outcome(h.result)["type"] == "OSError"
    assert mgr.save(2, _state(2)) is not None
    mgr.wait()
    assert mgr.latest_step() == 2 and mgr.last_saved_step == 2
    # One never collected is still raised at the next call (docs/async.md).
    _failing_once(monkeypatch)
    mgr.save(3, _state(3))
    got = _outcome(mgr.wait)
    assert got["type"] == "CheckpointError" and "injected write error" in got["msg"], got
    mgr.close()
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    failed = [e["step"] for e in events if e["event"] == "save_failed"]
    assert failed == [1, 3], events  # the collected failure is still recorded


def _mismatch_then_rounds(ctx) -> None:  # noqa: ANN001
    with ctx.operation(), contextlib.suppress(tg.RankFailureError):  # rank 1 loads while rank 0 saves
        ctx.all_gather("load" if ctx.rank == 1 else "begin", ctx.rank)
    for i in range(4):
        with ctx.operation():
            assert ctx.all_gather("begin", i) == [i] * ctx.world_size


def test_the_keys_of_a_mismatched_round_are_deleted_like_the_others():
    from test_store_keys import _run_ranks

    # Before: rank 0's verdict for the ranks in the other collective ("load") and their own keys
    # stayed in the store for good, one set per mismatch.
    server, ctxs = _run_ranks(_mismatch_then_rounds, 2)
    try:
        ctxs[0].store.drain()
        left = [k for k in ("all", "0", "1") if server.check([f"trainguard/0/main/r1.1/load/{k}"])]
        assert left == [], left
        assert not server.check(["trainguard/0/main/r1.1/begin/all"])
    finally:
        for c in ctxs:
            c.close()


def _spelled_otherwise(rank: int, world: int, root: str) -> dict:
    import os

    os.makedirs(f"{root}/mnt", exist_ok=True)
    if rank == 1 and not os.path.exists(f"{root}/elsewhere"):
        os.symlink(f"{root}/mnt", f"{root}/elsewhere")  # one node mounts the shared directory elsewhere
    run = f"{root}/{'elsewhere' if rank == 1 else 'mnt'}/run1"
    mgr = tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False, timeout=15).open()
    out = [_outcome(lambda: mgr.restore(_state(0)))]
    out += [_outcome(lambda s=s: mgr.save(s, _state(s))) for s in (1, 2)]
    out.append(_outcome(mgr.close))
    return {"calls": [r["type"] for r in out], "loads": _outcome(lambda: _same(f"{root}/mnt/run1", "step-000000002", 2) or 1 / 0)}


def test_ranks_spelling_the_run_directory_otherwise_share_its_manager_rounds(tmp_path):
    # Each manager's rounds are a channel of their own (two threads' managers); named by the whole
    # root, ranks whose paths differ (a symlink, another mount point) met in no round and every
    # call waited the whole timeout. Named by the directory's last part they meet.
    res = run_ranks(_spelled_otherwise, 2, str(tmp_path), timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert [v["calls"] for v in vals] == [[None] * 4] * 2, vals
    assert [v["loads"] for v in vals] == [{"type": None}] * 2, vals
