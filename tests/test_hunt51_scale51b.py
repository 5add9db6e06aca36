"""c10d store traffic of a save, continued (hunt51, scale51b; measured with ``python -m bench.store_traffic``).

- Rank 0's polls named every rank's key (~46 kB a poll at 1,024 ranks) and its once-a-second look made a
  ``check`` and an ``add`` per missing rank: now the polls name the keys still missing at the last look, which
  finds them by halving, and reads the heartbeats in one ``multi_get``.
- Each rank set its "where am I" key and its answer in two ``set``s per gather round: now one ``multi_set``.
- A waiting rank polled ~10 times a second however long it waited: past 2 s its pause grows to a twentieth of
  the time waited (at most 1 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard import distwait
from trainguard.storecall import BoundedStore

from conftest import free_ports

ROOT = Path(__file__).resolve().parent.parent


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class _Store:
    """Round keys ``k/<rank>``: each set from ``arrive[rank]`` s of the fake clock; every rank beats; no "at" keys."""

    def __init__(self, clock: _Clock, arrive: dict[int, float]) -> None:
        self.clock, self.arrive, self.calls, self.named, self.beats = clock, arrive, 0, [], 0

    def _has(self, key: str) -> bool:
        if key.startswith("k/"):
            return self.clock.now >= self.arrive[int(key[2:])]
        return key.startswith("p/hb/")

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        if all(k.startswith("k/") for k in keys):
            self.named.append((self.clock.now, len(keys)))
        return all(self._has(k) for k in keys)

    def add(self, key: str, n: int) -> int:
        self.calls += 1
        self.beats += 1
        return self.beats

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls += 1
        self.beats += 1
        return [str(self.beats).encode() for _ in keys]


class _Ctx:
    dead_after, prefix, chan, _op, _round, _parent = 10.0, "p", "c", 1, 1, None

    def __init__(self, store: _Store, rank: int, world: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world


def test_rank0_polls_only_the_missing_key_and_its_look_is_not_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(distwait, "time", clock)
    world, late = 64, 37
    store = _Store(clock, {r: (5.0 if r == late else 0.0) for r in range(world)})
    distwait.wait_for(_Ctx(store, 0, world), [f"k/{r}" for r in range(world)], list(range(world)), "begin", 600.0)
    assert clock.now >= 5.0
    after = [n for t, n in store.named if t > 1.0]
    # Before: every poll named all 64 keys (~50 polls in 5 s: ~3,200 key names) and each look made a check and
    # an add per missing rank (64 + 64 at the first look, ~260 calls in all). Now polls after the first look
    # name the one missing key; the look finds it in ~2 x log2(64) checks.
    assert max(after) == 1 and len(after) > 10, store.named
    assert sum(n for _t, n in store.named) < 64 * 12, store.named
    assert store.calls < 120, store.calls


def test_a_long_wait_polls_less_often_and_ends_at_most_2_percent_late(monkeypatch: pytest.MonkeyPatch) -> None:
    for at, calls_at_most in ((60.0, 420), (0.05, 8)):
        clock = _Clock()
        monkeypatch.setattr(distwait, "time", clock)
        store = _Store(clock, {0: at})
        distwait.wait_for(_Ctx(store, 1, 2), ["k/0"], [0], "commit", 600.0)
        # Before, a 60 s wait made ~600 polls and ~240 calls in its looks (838): now 398 (the pause a fiftieth
        # of the time waited past 5 s). A short wait's back-off is unchanged (2 ms doubling to 0.1 s).
        assert store.calls <= calls_at_most, (at, store.calls)
        assert clock.now <= at * 1.02 + 0.1, (at, clock.now)


def test_multi_set_falls_back_to_set_in_order() -> None:
    class Plain:  # a store object without multi_set
        def __init__(self) -> None:
            self.order: list[str] = []

        def set(self, k: str, v: str) -> None:
            self.order.append(k)

    raw = Plain()
    store = BoundedStore(raw, 5.0)
    store.multi_set(["at", "answer"], ["1", "2"])
    store.close(wait=2.0)
    assert raw.order == ["at", "answer"]


_RANK = textwrap.dedent("""
    import datetime, json, os, sys, threading
    import torch, torch.distributed as dist, torch.distributed.distributed_c10d as c10d
    rank, world, port, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TRAINGUARD_TIMEOUT="60")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    raw, writes, lock = c10d._get_default_store(), [], threading.Lock()

    class Counting:  # each write of this rank (heartbeats aside): the method and the keys it names
        def __getattr__(self, name):
            fn = getattr(raw, name)
            def call(*a, **k):
                if name in ("set", "multi_set", "compare_set") and threading.current_thread().name != "trainguard-heartbeat":
                    with lock:
                        writes.append([name, a[0] if isinstance(a[0], list) else [a[0]]])
                return fn(*a, **k)
            return call

    proxy = Counting()
    c10d._get_default_store = lambda: proxy
    import trainguard as tg
    state = {"w": torch.zeros(4), "step": 3}
    tg.save(f"{root}/ck/step-3", state)
    tg.load(f"{root}/ck/step-3", state)
    dist.barrier()
    with open(out, "w") as f:
        json.dump(writes, f)
    dist.destroy_process_group()
""")


def test_a_rank_writes_once_per_round_of_a_save_and_a_load(tmp_path: Path) -> None:
    world = 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    port = str(free_ports(1)[0])
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), port, str(tmp_path), str(tmp_path / f"out{r}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-1500:] for log in logs)
    writes = json.loads((tmp_path / "out1.json").read_text())
    rounds = [w for w in writes if any("/at/" in k for k in w[1])]
    answers = [w for w in writes if any("/r" in k.rsplit("/at/", 1)[-1] and "/at/" not in k for k in w[1])]
    # Before: a gather round ("begin", "written", "load", "loaded") cost rank 1 a set of its "at" key and a set of
    # its answer; now one multi_set of both, "at" first. Every write of rank 1 enters a round.
    assert answers and all(w[0] == "multi_set" and "/at/" in w[1][0] for w in answers), writes
    assert len(writes) == len(rounds), writes


def test_halving_is_exact_at_the_look_and_bounded_when_most_keys_are_missing() -> None:
    class Keys:
        def __init__(self, present: set[int]) -> None:
            self.present, self.calls = present, 0

        def check(self, keys: list[str]) -> bool:
            self.calls += 1
            return all(int(k) in self.present for k in keys)

    pending = [(r, str(r)) for r in range(64)]
    for present in (set(range(64)) - {37}, {5, 9}, set()):
        store = Keys(present)
        assert distwait._absent(store, pending) == [(r, k) for r, k in pending if r not in present]
        assert store.calls <= 15 + 64, (present, store.calls)  # plain halving: up to 127 when all are missing
        store = Keys(present)
        some = distwait._absent(store, pending, exact=False)  # a poll's: a superset, in at most 2 x 7 + 1 calls
        assert {r for r, _k in some} >= set(range(64)) - present and store.calls <= 15, (present, store.calls)
