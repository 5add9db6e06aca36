"""Hunt 50 (leftovers50): small defects the previous session left.

- A sync save's ``save`` event is written at its commit, before rank 0's retention deletes (a kill
  during them lost the event of a committed checkpoint); the deletes' seconds follow in
  ``save_retention``, which ``trainguard report`` adds to the save stall.
- ``ResumableIterable.advance(n)`` with a wrong count (``advance(1)`` per batch of 10, the global batch)
  is warned, as ``ResumableSampler`` warned it; before, silent.
- ``restore``'s "none of the checkpoints could be loaded" names each skipped step and directory once.
- NumPy (and 0-d tensor) integers: the hints of the calls that take them say ``SupportsIndex``;
  ``ResumableIterable(batch_size=np.int64(8))`` and ``ResumableSampler(torch.tensor(3))`` work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import trainguard as tg
from trainguard import report
from trainguard.events import read_events

SRC = str(Path(__file__).resolve().parents[1] / "src")

_SYNC_CHILD = textwrap.dedent("""
    import sys, torch
    import trainguard as tg
    model = torch.nn.Linear(8, 8)
    mgr = tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False).open()
    for step in (1, 2, 3):
        mgr.save(step, {"model": model})  # step 3: SIGKILLed in its retention (before_retention, third time)
    print("not killed", flush=True)
