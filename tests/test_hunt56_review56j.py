"""Session 56's hostile review (review56j) of review56d (the CLI, http(s) URLs) and review56f
(``tg.DalyInterval``'s first save, its seed from the event log, the slowest steps left out).
Each test fails on the code before its fix."""

from __future__ import annotations

import http.server
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from test_hunt56_review56d import serve
from test_hunt56_review56f import drive_async
from trainguard.cli import main


def _run(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, prog_name="trainguard")


class _Answers(http.server.SimpleHTTPRequestHandler):
    """A static server that answers ``missing`` (403: S3/GCS over https without the right to list, nginx's
    unindexed directories) where it has no file, and 500 for any path holding ``broken``."""

    missing = 403

    def send_head(self):  # type: ignore[no-untyped-def]
        if "broken" in self.path:
            self.send_error(500)
            return None
        return super().send_head()

    def send_error(self, code, message=None, explain=None):  # type: ignore[no-untyped-def]
        super().send_error(self.missing if code == 404 else code, message, explain)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path):
    """``tmp_path / "www"`` served on 127.0.0.1 by :class:`_Answers`; its URL."""
    www = tmp_path / "www"
    www.mkdir()
    yield from serve(www, _Answers)


def test_a_server_that_answers_403_for_a_missing_file_is_still_read(tmp_path: Path, served: str) -> None:
    """review56d made fsspec's HTTP ``exists`` strict, so that an unreachable host is not "no such
    directory"; a strict ``exists`` also raised every 4xx but 404. ``trainguard verify https://HOST/run``
    of a server answering 403 for a missing object (S3 over https without ListBucket) then failed at its
    first probe, ``run/manifest.json``: "the object store failed: ClientResponseError: 403", exit 2, where it
    verified before. A 403 is absence again; a 500 and an unreachable host are still the store's error."""
    pytest.importorskip("aiohttp")
    for s in (10, 20):
        tg.save(tmp_path / "www" / "run" / f"step-{s:09d}", {"model": tg.StateDict(w=torch.arange(4.0) + s)})
    r = _run("verify", f"{served}/run")
    assert r.exit_code == 0 and r.output.count("OK") == 2, r.output
    r = _run("ls", f"{served}/nope")
    assert r.exit_code == 2 and "no such directory" in r.output, r.output
    r = _run("ls", f"{served}/broken")
    assert r.exit_code == 2 and "no such directory" not in r.output and "500" in r.output, r.output


def _drive_async(policy, steps: range, *, stall: list[float], write_s: float) -> list[int]:
    """review56f's fake-clock async manager at 1 s a step (``drive_async``). The steps saved."""
    return drive_async(policy, steps, step_s=1.0, stall=stall, write_s=write_s)


def test_a_restart_after_one_save_does_not_seed_from_that_saves_one_off_cost(tmp_path: Path) -> None:
    """review56f drops a process's first save (one-off costs: 30 s here against 1 s after) from the medians
    at its second, and seeds a resumed process from rank 0's last ``interval`` event. When the earlier process
    ended after its first save (an early failure), that event's costs were the first save's alone: the new
    process took them as the run's, kept them beside its second save, and the median of the two (15.5 s) held
    its third save 1,258 steps away for an optimum of 322 (its own first save dropped, as it should be). Now
    such an event says ``first_save`` and is not a seed: the new process measures as a new one does."""
    from trainguard.daly import DalyInterval
    from trainguard.events import EventLog, read_events

    log = tmp_path / "events.jsonl"
    m = 86400 / (256 * 0.0065)
    first = DalyInterval(node_mtbf_s=m, nodes=1, initial_steps=100)
    first.events = EventLog(log)
    _drive_async(first, range(200), stall=[30.0], write_s=20.0)  # one save measured, then the process dies
    assert [e.get("stall_s") for e in read_events(log) if e["event"] == "interval"][-1] == 30.0
    second = DalyInterval(node_mtbf_s=m, nodes=1, initial_steps=100)
    second.seed_from_log(log)
    saved = _drive_async(second, range(20000), stall=[30.0, 1.0], write_s=20.0)
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert gaps[1] == 322 and set(gaps[1:]) == {322}, gaps[:5]


def test_a_damaged_cost_in_the_log_is_no_seed_and_no_crash(tmp_path: Path) -> None:
    """A number a float cannot hold (a garbled line: ``"slowdown_s": 1000...0``) passed the seed's check
    (``0 <= v < inf`` holds for a Python int) and ``float()`` raised OverflowError out of the manager's
    constructor. Now such an event is skipped; a well-formed earlier one is taken."""
    from trainguard.daly import DalyInterval

    log = tmp_path / "events.jsonl"
    good = '{"t": 1.0, "event": "interval", "rank": 0, "stall_s": 2.0, "duration_s": 3.0, "slowdown_s": 0.5}\n'
    bad = '{"t": 2.0, "event": "interval", "rank": 0, "stall_s": 4.0, "duration_s": 5.0, "slowdown_s": 1%s}\n' % ("0" * 400)
    log.write_text(good + bad)
    p = DalyInterval(node_mtbf_s=1e6, nodes=1)
    p.seed_from_log(log)
    assert p.measurements() == {"stall_s": 2.0, "slowdown_s": 0.5, "duration_s": 3.0, "step_time_s": None}
    with tg.CheckpointManager(tmp_path, save=DalyInterval(node_mtbf_s=1e6, nodes=1)):  # the constructor seeds
        pass


