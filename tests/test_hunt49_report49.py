"""`trainguard report` on the event log of a long run (helper report49, session 49).

A week at a step a second is 600,000 `step` lines (64 ranks: 390,000 `save` lines more); the
report held every parsed event (0.8 GB for a week of one rank, 5 GB for four weeks of 64 ranks).
It now keeps counts, ranges and 8 bytes a step (tally.py) and reads the lines of those two kinds
without json (eventscan.py), with the same numbers. A line written after a torn one (a short
write) was lost with it, by the report and by the count of lost steps of the next job's first step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from trainguard import events as events_mod
from trainguard import report as rep
from trainguard.cli import main
from trainguard.events import EventLog, read_events

T0 = 1_760_000_000.0
SAVE = dict(stall_s=0.1, duration_s=9.5, stall_call_s=0.07, stall_hook_s=0.0, stall_wait_s=0.03, stall_prev_s=0.0,
            bytes=70_000_000_000, async_save=True)


def _line(t: float, event: str, who: int, pid: int, **fields: object) -> str:
    """A line as EventLog.emit writes it (test_lines_are_those_of_eventlog; a field ``rank`` replaces the
    writer's, in its place: the agent's ``failure``)."""
    return json.dumps({"t": t, "event": event, "rank": who, "pid": pid} | fields) + "\n"


def _long_log(path: str, steps: int, ranks: int = 8, save_every: int = 100) -> None:
    """rank 0's step a second and, every ``save_every`` steps, a save of every rank: a long run's lines
    (``_line``'s, formatted faster: json.dumps writes a float as its repr)."""
    t = T0
    step = '{{"t": {!r}, "event": "step", "rank": 0, "pid": 100, "step": {}, "world_size": ' + str(ranks) + "}}\n"
    save = _line(0.25, "save", 99, 98, step=97, **SAVE, committed_t=0.125)
    save = save.replace("{", "{{").replace("}", "}}").replace("0.25", "{!r}").replace("99", "{}").replace(
        "98", "{}").replace("97", "{}").replace("0.125", "{!r}")
    assert step.format(T0, 5) == _line(T0, "step", 0, 100, step=5, world_size=ranks)
    assert save.format(T0, 3, 4, 5, 6.5) == _line(T0, "save", 3, 4, step=5, **SAVE, committed_t=6.5)
    with open(path, "w") as f:
        f.write(_line(t, "agent_start", -1, 7, job_id="j"))
        buf = []
        for s in range(1, steps + 1):
            t += 1.0 + (s % 7) * 0.01
            buf.append(step.format(t, s))
            if s % save_every == 0:
                buf += [save.format(t + 0.001 * r, r, 100 + r, s, round(t - 0.5, 6)) for r in range(ranks)]
            if len(buf) > 20_000:
                f.writelines(buf)
                buf.clear()
        f.writelines(buf)


def test_lines_are_those_of_eventlog(tmp_path, monkeypatch):
    """The synthetic logs below are made of EventLog's own lines (the same json, the same order)."""
    monkeypatch.setattr(events_mod.time, "time", lambda: 1760000123.25)
    log = EventLog(tmp_path / "events.jsonl", rank=0)
    log.emit("step", step=5, world_size=8)
    log.emit("save", step=5, **SAVE, committed_t=1760000122.75)
    pid = os.getpid()
    assert (tmp_path / "events.jsonl").read_text() == (
        _line(1760000123.25, "step", 0, pid, step=5, world_size=8)
        + _line(1760000123.25, "save", 0, pid, step=5, **SAVE, committed_t=1760000122.75))


_CAPPED = textwrap.dedent("""
    import resource, sys
    from trainguard.cli import main
    main(["report", sys.argv[1]], standalone_mode=False)  # every module the report uses, loaded
    vm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[3]), resource.RLIM_INFINITY))
    main(["report", "--json", sys.argv[2]], standalone_mode=False)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_report_of_a_long_log_fits_in_a_memory_cap(tmp_path):
    """64,801 lines (6.5 MB, 17 hours of a run): the report held every event, ~1 kB each (~60 MB,
    a MemoryError under a cap of 32 MB more than the process had); a 216,001-line log passed under
    a cap of 4 MB (8 bytes a step)."""
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    _long_log(str(small / "events.jsonl"), 200)
    _long_log(str(big / "events.jsonl"), 60_000)
    res = subprocess.run([sys.executable, "-c", _CAPPED, str(small), str(big), str(32 << 20)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(res.stdout[res.stdout.index("{"):])
    assert s["events"] == 64_801 and s["final_step"] == 60_000 and s["steps_run"] == 60_000
    assert s["saves"] == 600 and s["save_bytes"] == 70_000_000_000
    assert s["step_s"] == pytest.approx(1.03, abs=1e-6)  # the median of 1.00 .. 1.06 a step


def _fast_and_slow(tmp_path):
    """A log of lines read without json (exactly EventLog's step and save), lines json reads (another
    form, an int time, an exponent, a field more), other ranks' saves, restarts and a torn line."""
    lines, t = [_line(T0, "agent_start", -1, 7, job_id="j"), _line(T0 + 0.5, "rendezvous", -1, 7, world_size=2)], T0
    for s in range(1, 121):
        t += 0.25 + (s % 5) * 0.01
        pid = 100 if s <= 60 else 200
        if s == 61:
            lines += [_line(t, "failure", -1, 7, rank=1, cause="killed by SIGKILL"),
                      _line(t + 1, "restore", 0, 200, step=50, seconds=0.5),
                      _line(t + 1.2, "first_step", 0, 200, step=51, lost_steps=10)]
            t += 1.2
        step = s if s <= 60 else s - 10
        if s % 3 == 0:
            lines.append(json.dumps({"t": t, "event": "step", "rank": 0, "pid": pid, "step": step}) + "\n")  # no world_size
        elif s == 7:
            lines.append(_line(int(t), "step", 0, pid, step=step, world_size=2))  # an int t
        else:
            lines.append(_line(t, "step", 0, pid, step=step, world_size=2))
        if s % 10 == 0:
            for r in (0, 1):
                extra = {"stall_s": 1e-06} if s == 20 else {"note": "x"} if s == 30 else {}
                lines.append(_line(t + 0.01, "save", r, pid + r, step=step, **{**SAVE, **extra}, committed_t=t))
    lines[70], lines[71] = lines[71], lines[70]  # two steps out of time order (lines of two processes)
    lines.insert(40, lines[40][:30])  # torn: the next line goes on after it
    return lines


@pytest.mark.parametrize("window, reads", [(3, 2), (4096, 1)])
def test_the_report_of_a_log_is_summarize_of_its_events(tmp_path, monkeypatch, window, reads):
    """The numbers of `trainguard report` (lines read without json where they can, a window that
    puts them in time order) are those of `summarize` of every event sorted by time; with a window
    of 3 the steps 60 s back in time (a clock set back) make it read the log again, every step kept."""
    from trainguard import eventscan
    from trainguard import tally as tally_mod

    lines = _fast_and_slow(tmp_path)
    lines += [_line(T0 - 60 + i, "step", 0, 300, step=500 + i, world_size=2) for i in range(12)]  # a clock set back
    (tmp_path / "events.jsonl").write_text("".join(lines))
    monkeypatch.setattr(tally_mod, "WINDOW", window)
    feeds = []
    feed = eventscan.feed
    monkeypatch.setattr(eventscan, "feed", lambda *a: feeds.append(a) or feed(*a))
    want = rep.summarize(list(read_events(tmp_path)))
    assert rep.summary(rep.tally_log(tmp_path)) == want
    res = CliRunner().invoke(main, ["report", "--json", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == json.loads(json.dumps(want))
    assert len(feeds) == 2 * reads  # tally_log's and the command's
    assert want["steps_run"] == 120 + 12 and want["saves"] == 12 and want["failures"] == 1
    assert want["recoveries"][0]["restored_step"] == 50 and want["lost_steps"] == 10


_JOBS = textwrap.dedent("""
    import os, resource, signal, sys
    from trainguard.elastic import watchdog
    from trainguard.events import EventLog
    path = sys.argv[1]
    for job, steps in (("j", 50), ("j2", 3)):  # two jobs, one after the other, in one run directory
        os.environ["TRAINGUARD_JOB_ID"], watchdog._HEART = job, None  # as a new worker process of job
        EventLog(path, rank=-1).emit("agent_start", job_id=job)  # as `trainguard run`'s agent
        for s in range(1, steps + 1):
            watchdog.heartbeat(s)
        if job == "j":  # its next line is cut short by the kernel: 40 bytes of it (a full disk does that too)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 40, resource.RLIM_INFINITY))
            watchdog.heartbeat(steps + 1)
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE, SIGXFSZ")
def test_an_event_after_a_short_write_is_read(tmp_path):
    """Job j trains 50 steps, its 51st step's line is written short (RLIMIT_FSIZE: a real short
    write), then job j2 starts in the same run directory. Its `agent_start` went on after the torn
    line, and was dropped with it: its first step counted job j's 50 steps as its own lost ones, and
    the report said `lost steps 50 (50 at starts of the whole job again)`."""
    path = tmp_path / "events.jsonl"
    env = {**os.environ, "TRAINGUARD_RUN_DIR": str(tmp_path), "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("TRAINGUARD_WATCHDOG", None)
    subprocess.run([sys.executable, "-c", _JOBS, str(path)], env=env, check=True, timeout=120)
    raw = path.read_bytes()
    torn = [ln for ln in raw.splitlines() if ln.count(b'{"t": ') == 2]
    assert len(torn) == 1 and b'"job_id": "j2"' in torn[0]  # the torn line, and j2's agent_start right after it
    starts = [e["job_id"] for e in read_events(path) if e["event"] == "agent_start"]
    assert starts == ["j", "j2"]
    firsts = [e["lost_steps"] for e in read_events(path) if e["event"] == "first_step"]
    assert firsts == [0, 0]
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "lost steps 0" in res.output and "starts of the whole job" not in res.output


def test_a_line_with_an_int_no_float_holds_is_skipped_not_a_traceback(tmp_path):
    """A garbled digit run (a t of 400 digits): OverflowError in the check of the line, a traceback."""
    (tmp_path / "events.jsonl").write_text(
        _line(T0, "step", 0, 1, step=1, world_size=1)
        + '{"t": 1' + "0" * 400 + ', "event": "step", "rank": 0, "pid": 1, "step": 2}\n'
        + _line(T0 + 1, "step", 0, 1, step=3, world_size=1))
    res = CliRunner().invoke(main, ["report", "--json", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["events"] == 2


def test_numbers_a_line_gives_as_null_are_read_as_missing(tmp_path):
    """read_events lets a number be null (a line another tool wrote); a save's null stall and a
    restore's null seconds ended the report in a TypeError traceback (int + None, float - None)."""
    (tmp_path / "events.jsonl").write_text(
        _line(T0, "agent_start", -1, 7, job_id="j") + _line(T0 + 1, "step", 0, 1, step=1, world_size=1)
        + _line(T0 + 2, "save", 0, 1, step=1, stall_s=None, duration_s=None, committed_t=None)
        + _line(T0 + 3, "failure", -1, 7, rank=0, cause="killed by SIGKILL")
        + _line(T0 + 9, "restore", 0, 2, step=1, seconds=None) + _line(T0 + 10, "step", 0, 2, step=2, world_size=1))
    res = CliRunner().invoke(main, ["report", "--json", str(tmp_path), "--plot", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["saves"] == 1 and s["save_stall_s"] == 0.0 and s["save_duration_mean_s"] == 0.0
    assert s["recoveries"][0]["restore_s"] == 0.0 and s["recoveries"][0]["restart_s"] == pytest.approx(6.0)