""")


def test_sync_save_killed_in_its_retention_deletes_keeps_its_save_event(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRAINGUARD_CRASH_AT": "before_retention", "TRAINGUARD_CRASH_SKIP": "2", "TRAINGUARD_CRASH_KIND": "kill"}
    r = subprocess.run([sys.executable, "-c", _SYNC_CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr)
    assert (tmp_path / "step-000000003" / "manifest.json").exists() or (tmp_path / "step-000000003").is_dir()
    events = list(read_events(tmp_path))
    saves = [e for e in events if e["event"] == "save"]
    assert [e["step"] for e in saves] == [1, 2, 3], saves  # step 3 committed: in the log, though killed after
    assert saves[2]["async_save"] is False and saves[2]["bytes"] > 0
    assert [e["step"] for e in events if e["event"] == "save_retention"] == [1, 2]  # step 3's deletes never ended


def test_sync_save_retention_seconds_are_logged_after_the_save_and_counted_by_report(tmp_path):
    model = torch.nn.Linear(8, 8)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"model": model})
    events = list(read_events(tmp_path))
    kinds = [(e["event"], e.get("step")) for e in events if e["event"] in ("save", "save_retention")]
    assert kinds == [(k, s) for s in (1, 2, 3, 4) for k in ("save", "save_retention")]
    stall = sum(e["stall_s"] for e in events if e["event"] in ("save", "save_retention"))
    for s in (report.summarize(events), report.summary(report.tally_log(tmp_path))):
        assert s["saves"] == 4
        assert abs(s["save_stall_s"] - stall) < 1e-9, (s["save_stall_s"], stall)
    with tg.CheckpointManager(tmp_path / "async", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True,
                              handle_signals=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": model})
    assert not [e for e in read_events(tmp_path / "async") if e["event"] == "save_retention"]  # on the save thread


# ---------------------------------------------------------------- ResumableIterable.advance: a wrong count warned
def _epoch(ds, batch: int, count) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for x in torch.utils.data.DataLoader(ds, batch_size=batch):
            ds.advance(count(x))
        ds.next_epoch()
    return [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)]


def test_resumable_iterable_warns_when_advance_under_counts_the_epoch():
    ds = tg.ResumableIterable(lambda e: range(100), rank=0, world_size=1)
    (msg,) = _epoch(ds, 10, lambda x: 1)  # advance(1) per batch of 10: before, silent
    assert "advance() counted 10 item(s) in 10 call(s)" in msg and "gave this rank 100 item(s)" in msg, msg
    assert _epoch(ds, 10, lambda x: 1) == []  # once per dataset object, as ResumableSampler's
    never = tg.ResumableIterable(lambda e: range(30), rank=0, world_size=1)
    (msg,) = _epoch(never, 10, lambda x: 0)
    assert "advance() counted 0 item(s)" in msg, msg


def test_resumable_iterable_right_counts_are_not_warned():
    for batch, world, rank in ((10, 1, 0), (8, 1, 0), (7, 2, 1), (8, 3, 2)):
        ds = tg.ResumableIterable(lambda e: range(100), rank=rank, world_size=world)
        for _ in range(2):
            assert _epoch(ds, batch, len) == [], (batch, world)
    ds = tg.ResumableIterable(lambda e: range(100), rank=0, world_size=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for x in torch.utils.data.DataLoader(ds, batch_size=8, drop_last=True):  # 4 items dropped: < a batch
            ds.advance(len(x))
        ds.next_epoch()
        ds.load_state_dict({"epoch": 1, "position": 40})  # a resume mid-epoch: counted from the restored position
        for x in torch.utils.data.DataLoader(ds, batch_size=10):
            ds.advance(len(x))
        ds.next_epoch()
        ds.advance(5)  # skipping before any iterator of the epoch: on purpose
        for x in torch.utils.data.DataLoader(ds, batch_size=5):
            ds.advance(len(x))
            if ds.position >= 50:
                break  # a steps-per-epoch cap: the stream not read to its end
        ds.next_epoch()
    assert [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)] == []


def test_resumable_iterable_warns_when_advance_counts_the_global_batch():
    ds = tg.ResumableIterable(lambda e: range(100), rank=0, world_size=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for x in torch.utils.data.DataLoader(ds, batch_size=10):
            ds.advance(len(x) * 2)  # the global batch: the position moves 4x what this rank read
            break
    (msg,) = [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)]
    assert "more than the 10 it gave this rank" in msg, msg


# ---------------------------------------------------------------- restore's summary: the step and directory once
def test_restore_summary_names_the_step_and_directory_once(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), handle_signals=False) as mgr:
        for s in (1, 2):
            mgr.save(s, {"a": torch.full((1000,), float(s))})
    for s in (1, 2):
        d = tmp_path / f"step-{s:09d}"
        for f in d.glob("data-*.bin"):
            b = bytearray(f.read_bytes())
            b[100] ^= 0xFF
            f.write_bytes(bytes(b))
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), handle_signals=False) as mgr, \
            pytest.raises(tg.CheckpointError) as ei:
        mgr.restore({"a": torch.zeros(1000)})
    lines = [ln for ln in str(ei.value).splitlines() if ln.startswith("step ")]
    assert len(lines) == 2, str(ei.value)
    for s, ln in zip((2, 1), lines):
        d = str(tmp_path / f"step-{s:09d}")
        assert ln.startswith(f"step {s}: {d}/data-00000.bin: checksum mismatch"), ln
        assert ln.count(d) == 1 and ln.count(f"step {s}") == 1, ln  # was: the directory and the step twice each
        assert "load had begun" not in ln  # said once, by the summary's last line
    assert "The state may hold part of what was read" in str(ei.value)


# ---------------------------------------------------------------- NumPy integers: hints that admit what is taken
def test_numpy_and_tensor_integers_work_where_the_hints_now_admit_them(tmp_path):
    from typing import get_type_hints

    from test_hunt49_typecheck49 import _admits

    for v in (np.int64(3), np.int32(3), torch.tensor(3)):
        assert tg.EveryNSteps(v).n == tg.KeepLatest(v).n == tg.KeepEvery(v).k == tg.KeepBest("loss", v).n == 3
        assert tg.DalyInterval(node_mtbf_s=3600.0, initial_steps=v, min_steps=v, max_steps=v, window=v).min_steps == 3
        s = tg.ResumableSampler(v, seed=v, rank=np.int64(0), world_size=np.int64(1))
        s.advance(v)
        s.set_epoch(v)
        assert (s.num_samples, s.seed, s.epoch) == (3, 3, 3)
        ds = tg.ResumableIterable(lambda e: range(6), batch_size=v, seed=v, rank=np.int64(1), world_size=np.int64(2))
        assert ds.batch_size == 3  # before: ValueError "the DataLoader's batch_size, an int >= 1" for a NumPy int
        ds.advance(v)
        assert ds.position == 6
    model = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(np.int64(1)), keep=tg.KeepLatest(np.int64(3)),
                              handle_signals=False) as mgr:
        for step in np.arange(1, 4):
            assert mgr.save(step, {"m": model}) is not None
        assert mgr.restore({"m": model}, step=np.int64(2)) == 2
    hinted = [(tg.EveryNSteps.__init__, "n"), (tg.KeepLatest.__init__, "n"), (tg.KeepEvery.__init__, "k"),
              (tg.KeepBest.__init__, "n"), (tg.DalyInterval.__init__, "min_steps"), (tg.DalyInterval.__init__, "max_steps"),
              (tg.ResumableSampler.__init__, "data"), (tg.ResumableSampler.__init__, "seed"),
              (tg.ResumableSampler.__init__, "rank"), (tg.ResumableSampler.advance, "n"),
              (tg.ResumableSampler.set_epoch, "epoch"), (tg.ResumableIterable.__init__, "batch_size"),
              (tg.ResumableIterable.advance, "n"), (tg.CheckpointManager.save, "step"),
              (tg.CheckpointManager.restore, "step")]
    for f, arg in hinted:
        assert _admits(get_type_hints(f)[arg], np.int64(3)), (f.__qualname__, arg)
    for bad in (True, 2.0):
        with pytest.raises(ValueError):
            tg.ResumableIterable(lambda e: range(6), batch_size=bad)
        with pytest.raises(ValueError):
            tg.EveryNSteps(bad)


# ---------------------------------------------------------------- doctor: data drawn at import before any seed
_DRAWN_AT_IMPORT = """import torch
import trainguard as tg
N = 1000
perm = torch.randperm(N)
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
mgr = tg.CheckpointManager("ckpt")
start = mgr.restore({"model": model, "rng": tg.RNGState()})
for step in range(10):
    x = torch.randn(4, 4)
