"""Session 56: nodes whose wall clocks disagree (``elastic/heartclock.py``). torch's c10d rendezvous compares each
node's heartbeat time, written with that node's clock, with the reader's clock: 3 s apart under ``trainguard run``
and a node was taken for dead. Real agents on 127.0.0.1; one agent's rendezvous clock is shifted by
``tests/skewclock/sitecustomize.py`` (nothing else in that process sees the shift)."""

from __future__ import annotations

import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from test_elastic_edges import _wait_for
from test_hunt54_agent54 import SRC, _accepts, _agent, _cleanup, _free_port
from trainguard.elastic.heartclock import FAR, judge
from trainguard.events import read_events

SKEW_PATH = str(Path(__file__).parent / "skewclock")
EXPIRY = timedelta(seconds=3)
NOW = datetime(2026, 12, 7, 12, 0, 0, tzinfo=timezone.utc)

# Each rank all-reduces a 1 (the sum is the world size), waits for <dir>/go, and writes what it saw.
WORKER = """\
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    d = sys.argv[1]
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.barrier()
    with open(os.path.join(d, "rank%s" % os.environ["RANK"]), "w") as f:
        f.write("%d %d" % (dist.get_world_size(), int(t.item())))
    dist.destroy_process_group()
"""


def test_a_node_whose_heartbeat_time_lags_but_keeps_changing_is_alive() -> None:
    seen: dict = {}
    late = NOW - timedelta(seconds=10)  # its clock 10 s behind: torch would drop it
    beats = {"b": late}
    assert judge(seen, beats, NOW, EXPIRY, mono=100.0) == {"b": late} and beats["b"] == NOW
    beats = {"b": late + timedelta(seconds=1)}  # its next heartbeat, 1 s later by our clock
    judge(seen, beats, NOW + timedelta(seconds=1), EXPIRY, mono=101.0)
    assert beats["b"] == NOW + timedelta(seconds=1)  # looks fresh to torch's judgement


def test_a_node_whose_heartbeat_stops_changing_is_dead_even_when_its_time_lies_ahead() -> None:
    seen: dict = {}
    ahead = NOW + timedelta(seconds=10)  # its clock 10 s ahead: torch would keep it for 13 s after its death
    beats = {"a": ahead}
    judge(seen, beats, NOW, EXPIRY, mono=100.0)
    beats = {"a": ahead}
    put = judge(seen, beats, NOW + timedelta(seconds=3.5), EXPIRY, mono=103.5)
    assert put == {"a": ahead} and beats["a"] < NOW + timedelta(seconds=3.5) - EXPIRY


def test_unskewed_heartbeats_are_left_to_torch_and_far_ones_are_judged_by_their_time() -> None:
    seen: dict = {}
    beats = {"x": NOW - timedelta(seconds=1), "old": NOW - timedelta(seconds=FAR + 1)}
    assert judge(seen, beats, NOW, EXPIRY, mono=5.0) == {}
    assert beats == {"x": NOW - timedelta(seconds=1), "old": NOW - timedelta(seconds=FAR + 1)}
    judge(seen, {}, NOW, EXPIRY, mono=6.0)
    assert seen == {}  # nodes gone from the state are forgotten


@pytest.mark.timeout(200)
@pytest.mark.parametrize("skew", [pytest.param("-10", id="behind"),
                                  pytest.param("10", id="ahead", marks=pytest.mark.slow)])
def test_two_nodes_whose_clocks_are_10_s_apart_train_together(tmp_path: Path, skew: str) -> None:
    """Before: node B's rendezvous clock 10 s behind: the store's host (A) dropped B as dead and ran the job alone
    at world size 1 under ``--nnodes 2``, exit 0, and B exited 1; 10 s ahead: the job hung. Now both ranks train
    in one world of 2 and both agents exit 0."""
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(WORKER))
    port, run_dir = _free_port(), tmp_path / "run"

    def start(name: str, **env: str):
        return _agent(tmp_path, name, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "skew", "--run-dir", str(run_dir),
                      "--max-restarts", "0", str(train), str(tmp_path), **env)

    a, log_a, _ = start("A")
    b = None
    try:
        _wait_for(lambda: _accepts(port), 60, "agent A's rendezvous store", a, log_a)
        b, log_b, _ = start("B", PYTHONPATH=f"{SKEW_PATH}:{SRC}", TG_TEST_CLOCK_SKEW=skew)
        _wait_for(lambda: any(e["event"] == "rendezvous" for e in read_events(run_dir / "events.jsonl"))
                  or a.poll() is not None, 90, "a rendezvous", b, log_b)
        rounds = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "rendezvous"]
        assert all(e["world_size"] == 2 for e in rounds), rounds
        (tmp_path / "go").touch()
        codes = a.wait(timeout=90), b.wait(timeout=90)
        assert codes == (0, 0), (codes, log_a.read_text(errors="replace")[-2000:],
                                 log_b.read_text(errors="replace")[-2000:])
        assert sorted((tmp_path / f"rank{r}").read_text() for r in (0, 1)) == ["2 2", "2 2"]
    finally:
        (tmp_path / "go").touch()
        _cleanup(*[p for p in (a, b) if p is not None])
