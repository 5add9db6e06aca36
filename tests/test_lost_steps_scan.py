"""``_lost_steps`` (rank 0's first heartbeat of every process under ``trainguard run``) on a
week-long event log: one ``step`` line per training step, 600,000 lines (52 MB) at a step a
second. It parsed every line as JSON, 1.6 s in the first step of every restart; it now parses
only ``agent_start`` lines and the few lines it needs, with the same answers."""

from __future__ import annotations

import json
import random

from trainguard.elastic import watchdog
from trainguard.elastic.watchdog import _lost_steps
from trainguard.events import EventLog, read_events


def _reference(path, step: int, job: str | None) -> int:
    """The definition (the former implementation): every line parsed, in order."""
    last_mine = last_any = None
    seen = mine = False
    for ev in read_events(path):
        kind = ev.get("event")
        if kind == "agent_start":
            mine = job is not None and ev.get("job_id") == job
            seen = seen or mine
            last_any = None
        elif kind == "step":
            last_any = ev.get("step")
            if mine:
                last_mine = last_any
    last = last_mine if seen else last_any
    return 0 if not isinstance(last, int) or last < step else last - (step - 1)


def test_same_answers_as_parsing_every_line_on_random_logs(tmp_path):
    rng = random.Random(7)
    for trial in range(60):
        path = tmp_path / f"events-{trial}.jsonl"
        log = EventLog(path)
        s = 0
        for _ in range(rng.randrange(0, 40)):
            kind = rng.random()
            if kind < 0.1:
                log.emit("agent_start", job_id=rng.choice(["a", "b", "c"]))
            elif kind < 0.2:
                log.emit("save", step=s, bytes=10)  # other events with a "step" field
            elif kind < 0.25:
                log.emit("restore", step=rng.randrange(0, s + 1), detail={"event": "step", "step": 999})
            elif kind < 0.3:
                s = rng.randrange(0, s + 1)  # a restart from an older step
            else:
                s += 1
                log.emit("step", step=s, world_size=1)
        if rng.random() < 0.3:
            with open(path, "a") as f:
                f.write('{"t": 1, "event": "step", "step": 12')  # a torn last line
        for job in (None, "a", "b", "zz"):
            for at in (0, 1, 3, s, s + 1):
                assert _lost_steps(path, at, job) == _reference(path, at, job), (trial, job, at, path.read_text())
    assert _lost_steps(tmp_path / "missing.jsonl", 1, "a") == 0
    (tmp_path / "empty.jsonl").write_text("")
    assert _lost_steps(tmp_path / "empty.jsonl", 1, None) == 0


def test_a_long_log_is_not_parsed_line_by_line(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"t": 0.0, "event": "agent_start", "rank": -1, "pid": 1, "job_id": "j"}) + "\n")
        for s in range(1, 20001):
            f.write(json.dumps({"t": float(s), "event": "step", "rank": 0, "pid": 2, "step": s, "world_size": 8}) + "\n")
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda *a, **k: parsed.append(1) or real(*a, **k))
    assert _lost_steps(path, 19_901, "j") == 100
    assert len(parsed) < 10
    assert watchdog  # the module under test
