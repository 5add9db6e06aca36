"""review58c: what a week-long run's many saves by one manager cost, counted per save (not timed).

Retention under ``KeepBest(..) | KeepEvery(k)`` (keep the best and every k-th for good) looked at every kept
checkpoint at each save: a stat of each one's manifest (``keptseen.kept_gone``), so a save's storage calls grew
with the number of past saves (1,000 saves with ``KeepEvery(5)``: 25 a save at first, 172 at the end; on an
object store a HEAD each). Only the steps a ``KeepBest`` picked can change what it keeps if they are gone.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections import Counter

import torch

import trainguard as tg
from trainguard import layout
from trainguard.storage.local import LocalStorage


def _state(step: int) -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 2), "p": tg.StateDict(step=step)}


def _run_dir(root, kept: int) -> None:
    """``kept`` committed checkpoints at steps 2, 4, ... (each a copy of one real save: cheap, no fsync each)."""
    first = root / layout.step_dir(2)
    tg.save(str(first), _state(2), metadata={"metrics": {"loss": 5.0}})
    for i in range(2, kept + 1):
        shutil.copytree(first, root / layout.step_dir(2 * i))


def _calls_per_save(root, monkeypatch, kept: int) -> int:
    """Storage calls of one save that deletes a step (after two, so that retention trusts what it listed) of a manager whose run
    directory holds ``kept`` checkpoints its ``KeepBest("loss", 2) | KeepEvery(2)`` keeps."""
    _run_dir(root, kept)
    calls: Counter[str] = Counter()
    for name in ("exists", "size", "listdir", "read_bytes"):
        orig = getattr(LocalStorage, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(LocalStorage, name, counted)
    keep = tg.KeepBest("loss", 2) | tg.KeepEvery(2)
    step = 2 * kept + 1  # odd: not kept by KeepEvery(2), deleted at the next save
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for s in (step, step + 1):
            mgr.save(s, _state(s), metrics={"loss": 2.0 + s % 2})  # step: no KeepBest pick, deleted at step + 2's
        calls.clear()
        mgr.save(step + 2, _state(step + 2), metrics={"loss": 2.5})
        n = sum(calls.values())
    monkeypatch.undo()
    held = {layout.parse_step(p.name) for p in root.iterdir()}
    assert set(range(2, 2 * kept + 1, 2)) <= held and step not in held  # KeepEvery's all stay; an odd one went
    return n


def test_keepbest_keepevery_save_does_not_look_at_every_kept_checkpoint(tmp_path, monkeypatch):
    few = _calls_per_save(tmp_path / "few", monkeypatch, kept=5)
    many = _calls_per_save(tmp_path / "many", monkeypatch, kept=200)
    # Before: many - few ~ 195 (a stat of each kept manifest); a generous bound, not an exact count.
    assert many <= few + 20, (few, many)


def test_keepbest_pick_gone_is_still_seen_under_a_union(tmp_path):
    """The steps a KeepBest picked are still looked at: the best one's manifest removed by hand, the next best
    (the step that would be deleted) is kept, as before the look was narrowed to them (a guard: passes on main)."""
    keep = tg.KeepBest("loss", 1) | tg.KeepLatest(2)
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=keep, handle_signals=False) as mgr:
        for s, loss in ((1, 1.0), (2, 2.0), (3, 3.0)):
            mgr.save(s, _state(s), metrics={"loss": loss})
        (tmp_path / layout.step_dir(1) / layout.MANIFEST).unlink()  # the best, gone since retention listed it
        mgr.save(4, _state(4), metrics={"loss": 4.0})  # 2 is now the best: not deleted in 1's trust
    assert (tmp_path / layout.step_dir(2) / layout.MANIFEST).exists()


def _registry_entries() -> int:
    """Entries of every module's ``__warningregistry__`` (what ``warnings.warn`` keeps per distinct text)."""
    return sum(len(r) for m in list(sys.modules.values())
               if isinstance(r := getattr(m, "__dict__", {}).get("__warningregistry__"), dict))


def test_failing_saves_and_saves_mid_accumulation_keep_no_warning_per_save(tmp_path, monkeypatch):
    """``on_error="warn"`` with every save failing (a disk that stays broken for days), and saves after
    backward() before step(): each save's warning names its step, and ``warnings.warn`` kept one registry entry
    per text for the process's life (300 failing saves: 305 entries). Each is still shown, every time."""
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "begin")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    saves = 100
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # a plain script's: the registry is used
        with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), on_error="warn", handle_signals=False) as mgr:
            mgr.save(0, state)  # watches the optimizer (gradwatch)
            before = _registry_entries()
            for s in range(1, saves + 1):
                model(torch.ones(1, 4)).sum().backward()  # gradients no step() used: warned at each save
                mgr.save(s, state)
            after = _registry_entries()
    failed = [w for w in seen if "failed (on_error='warn')" in str(w.message)]
    pending = [w for w in seen if "comes after backward()" in str(w.message)]
    assert len(failed) >= saves and len(pending) >= saves  # each shown
    assert after - before <= 10, (before, after)  # was 2 a save
    assert failed[0].filename == __file__  # the caller's line, not the library's
