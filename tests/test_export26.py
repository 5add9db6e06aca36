"""``export.iter_tensors`` (``trainguard export`` and ``convert``) reads in batches: a batch's tensors
in one parallel ``read_targets`` call, then yielded in order (session 26; tensor by tensor the reads
of a 3 GB model took 2.9-4.8 s here, batched 1.6-2.8 s). The exported files must hold every tensor
bit for bit whatever the batches, a tie must stay one tensor in a ``.pt`` file, also when its
alias comes before its target and the two fall into different batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import export as exp


def _model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(300, 1000)  # 1.2 MB: more than the test's batch
    return {
        "a_tied": w,  # the alias sorts before its target
        "b": torch.randn(700, 300),
        "c": torch.randn(5).to(torch.bfloat16),
        "d_empty": torch.zeros(0),
        "e": torch.arange(100_000, dtype=torch.int32),
        "w": w,
    }


@pytest.mark.parametrize("fmt", [".pt", ".safetensors"])
def test_export_in_batches_holds_every_tensor_and_the_tie(tmp_path: Path, monkeypatch, fmt: str):
    monkeypatch.setattr(exp, "BATCH", 1 << 20)
    calls: list[int] = []
    real = exp.read_targets

    def counting(storage, directory, targets, **kw):
        targets = list(targets)
        calls.append(len(targets))
        return real(storage, directory, targets, **kw)

    monkeypatch.setattr(exp, "read_targets", counting)
    model = _model()
    tg.save(tmp_path / "ckpt", {"model": tg.StateDict(**model)})
    out = tmp_path / f"weights{fmt}"
    assert exp.export(tmp_path / "ckpt", out) == len(model)
    assert len(calls) >= 2 and max(calls) > 1  # several batches, one of several tensors
    assert sum(calls) == len(model) - (fmt == ".pt")  # each tensor read once; a tie once into a .pt
    if fmt == ".pt":
        got = torch.load(out, weights_only=True)
        assert got["a_tied"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
    else:
        from safetensors.torch import load_file

        got = load_file(out)
    assert sorted(got) == sorted(model)
    assert all(torch.equal(got[k], model[k]) and got[k].dtype == model[k].dtype for k in model)
