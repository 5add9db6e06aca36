"""``trainguard convert``: round trips with torch.save files, safetensors files and DCP
directories (one written by 2 ranks, sharded)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import trainguard as tg
from trainguard.cli import main as cli
from trainguard.errors import CheckpointError

from dist_helper import run_ranks


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _run(*args: str):
    res = CliRunner().invoke(cli, ["convert", *args])
    assert res.exit_code == 0, res.output
    return res


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file

    src = _model(1)
    tg.save(tmp_path / "ck", {"model": src, "progress": tg.StateDict(step=3)})
    _run(str(tmp_path / "ck"), str(tmp_path / "m.safetensors"))
    flat = load_file(str(tmp_path / "m.safetensors"))
    assert set(flat) == set(src.state_dict()) and all(torch.equal(flat[k], v) for k, v in src.state_dict().items())
    _run(str(tmp_path / "m.safetensors"), str(tmp_path / "back"))
    dest = _model(2)
    assert not _equal(dest, src)
    tg.load(tmp_path / "back", {"model": dest})
    assert _equal(dest, src)


def test_torch_save_round_trip_weights_only(tmp_path):
    src = _model(1)
    torch.save({"model": src.state_dict(), "progress": {"step": 7, "lr": 0.5}}, tmp_path / "in.pt")
    res = _run(str(tmp_path / "in.pt"), str(tmp_path / "ck"))
    assert "torch" in res.output
    dest, prog = _model(2), {}
    state = {"model": dest, "progress": prog}
    tg.load(tmp_path / "ck", state)
    assert _equal(dest, src) and state["progress"] == {"step": 7, "lr": 0.5}
    _run(str(tmp_path / "ck"), str(tmp_path / "out.pt"))
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in src.state_dict().items())


def test_torch_file_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"model": _model(1).state_dict(), "obj": nn.ReLU()}, tmp_path / "bad.pt")
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "bad.pt"), str(tmp_path / "ck")])
    assert res.exit_code == 2 and "weights_only=True" in res.output
    with pytest.raises(CheckpointError, match="one side must be a trainguard"):
        from trainguard.convert import convert

        convert(tmp_path / "bad.pt", tmp_path / "x.safetensors")


def test_dcp_round_trip_every_entry(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = _model(1)
    extra = torch.arange(10.0)
    tg.save(tmp_path / "ck", {"model": src, "table": {"rows": extra}})
    _run(str(tmp_path / "ck"), str(tmp_path / "dcp"), "--to", "dcp", "--entry", "*")
    fresh = {"model": {k: torch.zeros_like(v) for k, v in src.state_dict().items()}, "table": {"rows": torch.zeros(10)}}
    dcp.load(fresh, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(fresh["model"][k], v) for k, v in src.state_dict().items())
    assert torch.equal(fresh["table"]["rows"], extra)
    res = _run(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert "pickle" in res.output  # the trusted-source warning
    dest, table = _model(2), {}
    state = {"model": dest, "table": table}
    tg.load(tmp_path / "back", state)
    assert _equal(dest, src) and torch.equal(state["table"]["rows"], extra)


def _dcp_sharded_save(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = _model(5)
    sd = {k: distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    dcp.save({"model": sd, "extra": {"note": "pickled object"}}, checkpoint_id=path)


def test_sharded_dcp_written_by_two_ranks_imports(tmp_path):
    path = str(tmp_path / "dcp2")
    run_ranks(_dcp_sharded_save, 2, path, timeout=90)
    assert len(list((tmp_path / "dcp2").glob("*.distcp"))) == 2  # one file per rank
    from trainguard.convert import convert

    with pytest.warns(UserWarning, match="pickle"):
        res = convert(path, tmp_path / "ck")
    assert res["skipped"] == []  # a JSON value (a str) is imported, read with weights_only=True
    extra: dict = {"extra": None}
    tg.load(tmp_path / "ck", extra, only=["extra"])
    assert extra["extra"] == {"note": "pickled object"}
    dest = _model(6)
    assert not _equal(dest, _model(5))
    tg.load(tmp_path / "ck", {"model": dest}, only=["model"])
    assert _equal(dest, _model(5))


def test_interop_doc_examples_run(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs/interop.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/interop.md", "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "model.safetensors").exists()
    # The documented commands: an export then an import with the CLI.
    _run("ckpts/interop/step-000000001", "out_dcp", "--to", "dcp", "--entry", "*")
    _run("out_dcp", "ckpts/imported2/step-000000000")
    assert (tmp_path / "ckpts/imported2/step-000000000/manifest.json").exists()
