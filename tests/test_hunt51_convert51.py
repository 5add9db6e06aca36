"""Peak memory of the offline tools (session 51). ``trainguard convert`` to ``.safetensors`` read the
entry whole and wrote it with ``save_file`` (a 1.5 GB entry of 100 tensors: peak RSS 1.73 GB, the
process holds 0.23 GB before it reads anything); ``consolidate`` and ``export`` read a tensor larger
than their 256 MiB batch whole (a 1 GiB tensor: 1.28 GB). Now convert streams as export does, and a
tensor larger than a batch is read and written in pieces of whole checksum blocks. What must hold:
the conversion's peak RSS above the process's own before it reads data stays under a bound well
below the state, and the output equals the source bit for bit (and verifies, for consolidate)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard import consolidate as cons
from trainguard.inspect import describe

from conftest import run_py  # tests/ is on sys.path under pytest
from dist_helper import run_ranks

MiB = 1 << 20

# The child: VmRSS once everything is imported (before any data is read), then the command, then VmHWM.
CHILD = """
import json, sys
import safetensors.torch, torch
import trainguard, trainguard.convert, trainguard.export, trainguard.consolidate as cons, trainguard.io as io
cons.GROUP = int(sys.argv[1])
def status(key):
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(key)).split()[1]) * 1024
base = status("VmRSS:")
what, src, dst = sys.argv[2:5]
if what == "convert":
    trainguard.convert.convert(src, dst)
elif what == "export":
    trainguard.export.export(src, dst)
else:
    cons.consolidate(src, dst)
