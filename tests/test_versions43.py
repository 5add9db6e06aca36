"""Each module's format version recorded in the manifest (session 43).

A module's ``_version`` says in which format its ``state_dict()`` holds its values; torch.save
keeps it in the dict's ``_metadata`` and ``_load_from_state_dict`` upgrades older formats. Before,
a load handed the module its *current* versions (session 42), so a module whose version grew
between save and load (a torch upgrade, a fix in the user's code) took the old values as its new
format: here a buffer stored inverted in version 2 came back un-inverted. Now the manifest records
the versions ("versions" beside the entry's skeleton) and the load, ``export`` and ``convert`` to a
``.pt`` file hand them on. A checkpoint without them loads as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import trainguard as tg
from trainguard.cli import main as cli_main
from trainguard.manifest import checksum


class Inverted(torch.nn.Module):
    """Version 2 stores ``1 / scale``; an older state dict holds ``scale`` itself."""

    _version = 1

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor([4.0]))

    def _load_from_state_dict(self, sd: dict[str, Any], prefix: str, md: dict[str, Any], *args: Any) -> None:
        version = md.get("version")
        if (version is None or version < 2) and prefix + "scale" in sd:
            sd[prefix + "scale"] = 1 / sd[prefix + "scale"]
        super()._load_from_state_dict(sd, prefix, md, *args)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), Inverted(), torch.nn.BatchNorm1d(2))


def _saved_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrap: bool = False) -> Path:
    """A checkpoint written by the code at version 1; the code is at version 2 afterwards."""
    monkeypatch.setattr(Inverted, "_version", 1)
    m = _model()
    if wrap:  # activation checkpointing around the layer: its names carry _checkpoint_wrapped_module
        m[1] = checkpoint_wrapper(m[1])
    tg.save(tmp_path / "ckpt", {"model": m})
    monkeypatch.setattr(Inverted, "_version", 2)
    return tmp_path / "ckpt"


def _versions(ckpt: Path) -> Any:
    return json.loads((ckpt / "manifest.json").read_bytes())["manifest"]["objects"]["model"].get("versions")


@pytest.mark.parametrize("wrap", [False, True])
def test_a_version_grown_since_the_save_upgrades_the_saved_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrap: bool) -> None:
    ckpt = _saved_v1(tmp_path, monkeypatch, wrap)
    assert _versions(ckpt) == {"2": 2}  # BatchNorm's 2; the Linear, the Sequential and Inverted at 1 are not listed
    m = _model()
    m[1].scale.fill_(7.0)
    tg.load(ckpt, {"model": m})
    assert m[1].scale.item() == 0.25  # upgraded: the version-1 value 4.0 stored as 1/4


def test_same_versions_load_the_values_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Inverted, "_version", 2)
    src = _model()
    src[1].scale.fill_(0.125)
    tg.save(tmp_path / "ckpt", {"model": src})
    assert _versions(tmp_path / "ckpt") == {"1": 2, "2": 2}
    m = _model()
    tg.load(tmp_path / "ckpt", {"model": m})
    assert m[1].scale.item() == 0.125


def test_manager_restore_upgrades_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Inverted, "_version", 1)
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        mgr.save(3, {"model": _model()}, force=True)
    monkeypatch.setattr(Inverted, "_version", 2)
    m = _model()
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        assert mgr.restore({"model": m}) == 3
    assert m[1].scale.item() == 0.25


def test_a_checkpoint_without_versions_loads_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _saved_v1(tmp_path, monkeypatch)
    body = json.loads((ckpt / "manifest.json").read_bytes())["manifest"]
    del body["objects"]["model"]["versions"]  # as written before session 43
    raw = json.dumps(body, separators=(",", ":")).encode()
    (ckpt / "manifest.json").write_bytes(b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n")
    m = _model()
    tg.load(ckpt, {"model": m})
    assert m[1].scale.item() == 4.0  # the module's own version (2) taken for the saved one: not upgraded


@pytest.mark.parametrize("how", ["export", "convert"])
def test_pt_files_carry_the_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    ckpt = _saved_v1(tmp_path, monkeypatch)
    out = tmp_path / "model.pt"
    args = ["export", str(ckpt), "--to", str(out)] if how == "export" else ["convert", str(ckpt), str(out), "--entry", "model"]
    with pytest.raises(SystemExit) as done:
        cli_main(args)
    assert done.value.code == 0
    sd = torch.load(out, weights_only=True)
    assert sd._metadata == {"": {"version": 1}, "0": {"version": 1}, "1": {"version": 1}, "2": {"version": 2}}
    m = _model()
    m.load_state_dict(sd)
    assert m[1].scale.item() == 0.25


def test_a_submodule_added_since_the_save_keeps_its_own_version(tmp_path: Path) -> None:
    """strict=False, an observer the checkpoint does not hold: no saved values to upgrade. Given
    version 1 (not in the recorded versions), its _load_from_state_dict took the absent values for
    a pre-version-3 state and reset its eps to float32's."""
    from torch.ao.quantization.observer import MinMaxObserver

    torch.manual_seed(0)
    tg.save(tmp_path / "ckpt", {"model": torch.nn.Sequential(torch.nn.Linear(2, 2))})
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), MinMaxObserver(eps=1e-3))
    tg.load(tmp_path / "ckpt", {"model": m}, strict=False)  # the observer's tensors are missing: kept
    assert m[1].eps.item() == pytest.approx(1e-3)
