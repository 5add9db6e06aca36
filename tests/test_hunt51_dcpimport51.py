"""Peak memory of ``trainguard convert`` between DCP (``torch.distributed.checkpoint``) and trainguard
(session 51). The import read the whole state with ``dcp.load`` and then saved it with ``tg.save``
(1.5 GB of float32: peak RSS 1.85 GB; one 1 GiB tensor: 2.32 GB), and ``convert --to dcp`` read every
entry whole for ``dcp.save`` (1.78 GB). Now the import reads the ``.distcp`` files in batches (a
tensor larger than a batch in pieces) into a checkpoint written by consolidate's writer, and the
export hands DCP a planner that reads each tensor when DCP writes it. What must hold: the
conversion's peak RSS above the process's own before it reads data stays well under the state, the
output equals the source bit for bit, and a conversion that fails leaves nothing that looks valid."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.convert import convert

from conftest import run_py  # tests/ is on sys.path under pytest

MiB = 1 << 20
GROUP = 24 * MiB  # the child's batch (consolidate.GROUP; dcp_lazy.GROUP is half of it), well under the state

# The child: VmRSS once everything is imported (before any data is read), the conversion, then VmHWM.
CHILD = """
import json, sys, warnings
import torch, torch.distributed.checkpoint, torch.distributed.checkpoint.format_utils
import trainguard, trainguard.convert, trainguard.consolidate as cons
warnings.simplefilter("ignore")
cons.GROUP = int(sys.argv[1])
try:
    import trainguard.dcp_lazy as lazy, trainguard.dcp_stream
    lazy.GROUP = cons.GROUP // 2
except ImportError:  # before session 51
    pass
