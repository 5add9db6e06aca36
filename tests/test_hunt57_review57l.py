"""Session 57, review57l: hostile review of the review57k doctor merge (d78502c).

tg.doctor called in-process from a program whose own package is imported: the doctor marked that
package as one it had imported itself, so a later call for another folder's package of the same name
dropped the running program's modules from sys.modules (its next import of them made new copies).

Of the review57j merge (7254afb): every async save dropped the idle pools of caps no open manager has,
so a model's manager and an EMA's direct ``tg.save`` with its own cap reallocated the EMA's arena every
round (11 arena allocations in 10 rounds, against 2 before 7254afb)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import async_save, stage
from trainguard.commands import CommandError
from trainguard.commands.doctorhook import load_hook

_HOOK = "from .cfg import LR\n\ndef trainguard_state():\n    return {'lr': LR}\n"


def _package(root: Path, name: str, lr: float) -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cfg.py").write_text(f"LR = {lr}\n")
    (pkg / "train.py").write_text(_HOOK)
    return pkg / "train.py"


def test_doctor_keeps_the_running_programs_own_package(tmp_path, monkeypatch):
    name = "proj_review57l"
    mine = _package(tmp_path / "a", name, 0.1)
    other = _package(tmp_path / "b", name, 0.2)
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    for k in [k for k in sys.modules if k.split(".")[0] == name]:
        monkeypatch.delitem(sys.modules, k)
    try:
        pkg = importlib.import_module(name)  # the user's program: its own package, imported as usual
        cfg = importlib.import_module(f"{name}.cfg")
        state, _ = load_hook(mine)  # tg.doctor on its own script, in-process
        assert state == {"lr": 0.1}
        with pytest.raises(CommandError, match="already imported"):
            load_hook(other)  # another folder's package of that name: refused, the program's kept
        assert sys.modules[name] is pkg
        assert sys.modules[f"{name}.cfg"] is cfg
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == name]:
            del sys.modules[k]


@pytest.fixture
def _pools(monkeypatch):
    monkeypatch.setattr(stage, "_DEFAULT", {})  # this test's pools only
    monkeypatch.setattr(stage, "_DIRECT", [], raising=False)
    yield
    job = async_save._INFLIGHT
    if job is not None and job.handle._thread is not None and job.handle._thread.ident is not None:
        job.handle.join(60)


def test_a_managers_saves_keep_an_ema_direct_saves_pool(tmp_path, monkeypatch, _pools):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    optim.step()
    ema = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    sizes: list[int] = []
    real = stage.aligned_empty
    monkeypatch.setattr(stage, "aligned_empty", lambda n, align: sizes.append(n) or real(n, align))
    with tg.CheckpointManager(tmp_path / "model", save=tg.EveryNSteps(1), async_save=True,
                              handle_signals=False) as mgr:
        for step in range(1, 11):
            mgr.save(step, {"model": model, "optim": optim})
            mgr.wait()
            tg.save(tmp_path / f"ema{step}", {"ema": ema}, async_=True, max_staging_bytes=4 << 20).result(timeout=60)
            if step == 2:
                steady = len(sizes)
        assert len(sizes) == steady, f"arenas allocated again in steady state: {sizes[steady:]}"
    assert mgr.latest_step() == 10


def test_doctor_puts_back_the_running_programs_own_module(tmp_path, monkeypatch):
    import pickle

    name = "projm_review57l"
    script = _package(tmp_path, name, 0.3)
    script.write_text(_HOOK + "\n\nclass Box:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mine = importlib.import_module(f"{name}.train")  # the program imported its module
        box = mine.Box()
        state, _ = load_hook(script)  # then ran tg.doctor on its file, in-process
        assert state == {"lr": 0.3}
        assert sys.modules[f"{name}.train"] is mine
        assert type(pickle.loads(pickle.dumps(box))) is mine.Box  # torch.save of its objects still works
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == name]:
            del sys.modules[k]
