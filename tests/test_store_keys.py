"""Rank 0 deletes the c10d store keys of finished collective rounds (broadcasts too: a manager
broadcasts its save decision at every step) and the commit fences, in the background: over a
long run the store holds a bounded number of trainguard keys."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.dist import StoreDistContext
from trainguard.storecall import BoundedStore

WORLD = 3


def _run_ranks(fn, world: int = WORLD) -> tuple[dist.TCPStore, list[StoreDistContext]]:
    """Run ``fn(ctx)`` on ``world`` ranks (threads, one store client each); returns the server
    store and the contexts (closed by the caller)."""
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, world, False, timeout=timedelta(seconds=30)) for _ in range(world)]
    ctxs: list[StoreDistContext | None] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ctxs[r] = StoreDistContext(clients[r], r, world, dead_after_s=20.0)
            fn(ctxs[r])
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return server, [c for c in ctxs if c is not None]


def _like_a_manager(ctx: StoreDistContext, steps: int = 120, every: int = 20) -> None:
    """The rounds of a distributed manager: a decision broadcast per step, a save's begin /
    written / commit rounds and rank 0's commit fence every ``every`` steps."""
    for step in range(1, steps + 1):
        with ctx.operation():  # a manager's save() is one operation
            _one_step(ctx, step, every)


def _one_step(ctx: StoreDistContext, step: int, every: int) -> None:
    assert ctx.broadcast("decide", [step % every == 0, False] if ctx.rank == 0 else None) == [step % every == 0, False]
    if step % every == 0:
        assert ctx.all_gather("begin", {"rank": ctx.rank})[ctx.rank] == {"rank": ctx.rank}
        got = ctx.gather("written", ctx.rank)
        if ctx.rank == 0:
            assert got == list(range(ctx.world_size))
            assert ctx.fence(f"commit/{step}", {"committing": 0}) == {"committing": 0}
        assert ctx.broadcast("commit", {"step": step} if ctx.rank == 0 else None) == {"step": step}



def test_keys_of_finished_rounds_and_fences_are_deleted():
    server, ctxs = _run_ranks(_like_a_manager)
    try:
        ctxs[0].store.drain()
        found = _keys(server)
        fences = [k for k in found if "/fence/" in k]
        rounds = [k for k in found if "/fence/" not in k]
        # 120 steps made 120 decision rounds and 6 saves of 3 rounds; left: the last rounds only,
        # which no later round has passed yet (before: every decision key, every fence stayed).
        assert len(fences) <= 1, fences
        assert len(rounds) <= 3 * (WORLD + 1), rounds
        assert server.num_keys() < 40, sorted(_keys(server))
    finally:
        for c in ctxs:
            c.close()


def _keys(server: dist.TCPStore) -> list[str]:
    """The trainguard keys of the rounds and fences still in the store (TCPStore cannot list its
    keys: check the ones the collectives above can have created)."""
    found = []
    for op in range(1, 200):  # operation (a step), round within it
        for r, tag, per_rank in ((1, "decide", False), (2, "begin", True), (3, "written", True), (4, "commit", False)):
            base = f"trainguard/0/main/r{op}.{r}/{tag}"
            cands = [f"{base}/all"] + ([f"{base}/{k}" for k in range(WORLD)] if per_rank else [])
            found += [k for k in cands if server.check([k])]
    found += [f"trainguard/0/fence/commit/{s}" for s in range(1, 200) if server.check([f"trainguard/0/fence/commit/{s}"])]
    return found


def test_discard_deletes_in_the_background_and_calls_still_answer():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store = BoundedStore(server, 20.0)
    for k in range(500):
        server.set(f"x/{k}", "v")
    store.discard(f"x/{k}" for k in range(500))
    store.set("y", "1")  # answered while keys are still being discarded
    assert store.get("y") == b"1"
    store.drain()
    assert not any(server.check([f"x/{k}"]) for k in range(500))
    assert server.check(["y"])
    store.discard(["y", "missing"])  # a key that is not there is no error
    worker = store._worker
    store.close()  # the worker deletes what was discarded, then ends
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert not server.check(["y"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_rounds_keys_are_deleted_only_once_every_rank_passed_it(world):
    # Two all_gathers in a row: the second one's keys must survive the cleanup run by the first
    # ranks to leave (they are two rounds back only after a third round).
    def two_gathers(ctx: StoreDistContext) -> None:
        for i in range(3):
            assert ctx.all_gather("begin", i) == [i] * ctx.world_size

    server, ctxs = _run_ranks(two_gathers, world)
    try:
        ctxs[0].store.drain()
        # Outside any operation (dist.StoreDistContext.operation): all in operation 0.
        assert not server.check(["trainguard/0/main/r0.1/begin/all"])  # round 1: cleaned by round 3
        assert server.check(["trainguard/0/main/r0.3/begin/all"])  # the last round stays
    finally:
        for c in ctxs:
            c.close()


def test_cleanup_cost_benchmark_runs(capsys):
    from bench import cleanup_cost

    assert cleanup_cost.main(["--world", "16", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("world 16:") and out.rstrip().endswith("keys left 0"), out
