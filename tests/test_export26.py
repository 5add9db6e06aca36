"""``export`` reads in batches (session 26): ``export.iter_tensors`` (``.pt``, ``convert``) reads a
batch's tensors in one parallel ``read_targets`` call, then yields them in order (tensor by tensor
the reads of a 3 GB model took 2.9-4.8 s here, batched 1.6-2.8 s); a ``.safetensors`` export is
streamed (``stwrite``: header from the manifest, one batch in memory). The exported files must
hold every tensor bit for bit whatever the batches, a tie must stay one tensor in a ``.pt`` file,
also when its alias comes before its target and the two fall into different batches, and the
streamed file must read back with safetensors as its own ``save_file``'s does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from test_read_pieces import _flip  # tests/ is on sys.path under pytest
from trainguard import consolidate as cons
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
    monkeypatch.setattr(cons, "GROUP", 1 << 20)  # .safetensors: streamed by stwrite, batched as consolidate
    calls: list[int] = []
    real = exp.read_targets

    def counting(storage, directory, targets, **kw):
        targets = list(targets)
        calls.append(len(targets))
        return real(storage, directory, targets, **kw)

    monkeypatch.setattr(exp, "read_targets", counting)
    monkeypatch.setattr(cons, "read_targets", counting)  # .safetensors: consolidate.whole_batches reads
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


def test_streamed_safetensors_reads_back_as_save_files_own(tmp_path: Path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(cons, "GROUP", 1 << 20)
    torch.manual_seed(1)
    model = {  # every dtype with a safetensors name, odd sizes: offsets of every alignment
        "f64": torch.randn(3, 5, dtype=torch.float64), "f32": torch.randn(250_001), "f16": torch.randn(7).half(),
        "bf16": torch.randn(300_003).to(torch.bfloat16), "i64": torch.arange(9), "i32": torch.arange(11, dtype=torch.int32),
        "i16": torch.arange(13, dtype=torch.int16), "i8": torch.arange(-5, 6, dtype=torch.int8),
        "u8": torch.arange(17, dtype=torch.uint8), "bool": torch.rand(19) > 0.5,
        "f8": torch.randn(23).to(torch.float8_e4m3fn), "f8b": torch.randn(29).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
    }
    tg.save(tmp_path / "ckpt", {"model": tg.StateDict(**model)})
    used = []
    monkeypatch.setattr(exp, "iter_tensors", lambda *a, **k: used.append(a) or iter(()))  # the dict path: unused
    assert exp.export(tmp_path / "ckpt", tmp_path / "s.safetensors") == len(model)
    assert not used
    save_file(model, tmp_path / "ref.safetensors", metadata={"format": "pt", "source": "trainguard", "step": "0"})
    got, ref = load_file(tmp_path / "s.safetensors"), load_file(tmp_path / "ref.safetensors")
    assert sorted(got) == sorted(ref) == sorted(model)
    for k in model:
        assert got[k].dtype == model[k].dtype and got[k].shape == model[k].shape
        assert torch.equal(_raw(got[k]), _raw(ref[k])) and torch.equal(_raw(got[k]), _raw(model[k]))
    with safe_open(tmp_path / "s.safetensors", "pt") as f, safe_open(tmp_path / "ref.safetensors", "pt") as g:
        assert f.metadata() == g.metadata()


def test_a_dtype_safetensors_streaming_has_no_name_for_goes_through_save_file(tmp_path: Path):
    from safetensors.torch import load_file

    model = {"c": torch.randn(4, 3, dtype=torch.complex64), "w": torch.randn(10)}
    tg.save(tmp_path / "ckpt", {"model": tg.StateDict(**model)})
    assert exp.export(tmp_path / "ckpt", tmp_path / "c.safetensors") == 2
    got = load_file(tmp_path / "c.safetensors")
    assert all(torch.equal(got[k], model[k]) for k in model)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes (float8 has no torch.equal; NaNs compare by bits)."""
    return t.reshape(-1).view(torch.uint8)


def test_a_corrupt_byte_fails_the_streamed_export_and_leaves_no_file(tmp_path: Path):
    from trainguard.errors import CorruptCheckpointError

    model = _model()
    tg.save(tmp_path / "ckpt", {"model": tg.StateDict(**model)})
    _flip(tmp_path / "ckpt", "model/b", 100)
    with pytest.raises(CorruptCheckpointError, match="model/b"):
        exp.export(tmp_path / "ckpt", tmp_path / "w.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no file, no temporary left