print(json.dumps({"base": base, "peak": status("VmHWM:")}))
"""


def _extra(what: str, src: Path, dst: Path, group: int) -> int:
    """Peak RSS of ``what`` (convert/export/consolidate) in a child, above its RSS before reading data."""
    r = run_py(["-c", CHILD, str(group), what, str(src), str(dst)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return got["peak"] - got["base"]


def test_convert_to_safetensors_streams_the_entry(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(2048, 1024, generator=g) for i in range(48)}  # 48 x 8 MiB = 384 MiB
    sd["layers.0.bias"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    tg.save(tmp_path / "src", {"model": sd})
    extra = _extra("convert", tmp_path / "src", tmp_path / "out.safetensors", 32 * MiB)
    # Before: the whole entry (384 MiB and more) was in memory; now one 32 MiB batch, plus the
    # reader's and writer's own buffers.
    assert extra < 160 * MiB, f"convert to safetensors took {extra / MiB:.0f} MiB above the process's own"
    got = load_file(tmp_path / "out.safetensors")
    assert sorted(got) == sorted(sd)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in sd.items())
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "source": "trainguard", "step": "0"}
    del got
    (tmp_path / "out.safetensors").unlink()
    # To a torch.save file: the same bound (before: the entry, then torch.save's copy of each storage).
    extra = _extra("convert", tmp_path / "src", tmp_path / "out.pt", 32 * MiB)
    assert extra < 160 * MiB, f"convert to .pt took {extra / MiB:.0f} MiB above the process's own"
    with zipfile.ZipFile(tmp_path / "out.pt") as z:
        assert z.testzip() is None  # every record's CRC-32 is right, the streamed storages' too
    got = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    assert sorted(got) == sorted(sd)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in sd.items())


class Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n, self.t = 0, torch.zeros(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def get_extra_state(self) -> dict:
        return {"n": self.n, "t": self.t}

    def set_extra_state(self, state: dict) -> None:
        self.n, self.t = state["n"], state["t"]


def test_a_streamed_pt_file_is_what_torch_save_wrote(tmp_path: Path) -> None:
    """Ties (stored once), a module's extra state and versions, an optimizer entry, odd dtypes and a
    tensor larger than a batch (in pieces): ``torch.load`` gives what the entry was, the file is a
    valid zip, and export and convert write the same tensors."""
    from trainguard.convert import convert
    from trainguard.export import export

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 300, bias=False), Extra())
    model[1].weight = model[0].weight  # tied
    model[2].n, model[2].t = 7, torch.randn(3)
    model.register_buffer("big", torch.randn(700_001).to(torch.float64))  # 5.6 MB: pieces of a 1 MiB batch
    model.register_buffer("u8", torch.randint(0, 255, (17,), dtype=torch.uint8))
    model.register_buffer("empty", torch.zeros(0, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    tg.save(tmp_path / "ck", {"model": model, "optim": opt})
    streamed: list[bool] = []
    with pytest.MonkeyPatch.context() as mp:
        from trainguard import ptwrite

        real = ptwrite.write
        mp.setattr(ptwrite, "write", lambda *a: streamed.append(real(*a)) or streamed[-1])
        mp.setattr(cons, "GROUP", 1 * MiB)
        mp.setattr(cons, "DEFAULT_BLOCK", 256 << 10)
        export(tmp_path / "ck", tmp_path / "m.pt")
        convert(tmp_path / "ck", tmp_path / "c.pt")
        export(tmp_path / "ck", tmp_path / "o.pt", entry="optim")
    assert streamed == [True, True, True]  # not torch.save of the entry in memory
    for name in ("m.pt", "c.pt"):
        with zipfile.ZipFile(tmp_path / name) as z:
            assert z.testzip() is None
        sd = torch.load(tmp_path / name, weights_only=True)
        assert sd["1.weight"] is sd["0.weight"]  # one storage, as torch.save stores a tie
        fresh = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 300, bias=False), Extra())
        fresh[1].weight = fresh[0].weight
        fresh.register_buffer("big", torch.zeros(700_001, dtype=torch.float64))
        fresh.register_buffer("u8", torch.zeros(17, dtype=torch.uint8))
        fresh.register_buffer("empty", torch.ones(0, 4))
        fresh.load_state_dict(sd)  # strict: extra state and versions as saved
        want = model.state_dict()
        got = fresh.state_dict()
        assert fresh[2].n == 7 and torch.equal(fresh[2].t, model[2].t)
        assert all(torch.equal(got[k], want[k]) for k in want if k != "2._extra_state")
    osd = torch.load(tmp_path / "o.pt", weights_only=True)
    assert osd["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    exp = {k: v for k, v in opt.state_dict()["state"][0].items()}
    assert all(torch.equal(osd["state"]["0.weight"][k], v) for k, v in exp.items())


def test_a_pt_export_that_fails_while_streaming_leaves_the_earlier_file(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    from trainguard.export import export

    tg.save(tmp_path / "ck", {"model": {"w": torch.randn(1000, 100)}})
    export(tmp_path / "ck", tmp_path / "w.pt")
    before = (tmp_path / "w.pt").read_bytes()
    tg.save(tmp_path / "ck2", {"model": {"w": torch.randn(1000, 100)}})

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(tg.CheckpointError, match="cannot write .*w.pt: OSError: .*No space left"):
        export(tmp_path / "ck2", tmp_path / "w.pt")
    monkeypatch.undo()
    assert (tmp_path / "w.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck2", "w.pt"]  # no temporary file left


def test_a_tensor_larger_than_a_batch_is_written_in_pieces(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    big = torch.randn(8191, 8193, generator=g)  # 268 MB, rows not a multiple of a block or a page
    small = torch.randn(5, 3, generator=g).to(torch.float64)
    tg.save(tmp_path / "src", {"model": {"big": big, "small": small}})
    extra = _extra("consolidate", tmp_path / "src", tmp_path / "full", 16 * MiB)
    assert extra < 128 * MiB, f"consolidate took {extra / MiB:.0f} MiB above the process's own (the tensor: 256 MiB)"
    assert tg.verify(tmp_path / "full").ok  # a piece's block checksums, concatenated, are the tensor's
    out = {"model": {"big": torch.zeros_like(big), "small": torch.zeros_like(small)}}
    tg.load(tmp_path / "full", out)
    assert torch.equal(out["model"]["big"], big) and torch.equal(out["model"]["small"], small)
    del out
    extra = _extra("export", tmp_path / "src", tmp_path / "out.safetensors", 16 * MiB)
    assert extra < 128 * MiB, f"export took {extra / MiB:.0f} MiB above the process's own (the tensor: 256 MiB)"
    got = load_file(tmp_path / "out.safetensors")
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)


def _save_sharded(rank: int, world: int, path: str) -> int:
    """Each rank saves its column shard (Shard(1): a shard is not one flat range of the tensor) of
    tensors of odd shapes."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_helper import cpu_mesh

    mesh = cpu_mesh()
    state = {k: distribute_tensor(v, mesh, [Shard(1)]) for k, v in _sharded_state().items()}
    tg.save(path, {"model": state})
    return 0


def _sharded_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"a": torch.randn(301, 7, 1001, generator=g), "b": torch.randn(999, 1025, generator=g).to(torch.bfloat16),
            "c": torch.randn(3, 5, generator=g)}


def test_pieces_of_a_sharded_tensor_consolidate_bit_for_bit(tmp_path: Path, monkeypatch) -> None:
    res = run_ranks(_save_sharded, 2, str(tmp_path / "src"), timeout=120)
    assert all(r.ok for r in res), res
    monkeypatch.setattr(cons, "GROUP", 1 * MiB)
    monkeypatch.setattr(cons, "DEFAULT_BLOCK", 256 << 10)  # pieces of 1 MiB: many, across both ranks' chunks
    assert len(cons._pieces([e.nbytes for e in describe(tmp_path / "src").tensors.values()])) > 10
    cons.consolidate(tmp_path / "src", tmp_path / "full")
    assert tg.verify(tmp_path / "full").ok
    want = _sharded_state()
    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    tg.load(tmp_path / "full", out)
    assert all(torch.equal(out["model"][k], v) for k, v in want.items())
