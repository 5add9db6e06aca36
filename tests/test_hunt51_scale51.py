"""c10d store traffic as the world grows (hunt51, scale51; measured with ``python -m bench.store_traffic``).

- An ``all_gather``'s published list (a save's "begin", a load's "load"/"loaded") was a JSON list of every
  rank's value, read by every rank: ~230 bytes per rank more for each rank in the job, i.e. the store server
  sent bytes quadratic in the world size per round. Now rank 0 packs it (``distpack``): a rank's bytes per
  save and load no longer grow with the world size.
- A rank waiting in a round restarted its back-off (2 ms doubling to 0.1 s) every second: 16-17 polls
  per second of a wait, per waiting rank; now 10.
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

from conftest import free_ports

ROOT = Path(__file__).resolve().parent.parent

_RANK = textwrap.dedent("""
    import datetime, json, os, sys, threading
    import torch, torch.distributed as dist, torch.distributed.distributed_c10d as c10d
    rank, world, port, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TRAINGUARD_TIMEOUT="60")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    raw, got, lock = c10d._get_default_store(), [0, 0], threading.Lock()

    class Counting:  # bytes each store call of this rank received, and how many calls (heartbeats aside)
        def __getattr__(self, name):
            fn = getattr(raw, name)
            def call(*a, **k):
                out = fn(*a, **k)
                if threading.current_thread().name != "trainguard-heartbeat":
                    n = len(out) if isinstance(out, bytes) else sum(map(len, out)) if name == "multi_get" else 0
                    with lock:
                        got[0] += n
                        got[1] += 1
                return out
            return call

    proxy = Counting()
    c10d._get_default_store = lambda: proxy
    import trainguard as tg
    state = {"w": torch.zeros(4), "step": 3}
    tg.save(f"{root}/ck/step-3", state)
    tg.load(f"{root}/ck/step-3", state)
    dist.barrier()
    with open(out, "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()
""")


def _received(world: int, tmp_path: Path) -> list[int]:
    """Run one tg.save and one tg.load on ``world`` gloo ranks; rank 1's [bytes received, calls]."""
    root = tmp_path / f"w{world}"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    port = str(free_ports(1)[0])
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), port, str(root), str(root / f"out{r}.json")],
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
    return json.loads((root / "out1.json").read_text())


def test_bytes_a_rank_reads_per_save_and_load_do_not_grow_with_the_world(tmp_path: Path) -> None:
    two, four = _received(2, tmp_path), _received(4, tmp_path)
    # Before: rank 1 read each all_gather's list of every rank's value: ~2 x 230 bytes more per round at 4 ranks
    # (3 rounds: ~1,400 bytes). Now the packed lists are the same size; keys differ by a few characters at most.
    assert four[0] - two[0] < 100, (two, four)


def test_pack_round_trips_every_value_exactly() -> None:
    from trainguard import distpack

    values = [
        {"sig": "abc", "own": 0, "id": "f00", "step": 3, "vals": {"a": [1, 2]}},
        {"sig": "abc", "own": 0, "step": 3, "vals": {"a": [1, 2]}, "x": True},
        {"sig": "abc", "own": 1, "step": 3, "vals": {"a": [1, 2]}, "x": 1},
        {"sig": "abc", "own": 1.0, "step": 3, "vals": None, "x": None},
    ]
    packed = json.loads(json.dumps(distpack.pack(values)))  # as read from the store
    out = distpack.unpack(packed)
    assert json.dumps(out) == json.dumps(values)
    assert out[1]["x"] is True and out[2]["x"] == 1 and type(out[2]["x"]) is int and type(out[3]["own"]) is float
    out[0]["vals"]["a"].append(3)  # each rank's value is its own object
    assert out[1]["vals"] == {"a": [1, 2]}
    for plain in ([1, "a", None, [2], 1, 1], [], [{"a": 1}, 5]):
        assert distpack.unpack(json.loads(json.dumps(distpack.pack(plain)))) == plain
    assert distpack.published({"value": [1, 2]}) == [1, 2]


def test_packed_list_of_equal_values_does_not_grow_with_the_world() -> None:
    from trainguard import distpack

    hello = {"sig": "x" * 64, "step": 100, "name": "step-100", "own": 0, "error": None, "vals": {"k": "d" * 32}}
    small = len(json.dumps(distpack.pack([dict(hello, id="a" * 16)] + [dict(hello) for _ in range(3)])))
    large = len(json.dumps(distpack.pack([dict(hello, id="a" * 16)] + [dict(hello) for _ in range(1023)])))
    assert large - small < 64, (small, large)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class _Store:
    """Rank 0 publishes at 10 s of the fake clock; rank 0's heartbeat beats; no rank's "at" key exists."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.polls, self.beat = clock, 0, 0

    def check(self, keys: list[str]) -> bool:
        if keys == ["r/all"]:
            self.polls += 1
            return self.clock.now >= 10.0
        return False

    def add(self, key: str, n: int) -> int:
        self.beat += 1
        return self.beat


class _Ctx:
    rank, world_size, dead_after, prefix, chan, _op, _round = 1, 2, 10.0, "p", "c", 1, 1

    def __init__(self, store: _Store) -> None:
        self.store = store


def test_a_waiting_rank_polls_at_most_about_ten_times_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(distwait, "time", clock)
    store = _Store(clock)
    distwait.wait_for(_Ctx(store), ["r/all"], [0], "commit", 600.0)
    assert clock.now >= 10.0
    # 10 s of waiting: before, 16-17 polls a second (the back-off started again from 2 ms each second), ~170.
    assert store.polls <= 10 * 12, store.polls
