"""Session 48's fresh-eyes review of the load / resume path (helper review48b): what it found.

- A load that failed after it had begun writing into the state (a checksum mismatch in a tensor
  late in the files, an entry's ``load_state_dict`` refusing after the entries before it were
  loaded, a peer rank's bad bytes) raised an error that said nothing of the state it left behind:
  the model already held the checkpoint's weights while the error read like a refusal. It now says
  so (``partread.py``); errors raised before anything was written do not.
- A hand-edited RNG state word out of range (random.setstate's OverflowError) escaped ``tg.load``
  and ``restore`` bare, instead of a ``CorruptCheckpointError`` (restore then falls back).
- ``restore`` refused to fall back past a skipped checkpoint whose load had written nothing (a
  missing data file) when the older one lacked a tensor of it, and past any corrupt checkpoint
  saved by more ranks than the older one and the restore ("tensors ['rng@1/...'] were partly read
  from a newer checkpoint"): no rank had read them.
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


def _saved(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    ckpt = tmp_path / "step-000000001"
    m = _model(0)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 16)).sum().backward()
    opt.step()
    tg.save(ckpt, {"model": m, "optim": opt})
    return ckpt, m


def test_a_checksum_mismatch_after_in_place_reads_says_the_state_is_partly_loaded(tmp_path: Path) -> None:
    ckpt, saved = _saved(tmp_path)
    _flip(ckpt, "optim/state/1.weight/step")  # the last tensor in the file: the model is read before it
    m = _model(1)
    before = m[0].weight.detach().clone()
    with pytest.raises(tg.CorruptCheckpointError, match="checksum mismatch in tensor 'optim/state/1.weight/step'") as ei:
        tg.load(ckpt, {"model": m, "optim": torch.optim.Adam(m.parameters())})
    assert not torch.equal(m[0].weight, before)  # what the message must admit: the model holds the checkpoint's
    assert torch.equal(m[0].weight, saved[0].weight)
    assert PARTLY in str(ei.value), str(ei.value)


def test_an_error_before_anything_is_read_is_not_marked(tmp_path: Path) -> None:
    ckpt, _ = _saved(tmp_path)
    os.unlink(ckpt / "data-00000.bin")
    m = _model(1)
    before = m[0].weight.detach().clone()
    with pytest.raises(tg.CorruptCheckpointError, match="data file is missing") as ei:
        tg.load(ckpt, {"model": m, "optim": torch.optim.Adam(m.parameters())})
    assert torch.equal(m[0].weight, before)
    assert PARTLY not in str(ei.value)
    with pytest.raises(tg.StateMismatchError) as ei2:  # refused before a byte is read
        tg.load(tmp_path / "step-000000001", {"model": torch.nn.Linear(3, 3)})
    assert PARTLY not in str(ei2.value)


class _Refuses:
    """An entry whose ``load_state_dict`` refuses what was saved (loaded after the model)."""

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        raise ValueError("n must be 2 here")


def test_an_entry_refusing_after_the_model_was_loaded_says_so(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000000001"
    saved = _model(0)
    tg.save(ckpt, {"model": saved, "obj": _Refuses()})
    m = _model(1)
    with pytest.raises(tg.CheckpointError, match="entry 'obj': its load_state_dict\\(\\) refused") as ei:
        tg.load(ckpt, {"model": m, "obj": _Refuses()})
    assert torch.equal(m[1].weight, saved[1].weight)
    assert PARTLY in str(ei.value), str(ei.value)


def _ranks_peer_corrupt(rank: int, world: int, root: str) -> tuple[str, bool, str]:
    import torch.distributed as dist

    ckpt = Path(root) / "step-000000001"
    tg.save(ckpt, {"model": _model(0), "rng": tg.RNGState()})
    dist.barrier()
    try:  # split_state: no rank holds layer 1, refused on every rank before anything is read
        tg.load(ckpt, {"model": torch.nn.Sequential(torch.nn.Linear(16, 16))}, split_state=True)
        untaken = ""
    except tg.CheckpointError as e:
        untaken = str(e)
    if rank == 0:
        _flip(ckpt, "rng@1/torch_cpu")  # rank 1's own RNG state: only rank 1 reads it
    dist.barrier()
    m = _model(1)
    try:
        tg.load(ckpt, {"model": m, "rng": tg.RNGState()})
    except tg.CheckpointError as e:
        return str(e), torch.equal(m[0].weight, _model(0)[0].weight), untaken
    return "", False, untaken


def test_a_peer_ranks_bad_bytes_say_the_state_is_partly_loaded_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_ranks_peer_corrupt, 2, str(tmp_path), timeout=120)
    (msg0, loaded0, untaken0), (msg1, _, untaken1) = (r.value for r in results)
    assert "rng@1/torch_cpu" in msg0 and "rng@1/torch_cpu" in msg1, (msg0, msg1)
    assert loaded0  # rank 0 read all of its own: its model holds the checkpoint's weights
    assert PARTLY in msg0 and PARTLY in msg1, (msg0, msg1)
    for untaken in (untaken0, untaken1):  # refused after the first round, before any rank read: not marked
        assert "no rank's state holds 2 tensor(s)" in untaken and PARTLY not in untaken, untaken


def _rewrite(ckpt: Path, edit) -> None:
    """Edit the manifest body of ``ckpt``, its checksum recomputed (a hand edit: only semantic checks see it)."""
    from trainguard.manifest import checksum

    body = json.loads((ckpt / "manifest.json").read_bytes())["manifest"]
    edit(body)
    raw = json.dumps(body, separators=(",", ":")).encode()
    (ckpt / "manifest.json").write_bytes(b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n")


def test_an_rng_state_word_out_of_range_is_a_corrupt_checkpoint_and_restore_falls_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    tg.save(run / "step-000000001", {"rng": tg.RNGState(), "progress": tg.StateDict(step=1)})
    tg.save(run / "step-000000002", {"rng": tg.RNGState(), "progress": tg.StateDict(step=2)})
    words = lambda b: b["objects"]["rng"]["ranks"][0]["python"]["$tuple"][1]["$tuple"]  # noqa: E731
    _rewrite(run / "step-000000002", lambda b: words(b).__setitem__(5, -1))  # random.setstate: OverflowError
    with pytest.raises(tg.CorruptCheckpointError, match="RNGState: the saved RNG state is malformed \\(OverflowError") as ei:
        tg.load(run / "step-000000002", {"rng": tg.RNGState()}, only=["rng"])
    assert PARTLY not in str(ei.value)  # read into the copies its state_dict() gave: nothing of the state changed
    _rewrite(run / "step-000000002", lambda b: words(b).__setitem__(5, 2**70))
    with pytest.raises(tg.CorruptCheckpointError, match="malformed \\(OverflowError"):
        tg.load(run / "step-000000002", {"rng": tg.RNGState()}, only=["rng"])
    progress = tg.StateDict(step=0)
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.restore({"rng": tg.RNGState(), "progress": progress}) == 1  # before: the bare OverflowError
    assert progress["step"] == 1
    assert "checkpoint of step 2 is not usable" in caplog.text


def _newest_two(run: Path) -> None:
    """Step 1 without the entry "extra", step 2 with it (a tensor the older checkpoint lacks)."""
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(0), "progress": tg.StateDict(step=1)})
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        state = {"model": _model(0), "progress": tg.StateDict(step=0), "extra": tg.StateDict(w=torch.ones(3))}
        assert mgr.restore(state, strict=False) == 1
        state["progress"]["step"] = 2
        mgr.save(2, state)


def test_restore_falls_back_past_a_checkpoint_that_failed_before_anything_was_read(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _newest_two(run)
    os.unlink(run / "step-000000002" / "data-00000.bin")  # refused before a byte is read
    extra, progress = tg.StateDict(w=torch.zeros(3)), tg.StateDict(step=0)
    with tg.CheckpointManager(run, handle_signals=False) as mgr:  # before: "tensors ['extra/w'] were partly read"
        assert mgr.restore({"model": _model(1), "progress": progress, "extra": extra}, strict=False) == 1
    assert progress["step"] == 1 and torch.equal(extra["w"], torch.zeros(3))  # never read: as it was


def test_restore_still_refuses_tensors_a_skipped_load_did_write(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _newest_two(run)
    _flip(run / "step-000000002", "model/1.weight")  # extra/w, earlier in the file, is read before it
    extra = tg.StateDict(w=torch.zeros(3))
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match="tensors \\['extra/w'\\] were partly read from a newer checkpoint"):
            mgr.restore({"model": _model(1), "progress": tg.StateDict(step=0), "extra": extra}, strict=False)
    assert torch.equal(extra["w"], torch.ones(3))  # what it refuses to hide


def _save_step2_on_two_ranks(rank: int, world: int, run: str) -> None:
    state = {"model": _model(0), "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        assert mgr.restore(state) == 1
        state["progress"]["step"] = 2
        mgr.save(2, state)


def test_restore_on_one_rank_falls_back_past_a_corrupt_checkpoint_saved_by_two(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(0), "rng": tg.RNGState(), "progress": tg.StateDict(step=1)})
    run_ranks(_save_step2_on_two_ranks, 2, str(run), timeout=120)  # the run grew to 2 ranks
    _flip(run / "step-000000002", "model/0.weight")  # read by rank 0 here
    progress = tg.StateDict(step=0)
    with tg.CheckpointManager(run, handle_signals=False) as mgr, pytest.warns(UserWarning, match="saved by 2 ranks"):
        # back on 1 rank; before: "tensors ['rng@1/numpy/keys', 'rng@1/torch_cpu'] were partly read", which no rank had read
        assert mgr.restore({"model": _model(1), "rng": tg.RNGState(), "progress": progress}) == 1
    assert progress["step"] == 1