"""

_SEEDED_FIRST = """import random
import numpy as np
import torch
g = torch.Generator().manual_seed(1)
held = torch.randperm(10, generator=g)
model = torch.nn.Linear(2, 2)
def make():
    return torch.randn(3)
def seed_all(s):
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)
if __name__ == "__main__":
    seed_all(0)
    X = torch.randn(10)
    order = np.random.permutation(10)
"""


def _draw_findings(source: str) -> list:
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    return [f for f in check_source(Settings(source=source)) if f.check == "draw before seed"]


def test_doctor_reports_data_drawn_from_the_global_generator_at_import_before_the_seed():
    (f,) = _draw_findings(_DRAWN_AT_IMPORT)
    assert f.severity == "warning" and f.message.startswith("line 4: torch.randperm(N)"), f
    (f,) = _draw_findings("import numpy as np\ndata = np.random.permutation(100)\n"
                          "if __name__ == '__main__':\n    import torch\n    torch.manual_seed(0)\n")
    assert f.message.startswith("line 2: np.random.permutation(100)"), f
    (f,) = _draw_findings("import random\nitems = list(range(9))\nwith open('x') as fh:\n    random.shuffle(items)\n")
    assert "random.shuffle(items)" in f.message
    assert _draw_findings(_SEEDED_FIRST) == []  # seeded first (by a function of the script), a Generator, in a function


def test_doctor_draw_check_is_quiet_on_the_example_and_fixture_scripts():
    root = Path(__file__).resolve().parents[1]
    scripts = sorted([*(root / "examples").glob("*.py"), *(root / "tests" / "doctor49_scripts").glob("*.py")])
    assert len(scripts) >= 15
    flagged = [p.name for p in scripts if _draw_findings(p.read_text())]
    assert flagged == []


def test_doctor_draw_check_reads_a_try_with_except_star_block_as_a_try_block():
    # Session 51: a module-level `try: ... except* E:` (ast.TryStar, Python 3.11) was read whole, its
    # handlers too, unlike a plain `try:` whose handlers (run only on an error) are not read.
    src = "import torch\ntry:\n    perm = torch.randperm(10)\nexcept* ValueError:\n    pass\ntorch.manual_seed(0)\n"
    (f,) = _draw_findings(src)
    assert f.message.startswith("line 3: torch.randperm(10)"), f
    handler = "import torch\ntry:\n    import numpy\nexcept{} ImportError:\n    x = torch.randn(3)\ntorch.manual_seed(0)\n"
    assert _draw_findings(handler.format("")) == []
    assert _draw_findings(handler.format("*")) == []
