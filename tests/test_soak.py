"""Soak (``make soak``; marked slow, not part of ``make test``): 300 consecutive async saves with
retention on a real training loop, with random save failures injected at the named fault points.

Checks and prints: resident memory stays flat (max - min after warm-up within ``RSS_BOUND``),
the number of committed step directories never exceeds the retention limit and ends at it, no
temp directory survives a finished save, every injected failure is reported (a warning and a
``save_failed`` event each), and the final restore equals the last committed state bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import time
import warnings

import psutil
import pytest
import torch

import trainguard as tg

from trainlib import build, snapshot, train

SAVES = int(os.environ.get("TG_SOAK_SAVES", "300"))
KEEP = 3
FAIL_RATE = 0.1
WARMUP = 30
RSS_BOUND = 64 << 20  # bytes; the state is ~10 KB, so growth here would be a leak
POINTS = ("begin", "write_begin", "write_piece", "before_fsync", "written", "before_manifest", "after_manifest")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_async_saves_with_retention_and_failures(tmp_path):
    root = tmp_path / "run"
    rng = random.Random(2024)
    proc = psutil.Process()
    state = build(SAVES + 10)
    rss: list[int] = []
    injected: list[tuple[int, str]] = []
    warned = 0
    max_dirs = 0
    last_ok, last_snap = None, None
    t0 = time.monotonic()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(KEEP), async_save=True,
                              on_error="warn", handle_signals=False) as mgr:
        for step in range(1, SAVES + 1):
            train(state, step - 1, step)
            fail = rng.random() < FAIL_RATE
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if fail:
                    mgr.wait()  # the previous save must not meet this fault
                    point = rng.choice(POINTS)
                    os.environ.update(TRAINGUARD_CRASH_AT=point, TRAINGUARD_CRASH_KIND="raise")
                    try:
                        mgr.save(step, state)
                        mgr.wait()
                    finally:
                        del os.environ["TRAINGUARD_CRASH_AT"], os.environ["TRAINGUARD_CRASH_KIND"]
                    injected.append((step, point))
                else:
                    mgr.save(step, state)
                    snap = snapshot(state)  # the state this save holds (async: staged before the next step)
                    mgr.wait()
                    last_ok, last_snap = step, snap
                warned += sum("failed (on_error='warn')" in str(w.message) for w in caught)
            names = os.listdir(root)
            committed = [n for n in names if n.startswith("step-") and "." not in n]
            assert not [n for n in names if ".tmp-" in n or ".old-" in n], names
            max_dirs = max(max_dirs, len(committed))
            if step >= WARMUP:
                rss.append(proc.memory_info().rss)
    elapsed = time.monotonic() - t0
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    failed_events = [e for e in events if e["event"] == "save_failed"]
    saved = [e for e in events if e["event"] == "save"]
    final_dirs = sorted(n for n in os.listdir(root) if n.startswith("step-"))

    fresh = build(SAVES + 10, seed=1)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        restored = mgr.restore(fresh)
    got = snapshot(fresh)
    same = restored == last_ok and all(torch.equal(got[k], last_snap[k]) for k in last_snap)

    growth = max(rss) - min(rss)
    print(
        f"soak: saves={SAVES} committed={len(saved)} injected_failures={len(injected)} "
        f"reported_warnings={warned} save_failed_events={len(failed_events)} "
        f"max_step_dirs={max_dirs} final_step_dirs={len(final_dirs)} keep={KEEP} "
        f"rss_first={min(rss) >> 20}MiB rss_max={max(rss) >> 20}MiB growth={growth / (1 << 20):.1f}MiB "
        f"(bound {RSS_BOUND >> 20}MiB) restored={restored} last_committed={last_ok} equal={same} "
        f"elapsed={elapsed:.1f}s"
    )
    assert len(injected) > 0 and warned == len(injected) == len(failed_events)
    assert len(saved) == SAVES - len(injected)
    assert max_dirs <= KEEP and len(final_dirs) == KEEP
    assert growth <= RSS_BOUND
    assert same