def test_verify_of_one_step_directory_of_a_newer_format_is_its_row_exit_1(tmp_path: Path) -> None:
    """review56d lists a later trainguard's step as ``newer format`` (verify: exit 1) in a run directory; the
    same step given alone (``trainguard verify --json RUN/step-N``, what a script checking the step it is
    about to load runs) ended in "error: ...: format_version 99 is not supported", exit 2 (the code for
    "PATH holds no checkpoint or is unreadable") and ``--json`` printed no JSON. Now its row, exit 1."""
    import json

    from tests.test_hunt56_review56d import _newer_format, _run_dir

    run = tmp_path / "run"
    _run_dir(run, (10, 20))
    _newer_format(run / "step-000000020")
    r = _run("verify", "--json", run / "step-000000020")
    assert r.exit_code == 1, r.output
    [row] = json.loads(r.output)
    assert (row["step"], row["status"], row["ok"]) == (20, "newer format", False)
    assert "upgrade trainguard" in row["errors"][0]
    r = _run("verify", run / "step-000000020")
    assert r.exit_code == 1 and "NEWER FORMAT" in r.output and "CORRUPT" not in r.output, r.output


@pytest.mark.parametrize("stall, duration", [(float("nan"), 1.0), (1.0, float("nan")), (1.0, float("inf"))])
def test_a_non_finite_save_cost_reported_by_a_callers_loop_is_refused(stall: float, duration: float) -> None:
    """``DalyInterval`` driven by a loop of the user's own (``on_step``/``should_save``/``on_saved``): a NaN
    stall passed ``max(0.0, nan)`` as 0 s, and since review56f (no floor for a save whose duration is not
    above its stall) Daly's interval for 0 s, one step: a save at every step, silently (before, a ValueError
    from ``ceil(nan)``). An infinite duration raised OverflowError from the floor. Now a ValueError naming
    the value, and the interval is left as it was."""
    from trainguard.daly import DalyInterval

    p = DalyInterval(node_mtbf_s=1e5, nodes=1, initial_steps=5)
    for s in range(6):
        p.on_step(s, float(s))
        if p.should_save(s, float(s)):
            with pytest.raises(ValueError, match="must be finite seconds"):
                p.on_saved(s, stall, duration)
    assert p.interval_steps == 5


@pytest.mark.parametrize("after", ["steps", "ranks"])
def test_a_resumed_process_finds_rank_0s_interval_event_before_the_logs_last_mib(tmp_path: Path, after: str) -> None:
    """review56f's seed read the log's last 1 MiB only. Under ``trainguard run`` rank 0 logs a ``step`` event
    (~110 bytes) at every step: a restart 12,000 steps after the last save (an interval of 20,000 steps of
    0.1 s is 33 min) found no seed. Every rank logs an ``interval`` event per save (300-500 bytes): at 4,096
    ranks, rank 0's written first, one save's events passed 1 MiB. Now the log is read back further
    (up to ``RESUME_SCAN``) until rank 0's event."""
    import json

    from trainguard.daly import DalyInterval

    log = tmp_path / "events.jsonl"
    reason = "Daly: stall 2s, job MTBF 14.4h -> save every 33.3m of compute = 20000 steps of 0.1s"

    def interval(rank: int, stall: float) -> str:
        return json.dumps({"t": 1.0, "event": "interval", "rank": rank, "pid": 7, "step": 5000, "steps": 20000,
                           "next_step": 25000, "rule": "daly", "reason": reason, "mtbf_s": 51923.1, "stall_s": stall,
                           "slowdown_s": 0.5, "duration_s": 9.0, "step_time_s": 0.1}) + "\n"

    with open(log, "w") as f:
        f.write(interval(0, 2.0))
        if after == "steps":
            f.writelines(json.dumps({"t": 2.0 + i, "event": "step", "rank": 0, "pid": 7, "step": 5001 + i,
                                     "world_size": 8, "mono": 100.0 + i}) + "\n" for i in range(12000))
        else:
            f.writelines(interval(r, 3.0) for r in range(1, 4096))
    assert log.stat().st_size > 1 << 20
    p = DalyInterval(node_mtbf_s=51923.1, nodes=1)
    p.seed_from_log(log)
    assert p.measurements() == {"stall_s": 2.0, "slowdown_s": 0.5, "duration_s": 9.0, "step_time_s": None}


def test_a_new_run_in_a_directory_with_another_runs_log_is_not_seeded_from_it(tmp_path: Path) -> None:
    """The manager seeded its ``DalyInterval`` from any ``events.jsonl`` in the run directory: one left by
    another run whose checkpoints were deleted (``rm -rf run/step-*``, the directory's name reused for a new
    experiment, another model) set the new run's first intervals from that run's save costs (100 s here),
    and its own first save was dropped as one-off. Now only a run directory holding a step directory (a
    run to resume) is one whose log is this run's."""
    from trainguard.daly import DalyInterval

    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(
        '{"t": 1.0, "event": "interval", "rank": 0, "stall_s": 100.0, "duration_s": 100.0, "slowdown_s": 0.0}\n')
    fresh = DalyInterval(node_mtbf_s=1e6, nodes=1)
    with tg.CheckpointManager(run, save=fresh):
        pass
    assert fresh.measurements()["stall_s"] is None
    tg.save(run / "step-000000010", {"model": tg.StateDict(w=torch.ones(2))})  # a run to resume
    resumed = DalyInterval(node_mtbf_s=1e6, nodes=1)
    with tg.CheckpointManager(run, save=resumed):
        pass
    assert resumed.measurements()["stall_s"] == 100.0
