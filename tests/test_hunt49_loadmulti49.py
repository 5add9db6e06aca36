"""Session 49's hunt in multi-rank loads, resharding and restore's fallback (helper loadmulti49).

- A multi-rank load that failed on a missing data file (found before any byte is read) was marked
  "partly loaded" on every rank, with every entry of the state counted as written: the data files
  are checked after the plan round, and every error past that round was marked. ``restore`` then
  refused to fall back to an older checkpoint that lacked an entry of the state ("tensors
  ['extra/w'] were partly read from a newer checkpoint"), although no rank had read anything.
  Now each rank tells, in the "loaded" round, which entries it wrote into, and the error carries
  their union (``partread.py``).
- ``restore(strict=False)`` refused to fall back past a corrupt checkpoint that held an optimizer
  added since the older one was saved ("tensors ['opt2/state/...'] were partly read"): a fresh
  optimizer has no state to read into, so nothing of it was written. An optimizer with state
  (a rollback mid-run) is still counted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tests.dist_helper import run_ranks

import trainguard as tg

PARTLY = "the state may hold part of the checkpoint's values"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))


def _flip(ckpt: Path, tensor: str) -> None:
    """Flip one byte of ``tensor``'s stored bytes (its first chunk)."""
    body = json.loads((ckpt / "manifest.json").read_bytes())["manifest"]
    _o, _s, fname, off, _n, _sums = body["tensors"][tensor]["chunks"][0]
    with open(ckpt / fname, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def _ranks_save_with_extra_later(rank: int, world: int, run: str) -> None:
    """Step 1 without the entry "extra", step 2 with it; both on ``world`` ranks."""
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(0), "rng": tg.RNGState(), "progress": tg.StateDict(step=1)})
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        state = {"model": _model(0), "rng": tg.RNGState(), "progress": tg.StateDict(step=0),
                 "extra": tg.StateDict(w=torch.ones(3))}
        assert mgr.restore(state, strict=False) == 1
        state["progress"]["step"] = 2
        mgr.save(2, state)


def _ranks_load_then_restore(rank: int, world: int, run: str) -> dict:
    extra, progress, m = tg.StateDict(w=torch.zeros(3)), tg.StateDict(step=0), _model(1)
    state = {"model": m, "rng": tg.RNGState(), "progress": progress, "extra": extra}
    with pytest.raises(tg.CorruptCheckpointError) as ei:
        tg.load(Path(run) / "step-000000002", state, strict=False)
    out = {"load": str(ei.value), "partly": ei.value.partly_loaded, "touched": getattr(ei.value, "touched_entries", None)}
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        try:
            out["step"] = mgr.restore(state, strict=False)
        except tg.CheckpointError as e:
            out["step"] = str(e)
    out["extra"] = extra["w"].tolist()
    out["model"] = torch.equal(m[0].weight, _model(0)[0].weight)
    return out


def test_two_ranks_fall_back_past_a_missing_data_file_with_nothing_partly_loaded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_ranks(_ranks_save_with_extra_later, 2, str(run), timeout=120)
    os.unlink(run / "step-000000002" / "data-00001.bin")  # both ranks need it (replicated tensors are spread)
    for r in run_ranks(_ranks_load_then_restore, 2, str(run), timeout=120):
        v = r.value
        assert "data-00001.bin: data file is missing" in v["load"], v
        assert PARTLY not in v["load"] and v["partly"] is False and v["touched"] == [], v  # before: marked on every rank
        # before: "restore: tensors ['extra/w'] were partly read from a newer checkpoint that is not usable"
        assert v["step"] == 1, v
        assert v["extra"] == [0.0, 0.0, 0.0] and v["model"], v  # "extra" as built (step 1 lacks it), the model step 1's


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    return m, torch.optim.Adam(m[0].parameters(), lr=1e-3), torch.optim.SGD(m[1].parameters(), lr=1e-2, momentum=0.9)


