"""Review of session 43's changes (hunt 43, "review43")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_versions43 import Inverted as _Inverted


def _scripted(seed: int) -> torch.jit.ScriptModule:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    m(torch.randn(4, 3))  # running stats and num_batches_tracked off their initial values
    return torch.jit.script(m)


def test_a_torch_jit_script_module_loads(tmp_path: Path) -> None:
    """``names.saved_metadata`` (session 43's module versions) asked each submodule whether it
    wraps another with ``set(mod._modules)``: a ``torch.jit.script`` module's ``_modules`` is an
    ``OrderedModuleDict``, which cannot be iterated so (``KeyError: 0``), and every load of a
    scripted module was refused ("its load_state_dict() refused the saved state: 0"); it loaded before."""
    src = _scripted(0)
    tg.save(tmp_path / "ckpt", {"model": src})
    dst = _scripted(1)
    tg.load(tmp_path / "ckpt", {"model": dst})
    for name, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], value), name
    assert int(dst.state_dict()["1.num_batches_tracked"]) == 1


def test_split_state_records_no_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/checkpoints.md said that each module entry records its versions; a ``split_state=True``
    save records none (rank 0 builds the manifest, each group's entries from its skeletons only), so
    its module loads with the current versions, not upgraded. The docs say so now (doc-only fix)."""
    monkeypatch.setattr(_Inverted, "_version", 1)
    tg.save(tmp_path / "ckpt", {"model": torch.nn.Sequential(_Inverted())}, split_state=True)
    body = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())["manifest"]
    assert "versions" not in body["objects"]["model"]
    monkeypatch.setattr(_Inverted, "_version", 2)
    m = torch.nn.Sequential(_Inverted())
    m[0].scale.fill_(7.0)
    tg.load(tmp_path / "ckpt", {"model": m}, split_state=True)
    assert m[0].scale.item() == 4.0  # as saved: the version-1 value taken for a version-2 one