def status(key):
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(key)).split()[1]) * 1024
base = status("VmRSS:")
src, dst, to = sys.argv[2:5]
trainguard.convert.convert(src, dst, dst_format=to or None, entry=None if to else "model")
print(json.dumps({"base": base, "peak": status("VmHWM:")}))
"""


def _extra(src: Path, dst: Path, to: str = "") -> int:
    r = run_py(["-c", CHILD, str(GROUP), str(src), str(dst), to], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return got["peak"] - got["base"]


def _state() -> dict:
    """~300 MB: 18 tensors of 15 MiB, one of 40 MiB (larger than a batch: read in pieces), a
    bfloat16, a 0-d and an empty tensor, and non-tensor values (an optimizer-like dict)."""
    g = torch.Generator().manual_seed(0)
    model = {f"l{i}.weight": torch.randn(1024, 3840, generator=g) for i in range(18)}
    model["big"] = torch.randn(10 * MiB, generator=g)
    model["half"] = torch.randn(33, 77, generator=g).bfloat16()
    model["scalar"] = torch.tensor(2.5)
    model["empty"] = torch.empty(0, 5)
    optim = {"state": {"l0.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, 3, generator=g)}},
             "param_groups": [{"lr": 0.1, "betas": [0.9, 0.95], "params": ["l0.weight"]}]}
    return {"model": model, "optim": optim}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory):
    import torch.distributed.checkpoint as dcp

    d = tmp_path_factory.mktemp("dcpimport51")
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d / "dcp"), no_dist=True)
    tg.save(d / "ck" / "step-000000004", state)
    return d, state


def test_import_from_dcp_streams_and_equals_the_source(sources, tmp_path: Path) -> None:
    d, state = sources
    size = sum(t.nbytes for t in state["model"].values())
    dst = tmp_path / "imported" / "step-000000000"
    extra = _extra(d / "dcp", dst)
    assert extra < size / 3, f"the import took {extra / MiB:.0f} MiB above its start for a {size / MiB:.0f} MiB state"
    out: dict = {"model": None, "optim": None}
    tg.load(dst, out)
    assert sorted(out["model"]) == sorted(state["model"])
    for k, t in state["model"].items():
        assert _same(out["model"][k], t), k
    assert out["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert _same(out["optim"]["state"]["l0.weight"]["exp_avg"], state["optim"]["state"]["l0.weight"]["exp_avg"])


def test_export_to_dcp_streams_and_loads_bit_for_bit(sources, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    d, state = sources
    size = sum(t.nbytes for t in state["model"].values())
    out = tmp_path / "out_dcp"
    extra = _extra(d / "ck" / "step-000000004", out, "dcp")
    assert extra < size / 3, f"the export took {extra / MiB:.0f} MiB above its start for a {size / MiB:.0f} MiB state"
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert sorted(whole["model"]) == sorted(state["model"])
    for k, t in state["model"].items():
        assert _same(whole["model"][k], t), k
    assert whole["optim"]["param_groups"][0]["lr"] == 0.1
    del whole
    back = {"model": {k: torch.zeros_like(t) for k, t in state["model"].items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, storage_reader=dcp.FileSystemReader(out), no_dist=True)
    for k, t in state["model"].items():
        assert _same(back["model"][k], t), k


def test_a_failing_import_leaves_no_checkpoint(sources, tmp_path: Path) -> None:
    """A ``.distcp`` file cut short: the import fails with a CheckpointError, and the destination's
    parent holds nothing (no manifest, no temporary directory), where a batch was written already."""
    import shutil

    d, _state = sources
    src = tmp_path / "cut"
    shutil.copytree(d / "dcp", src)
    files = sorted(p for p in src.iterdir() if p.suffix == ".distcp")
    for p in files:
        os.truncate(p, p.stat().st_size // 2)
    dst = tmp_path / "imported" / "step-000000000"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tg.CheckpointError, match="cannot read"):
            convert(src, dst)
    assert not dst.exists()
    assert not (tmp_path / "imported").exists() or list((tmp_path / "imported").iterdir()) == []


def test_a_failing_export_leaves_no_dcp_directory(sources, tmp_path: Path) -> None:
    """A tensor's bytes damaged in the source: the streamed export fails (the checksum) after
    it wrote files, and no DCP directory (nor a temporary one) is left."""
    import shutil

    d, _state = sources
    src = tmp_path / "ck" / "step-000000004"
    shutil.copytree(d / "ck" / "step-000000004", src)
    data = sorted(p for p in src.iterdir() if p.name.startswith("data-"))[-1]
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size - 4096)
        f.write(b"\xff" * 64)
    out = tmp_path / "out_dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tg.CheckpointError):
            convert(src, out, dst_format="dcp", entry=None)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


class _XorOut(io.RawIOBase):
    def __init__(self, out: Any) -> None:
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.out.write(bytes(x ^ 0x5A for x in bytes(b)))
        return len(b)


class _XorIn(io.RawIOBase):
    def __init__(self, src: Any) -> None:
        self.src = src

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        got = self.src.read(len(b))
        b[: len(got)] = bytes(x ^ 0x5A for x in got)
        return len(got)


def _xor_extension() -> type:
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Xor(StreamTransformExtension):
        """A stream transform (DCP's _extensions) whose bytes are no torch.save zip, as zstd's are not."""

        @staticmethod
        def registry_name() -> str:
            return "stream.tg_xor"

        @staticmethod
        def from_descriptor(version: str) -> Xor:
            return Xor()

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: Any) -> Any:
            return _XorOut(output)

        def transform_from(self, input: Any) -> Any:
            return io.BufferedReader(_XorIn(input))

    return Xor


def test_a_dcp_written_through_stream_transforms_is_read_whole_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Items written through a stream transform (zstd compression, or here a byte XOR registered as DCP's
    extensions are) are no torch.save bytes to stream: that checkpoint is read by dcp.load, as every DCP import
    was before session 51 (the streamed import refused it at first: a checkpoint that converted before did not)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _extension

    xor = _xor_extension()
    registry_init = _extension.ExtensionRegistry.__init__

    def with_xor(self: Any) -> None:
        registry_init(self)
        self.register(xor)

    monkeypatch.setattr(_extension.ExtensionRegistry, "__init__", with_xor)
    w = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": w, "b": torch.ones(3)}},
                 storage_writer=dcp.FileSystemWriter(tmp_path / "dcp", _extensions=[xor()]), no_dist=True)
        meta = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
        assert any(info.transform_descriptors for info in meta.storage_data.values())
        convert(tmp_path / "dcp", tmp_path / "imported")
    got = tg.load(tmp_path / "imported", {"model": {"w": torch.zeros(4, 6), "b": torch.zeros(3)}})
    assert got.step == 0
    sd = {"model": {"w": torch.zeros(4, 6), "b": torch.zeros(3)}}
    tg.load(tmp_path / "imported", sd)
    assert torch.equal(sd["model"]["w"], w) and torch.equal(sd["model"]["b"], torch.ones(3))


def _shard1_save(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": torch.arange(37 * 50, dtype=torch.float32).reshape(37, 50), "v": torch.arange(7 * 6 * 5.0).reshape(7, 6, 5)}
    dcp.save({"model": {k: distribute_tensor(t, mesh, [Shard(1)]) for k, t in sd.items()}}, checkpoint_id=path)


def test_column_sharded_dcp_imports_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks split along dim 1 (two ranks' ``Shard(1)``), read in batches of 1 KiB: each piece of a
    tensor takes a strided part of each chunk."""
    from trainguard import consolidate

    from dist_helper import run_ranks

    run_ranks(_shard1_save, 2, str(tmp_path / "dcp"), timeout=90)
    monkeypatch.setattr(consolidate, "GROUP", 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "dcp", tmp_path / "ck")
    out: dict = {"model": None}
    tg.load(tmp_path / "ck", out)
    assert torch.equal(out["model"]["w"], torch.arange(37 * 50, dtype=torch.float32).reshape(37, 50))
    assert torch.equal(out["model"]["v"], torch.arange(7 * 6 * 5.0).reshape(7, 6, 5))