def _step(m: torch.nn.Module, *opts: torch.optim.Optimizer) -> None:
    m(torch.randn(3, 8)).sum().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _saved_with_opt2_added(run: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """Step 1 of {model, opt1}, step 2 of {model, opt1, opt2} (opt2 added mid-run); step 2's last tensor flipped."""
    m, o1, o2 = _build(0)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        _step(m, o1, o2)
        mgr.save(1, {"model": m, "opt1": o1, "progress": tg.StateDict(step=1)})
        _step(m, o1, o2)
        mgr.save(2, {"model": m, "opt1": o1, "opt2": o2, "progress": tg.StateDict(step=2)})
    _flip(run / "step-000000002", "opt2/state/1.weight/momentum_buffer")  # the last tensor: the model is read before it
    return m, o1, o2


def test_restore_strict_false_falls_back_past_a_corrupt_checkpoint_of_an_optimizer_added_since(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    saved, _, _ = _saved_with_opt2_added(run)
    m, o1, o2 = _build(1)
    progress = tg.StateDict(step=0)
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        # before: "tensors ['opt2/state/1.bias/momentum_buffer', ...] were partly read from a newer checkpoint"
        assert mgr.restore({"model": m, "opt1": o1, "opt2": o2, "progress": progress}, strict=False) == 1
    assert progress["step"] == 1 and len(o1.state) == 2 and len(o2.state) == 0  # opt2 fresh: step 1 lacks it
    # before: nothing said that opt2 was left as it was
    assert "checkpoint of step 1 holds no state for entries ['opt2'] (left as they are)" in caplog.text
    step1 = _build(2)[0]
    tg.load(run / "step-000000001", {"model": step1}, only=["model"])
    assert torch.equal(m[0].weight, step1[0].weight) and not torch.equal(m[0].weight, saved[0].weight)  # step 1's


def test_restore_still_refuses_an_optimizer_with_state_that_a_skipped_load_read_into(tmp_path: Path) -> None:
    run = tmp_path / "run"
    m, o1, o2 = _saved_with_opt2_added(run)  # these live objects have state: a rollback mid-run reads into it
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match=r"tensors \['opt2/state/1.bias/momentum_buffer'.*were partly read"):
            mgr.restore({"model": m, "opt1": o1, "opt2": o2, "progress": tg.StateDict(step=0)}, strict=False)


def test_restore_strict_false_without_an_optimizer_removed_since_loads_the_rest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    m, o1, o2 = _build(0)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        _step(m, o1, o2)
        mgr.save(1, {"model": m, "opt1": o1, "opt2": o2, "progress": tg.StateDict(step=1)})
    m2, p1, _ = _build(1)
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.restore({"model": m2, "opt1": p1, "progress": tg.StateDict(step=0)}, strict=False) == 1
    assert torch.equal(m2[1].weight, m[1].weight)
    assert "checkpoint of step 1 holds entries ['opt2'] that the state lacks (not read)" in caplog.text
    assert all(torch.equal(o1.state[a]["exp_avg"], p1.state[b]["exp_avg"])
               for a, b in zip(m[0].parameters(), m2[0].parameters(), strict=True))


def _rewrite(ckpt: Path, edit) -> None:
    """Edit the manifest body of ``ckpt``, its checksum recomputed (a hand edit: only semantic checks see it)."""
    from trainguard.manifest import checksum

    body = json.loads((ckpt / "manifest.json").read_bytes())["manifest"]
    edit(body)
    raw = json.dumps(body, separators=(",", ":")).encode()
    (ckpt / "manifest.json").write_bytes(b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n")


def test_restore_refuses_a_sampler_that_a_skipped_load_set_and_the_older_checkpoint_lacks(tmp_path: Path) -> None:
    """The sampler's load_state_dict ran before the RNG entry's refused its (malformed) state; step 1,
    saved before the sampler was added, does not set it back: restore(strict=False) returned step 1 with
    the sampler at step 2's position (40 samples on), silently. (Before, a state whose tensors step 1
    lacked was refused, but only for those tensors: the sampler has none.)"""
    run = tmp_path / "run"
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": m, "progress": tg.StateDict(step=1), "rng": tg.RNGState()})
        data = tg.ResumableSampler(100, seed=0)
        data.advance(40)
        mgr.save(2, {"model": m, "progress": tg.StateDict(step=2), "data": data, "rng": tg.RNGState()})
    words = lambda b: b["objects"]["rng"]["ranks"][0]["python"]["$tuple"][1]["$tuple"]  # noqa: E731
    _rewrite(run / "step-000000002", lambda b: words(b).__setitem__(5, -1))  # random.setstate: OverflowError
    fresh = tg.ResumableSampler(100, seed=0)
    state = {"model": torch.nn.Linear(4, 4), "progress": tg.StateDict(step=0), "data": fresh, "rng": tg.RNGState()}
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match=r"entries \['data'\] \(no tensors.*step 1 does not hold them;"):
            mgr.restore(state, strict=False)  # before: returned 1
        assert fresh.position == 40  # what it refuses to hide
        fresh.load_state_dict(tg.ResumableSampler(100, seed=0).state_dict())
        del state["data"]  # what the error says to do: restore without it ...
        assert mgr.restore(state, strict=False) == 1
    assert state["progress"]["step"] == 1 and fresh.position == 0  # ... then add it fresh


def test_a_malformed_rng_state_leaves_every_generator_as_it_was_and_restore_falls_back(tmp_path: Path) -> None:
    """NumPy's part of the saved state does not parse after Python's was set: before, Python's generator kept
    the corrupt checkpoint's state (restore counted the whole entry as read, and refused to fall back to step 1,
    which lacks it, with strict=False)."""
    import random

    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(0), "progress": tg.StateDict(step=1)})
        random.seed(1234)
        mgr.save(2, {"model": _model(0), "progress": tg.StateDict(step=2), "rng": tg.RNGState()})
    _rewrite(run / "step-000000002", lambda b: b["objects"]["rng"]["ranks"][0]["numpy"].__setitem__("pos", 2**70))
    random.seed(99)
    python_before = random.getstate()
    state = {"model": _model(1), "progress": tg.StateDict(step=0), "rng": tg.RNGState()}
    with pytest.raises(tg.CorruptCheckpointError, match="saved RNG state is malformed") as ei:
        tg.load(run / "step-000000002", state)
    assert random.getstate() == python_before  # before: step 2's Python state
    assert PARTLY in str(ei.value)  # the model was read in place before the RNG entry's turn
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.restore(state, strict=False) == 1  # before: "tensors ['rng@0/numpy/keys', ...] were partly read"
    assert random.getstate() == python_before and state["progress"]["step"] == 1  # not in step 1: as it was
