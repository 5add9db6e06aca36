"""A resume whose parameters differ in requires_grad from the checkpoint's: warned.

A checkpoint restores values, not ``requires_grad`` (torch does not save it either). A loop that
unfreezes its backbone at ``step == K`` and is resumed past K trains on with the backbone frozen,
silently: the optimizer's moments load, the weights never move again."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import trainguard as tg

UNFREEZE = 3


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    for p in m[0].parameters():
        p.requires_grad_(False)  # a frozen backbone, unfrozen at step UNFREEZE
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def _train(m: nn.Module, o: torch.optim.Optimizer, start: int, stop: int, unfreeze: bool) -> None:
    for step in range(start, stop):
        if unfreeze and step == UNFREEZE:  # the mistake: only at that step, never applied again on resume
            for p in m[0].parameters():
                p.requires_grad_(True)
        g = torch.Generator().manual_seed(step)
        o.zero_grad()
        m(torch.randn(3, 4, generator=g)).square().mean().backward()
        o.step()


def _restore(root, m, o) -> tuple[int | None, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1000), handle_signals=False) as mgr:
            step = mgr.restore({"model": m, "optim": o})
    return step, [str(w.message) for w in got if "requires_grad" in str(w.message)]


def test_a_resume_past_an_unfreeze_step_is_warned(tmp_path) -> None:
    m, o = _build()
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1000), handle_signals=False) as mgr:
        _train(m, o, 0, 5, unfreeze=True)
        mgr.save(5, {"model": m, "optim": o}, force=True)
    saved = json.loads((tmp_path / "step-000000005" / "manifest.json").read_text())["manifest"]["objects"]["model"]
    assert saved["frozen"] == []  # every parameter trainable at step 5

    m2, o2 = _build()  # the resumed run: built frozen, its loop never reaches step == UNFREEZE again
    step, warned = _restore(tmp_path, m2, o2)
    assert step == 5 and torch.equal(m2[0].weight, m[0].weight)  # the values did load
    assert len(warned) == 1, warned
    assert "2 were trainable then and are frozen now: ['0.bias', '0.weight']" in warned[0], warned[0]
    assert "apply that again on resume" in warned[0]


def test_frozen_at_save_and_trainable_now_is_warned_and_the_same_flags_are_not(tmp_path) -> None:
    m, o = _build()
    _train(m, o, 0, 2, unfreeze=False)
    tg.save(tmp_path / "step-000000002", {"model": m, "optim": o})

    m2, o2 = _build()
    for p in m2.parameters():
        p.requires_grad_(True)  # the freeze was forgotten on resume
    _, warned = _restore(tmp_path, m2, o2)
    assert len(warned) == 1 and "2 were frozen then and are trainable now: ['0.bias', '0.weight']" in warned[0], warned

    m3, o3 = _build()  # built as at the save: nothing to say
    _, warned = _restore(tmp_path, m3, o3)
    assert warned == []


def test_a_weights_only_load_may_freeze_on_purpose(tmp_path) -> None:
    """Fine-tuning from a checkpoint (no optimizer loaded) with other parameters frozen: no warning."""
    m, o = _build()
    for p in m.parameters():
        p.requires_grad_(True)
    tg.save(tmp_path / "step-000000001", {"model": m, "optim": o})
    m2, _ = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.load(tmp_path / "step-000000001", {"model": m2}, strict=False)
    assert torch.equal(m2[2].weight, m[2].weight)


@pytest.mark.parametrize("wrap", [True, False])
def test_a_checkpoint_without_the_record_is_not_warned(wrap) -> None:
    """tests/data/ac_wrapped was written before checkpoints recorded requires_grad."""
    import importlib.util
    from pathlib import Path

    data = Path(__file__).parent / "data"
    spec = importlib.util.spec_from_file_location("make_ac_wrapped", data / "make_ac_wrapped.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m, o = mod.build(wrap)
    for p in m.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.load(data / "ac_wrapped" / "step-000000003", {"model": m, "optim": o})


def test_a_damaged_record_is_ignored(tmp_path) -> None:
    """A "frozen" value that is not a list of names (the manifest does not validate it) skips the
    check instead of failing the load with a TypeError (newcode18's find)."""
    import xxhash

    m, o = _build()
    tg.save(tmp_path / "step-000000001", {"model": m, "optim": o})
    path = tmp_path / "step-000000001" / "manifest.json"
    raw = json.loads(path.read_text())
    raw["manifest"]["objects"]["model"]["frozen"] = [[1]]
    body = json.dumps(raw["manifest"], separators=(",", ":"))
    path.write_text(f'{{"checksum":"{xxhash.xxh3_64_hexdigest(body.encode())}","manifest":{body}}}\n')
    m2, o2 = _build()
    tg.load(tmp_path / "step-000000001", {"model": m2, "optim": o2})
    assert torch.equal(m2[2].weight, m[2].weight)
