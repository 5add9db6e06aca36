"""report.summarize on a synthetic event log; the CLI and the timeline plot."""

from __future__ import annotations

import json

from click.testing import CliRunner

from trainguard.cli import main
from trainguard.report import format_summary, summarize


def _events():
    ev = [{"t": 0.0, "event": "agent_start", "rank": -1, "pid": 1},
          {"t": 0.5, "event": "rendezvous", "rank": -1, "pid": 1, "world_size": 2}]
    t = 1.0
    for s in range(1, 24):  # first attempt: steps 1..23, saves at 10 and 20
        ev.append({"t": t, "event": "step", "step": s, "rank": 0, "pid": 10, "world_size": 2})
        if s in (10, 20):
            ev.append({"t": t + 0.01, "event": "save", "step": s, "rank": 0, "pid": 10, "stall_s": 0.02,
                       "duration_s": 0.2, "bytes": 1000})
        t += 0.1
    ev.append({"t": t, "event": "fault", "step": 23, "rank": 1, "pid": 11, "kind": "kill"})
    ev.append({"t": t + 0.3, "event": "failure", "rank": 1, "pid": 1, "cause": "killed by SIGKILL"})
    ev.append({"t": t + 2.3, "event": "restore", "step": 20, "rank": 0, "pid": 20, "seconds": 0.2})
    ev.append({"t": t + 2.5, "event": "first_step", "step": 21, "rank": 0, "pid": 20, "lost_steps": 3})
    t += 2.5
    for s in range(21, 31):
        ev.append({"t": t, "event": "step", "step": s, "rank": 0, "pid": 20, "world_size": 2})
        t += 0.1
    ev.append({"t": t, "event": "agent_exit", "rank": -1, "pid": 1, "ok": True})
    return ev


def test_summary_numbers():
    s = summarize(_events())
    assert s["failures"] == 1 and s["lost_steps"] == 3 and s["final_step"] == 30
    r = s["recoveries"][0]
    assert r["restored_step"] == 20 and r["fault_step"] == 23
    assert abs(r["detect_s"] - 0.3) < 1e-6 and abs(r["restore_s"] - 0.2) < 1e-6
    assert abs(r["restart_s"] - 1.8) < 1e-6 and abs(r["first_step_s"] - 0.2) < 1e-6
    assert abs(r["recover_s"] - 2.5) < 1e-6  # = detect + restart + restore + first step
    assert abs(s["step_s"] - 0.1) < 1e-6 and s["saves"] == 2 and abs(s["save_stall_s"] - 0.04) < 1e-9
    assert 0 < s["goodput"] < 1
    assert "lost steps 3" in format_summary(s)


def test_cli_report_and_plot(tmp_path):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _events()) + '{"torn')
    png = tmp_path / "timeline.png"
    res = CliRunner().invoke(main, ["report", str(tmp_path), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "failures           1" in res.output and "restored step 20" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(main, ["report", str(tmp_path), "--json"])
    assert json.loads(res.output)["lost_steps"] == 3


def test_world_sizes_counted_once_per_rendezvous_round_with_several_agents():
    """Each agent logs every rendezvous round it takes part in (node_rank 0 and 1 here)."""
    ev = [{"t": 0.0, "event": "agent_start", "rank": -1, "pid": 1}]
    for t, world, nodes in ((1.2, 2, 2), (10.7, 1, 1), (19.2, 2, 2)):
        ev += [{"t": t, "event": "rendezvous", "rank": -1, "pid": 1 + n, "world_size": world, "nodes": nodes,
                "node_rank": n} for n in range(nodes)]
    ev.append({"t": 20.0, "event": "step", "step": 1, "rank": 0, "pid": 10, "world_size": 2})
    s = summarize(ev)
    assert [w for _t, w in s["world_sizes"]] == [2, 1, 2]
    assert "world sizes        2 at 1.2s, 1 at 10.7s, 2 at 19.2s" in format_summary(s)


def test_summary_of_a_log_without_steps_prints_dashes_not_none():
    ev = [{"t": 0.0, "event": "save", "step": 10, "rank": 0, "pid": 1, "stall_s": 0.01, "duration_s": 0.1, "bytes": 10},
          {"t": 1.0, "event": "save", "step": 20, "rank": 0, "pid": 1, "stall_s": 0.01, "duration_s": 0.1, "bytes": 10}]
    text = format_summary(summarize(ev))  # a manager's own log, not under `trainguard run`
    assert "final step -," in text and "None" not in text


def test_an_event_written_after_a_zero_filled_tail_is_read(tmp_path):
    """A power loss can leave the log's unwritten tail as NUL bytes (ext4 data=writeback, older
    XFS); the first event appended after the restart starts with them and was dropped, by
    `trainguard report` and by the first_step event's count of lost steps."""
    from trainguard.elastic.watchdog import _lost_steps
    from trainguard.events import read_events

    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"t": 1, "event": "step", "step": 4}\n' + b"\0" * 64 + b'{"t": 2, "event": "step", "step": 9}\n')
    assert [e["step"] for e in read_events(path)] == [4, 9]
    assert _lost_steps(path, 5) == 5  # steps 5..9 were done before the restart resumed at 5


def test_a_run_whose_manager_logged_elsewhere_says_so():
    # `trainguard run --run-dir D` with the manager's root elsewhere: D holds the agent's and the
    # steps' events only; the zeros of "checkpoints" must not read as "no checkpoint was saved".
    launcher_only = [e for e in _events() if e["event"] not in ("save", "restore", "first_step")]
    assert "no save or restore logged here" in format_summary(summarize(launcher_only))
    assert "no save or restore logged here" not in format_summary(summarize(_events()))
