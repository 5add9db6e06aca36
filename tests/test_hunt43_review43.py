"""Review of session 43's changes (hunt 43, "review43")."""

from __future__ import annotations

from pathlib import Path

import torch

import trainguard as tg


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
