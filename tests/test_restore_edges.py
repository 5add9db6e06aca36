"""Restore and load edge cases: when ``CheckpointManager.restore`` falls back (bad bytes) and
when it raises (a state that does not fit, no usable checkpoint, entries half-read from a
skipped one, on every rank alike); ``load(strict=False)`` dtype casts and shape warnings;
read-only Mapping states; ``only=`` validation; a malformed RNG state; consolidate, convert
and export of one-tensor entries."""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.commit import read_manifest
from trainguard.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from trainguard.index import ChunkSource
from trainguard.manifest import checksum
from trainguard.storage import for_path

from dist_helper import run_ranks


def _step(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def _flip(step_dir: Path, *, file: str | None = None, tensor: str | None = None) -> None:
    """Flip one byte inside a stored chunk (of ``tensor``, in ``file`` when given)."""
    storage, d = for_path(step_dir)
    m = read_manifest(storage, d)
    src = ChunkSource.of(storage, d, m)  # regular (format 2) tensors list their chunks in index files
    for path, e in m.tensors.items():
        for c in src.all_chunks(path, e):
            if (tensor is None or path == tensor) and (file is None or c.file == file) and c.length:
                with open(step_dir / c.file, "r+b") as f:
                    f.seek(c.offset + c.length // 2)
                    b = f.read(1)
                    f.seek(c.offset + c.length // 2)
                    f.write(bytes([b[0] ^ 0xFF]))
                return
    raise AssertionError(f"no chunk of {tensor!r} in {file!r} under {step_dir}")


def _manager(root: Path, **kw) -> tg.CheckpointManager:
    return tg.CheckpointManager(root, save=tg.EveryNSteps(1), timeout=30, **kw)


def _save_steps(root: Path, make, steps=(1, 2)) -> None:
    with _manager(root) as mgr:
        for s in steps:
            mgr.save(s, make(s))


# ---------------------------------------------------------------- restore: fall back or raise
def test_restore_raises_listing_every_step_when_no_checkpoint_loads(tmp_path):
    def make(v):
        return {"a": torch.full((1000,), float(v)), "prog": tg.StateDict(step=v)}

    _save_steps(tmp_path, make)
    for s in (1, 2):
        for f in sorted(os.listdir(_step(tmp_path, s))):
            if f.startswith("data-") and f.endswith(".bin"):
                _flip(_step(tmp_path, s), file=f)
    state = make(0)
    with _manager(tmp_path) as mgr, pytest.raises(CheckpointError) as ei:
        mgr.restore(state)  # before the fix: None, a "fresh start" over a partly overwritten state
    msg = str(ei.value)
    assert "none of the 2 checkpoint(s)" in msg
    lines = [ln for ln in msg.splitlines() if ln.startswith("step ")]
    assert [re.match(r"step \d+", ln)[0] for ln in lines] == ["step 2", "step 1"]
    assert all("checksum" in ln.lower() for ln in lines), msg


class _Net(nn.Module):
    def __init__(self, ema: bool, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((1000,), value))
        if ema:
            self.register_buffer("ema", torch.full((1000,), value))


def test_restore_strict_false_refuses_entry_only_the_skipped_newer_checkpoint_held(tmp_path):
    mixed = tmp_path / "mixed"
    with _manager(mixed) as mgr:
        mgr.save(1, {"w": torch.full((1000,), 1.0)})
        mgr.save(2, {"w": torch.full((1000,), 2.0), "ema": torch.full((1000,), 2.0)})
    _flip(_step(mixed, 2), tensor="w")
    state = {"w": torch.zeros(1000), "ema": torch.zeros(1000)}
    with _manager(mixed) as mgr, pytest.raises(CheckpointError, match=r"\['ema'\]"):
        mgr.restore(state, strict=False)  # before the fix: 1, with ema left at the corrupt step 2's values

    # The same inside one entry: a buffer only the skipped checkpoint's module held.
    inner = tmp_path / "inner"
    with _manager(inner) as mgr:
        mgr.save(1, {"model": _Net(ema=False, value=1.0)})
        mgr.save(2, {"model": _Net(ema=True, value=2.0)})
    _flip(_step(inner, 2), tensor="model/w")
    with _manager(inner) as mgr, pytest.raises(CheckpointError, match=r"model/ema"):
        mgr.restore({"model": _Net(ema=True, value=0.0)}, strict=False)

    # Both checkpoints hold the same entries: the fallback still works.
    same = tmp_path / "same"
    _save_steps(same, lambda v: {"w": torch.full((1000,), float(v)), "ema": torch.full((1000,), v + 0.5)})
    _flip(_step(same, 2), tensor="w")
    state = {"w": torch.zeros(1000), "ema": torch.zeros(1000)}
    with _manager(same) as mgr:
        assert mgr.restore(state, strict=False) == 1
    assert torch.equal(state["w"], torch.full((1000,), 1.0))
    assert torch.equal(state["ema"], torch.full((1000,), 1.5))


def _training_state(n_samples: int, seed: int, groups: bool = False) -> dict:
    torch.manual_seed(seed)
    m = nn.Linear(3, 2)
    params = [{"params": [m.weight]}, {"params": [m.bias], "lr": 0.01}] if groups else m.parameters()
    return {"model": m, "optim": torch.optim.SGD(params, lr=0.1),
            "data": tg.ResumableSampler(n_samples, seed=0), "prog": tg.StateDict(step=seed)}


@pytest.mark.parametrize("misfit", ["sampler_size", "optimizer_groups"])
def test_restore_raises_instead_of_falling_back_when_state_does_not_fit(tmp_path, misfit):
    _save_steps(tmp_path, lambda s: _training_state(100, s))
    state = _training_state(120, 0) if misfit == "sampler_size" else _training_state(100, 0, groups=True)
    with _manager(tmp_path) as mgr, pytest.raises(CheckpointError) as ei:
        mgr.restore(state)  # before the fix: every step "not usable", then None (a fresh start)
    msg = str(ei.value)
    if misfit == "sampler_size":
        assert "ResumableSampler" in msg and "num_samples=100" in msg and "120" in msg
        assert msg.startswith("entry 'data'")  # the sampler's own CheckpointError, with its entry
    else:
        assert "entry 'optim'" in msg and "parameter group" in msg


# ---------------------------------------------------------------- two gloo ranks
def _dist_state(rank: int, world: int, value: float, out_features: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(int(value))
    return {"model": nn.Linear(4, out_features), "t": distribute_tensor(torch.full((4, 8), value), mesh, [Shard(0)]),
            "prog": tg.StateDict(step=int(value))}


def dist_save(rank: int, world: int, root: str) -> str:
    with _manager(Path(root)) as mgr:
        for s in (1, 2):
            mgr.save(s, _dist_state(rank, world, float(s), 3))
    return "ok"


def dist_restore(rank: int, world: int, root: str, rank0_out: int) -> tuple:
    state = _dist_state(rank, world, 0.0, rank0_out if rank == 0 else 3)
    try:
        with _manager(Path(root)) as mgr:
            step = mgr.restore(state)
    except CheckpointError as e:
        return ("raised", type(e).__name__, str(e)[:500])
    torch.manual_seed(step or 0)
    expect = nn.Linear(4, 3)
    return ("restored", step, state["t"].to_local().unique().tolist(), state["prog"]["step"],
            torch.equal(state["model"].weight, expect.weight))


def test_two_ranks_restore_raises_on_both_for_misfit_and_falls_back_together_on_bad_bytes(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(dist_save, 2, root, timeout=90)
    # Rank 0's model has another shape: both ranks raise (before the fix rank 1 returned None).
    res = run_ranks(dist_restore, 2, root, 5, timeout=90)
    kinds = [r.value[0] for r in res]
    assert kinds == ["raised", "raised"], [r.value for r in res]
    assert res[0].value[1] == "StateMismatchError" and "model/weight" in res[0].value[2]
    assert "rank(s) [0]" in res[1].value[2]
    # Bad bytes that only rank 1 reads: every rank falls back to step 1 alike.
    _flip(Path(root) / "step-000000002", file="data-00001.bin", tensor="t")
    res = run_ranks(dist_restore, 2, root, 3, timeout=90)
    assert [r.value for r in res] == [("restored", 1, [1.0], 1, True)] * 2


# ---------------------------------------------------------------- load(strict=False)
def test_load_strict_false_casts_dtype_difference_and_strict_true_still_raises(tmp_path):
    src = nn.Linear(4, 3)
    tg.save(tmp_path / "ck", {"model": src})
    dest = nn.Linear(4, 3).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a dtype-only difference
        tg.load(tmp_path / "ck", {"model": dest}, strict=False)
    assert dest.weight.dtype == torch.bfloat16
    assert torch.equal(dest.weight, src.weight.detach().to(torch.bfloat16))  # before the fix: left as it was
    assert torch.equal(dest.bias, src.bias.detach().to(torch.bfloat16))
    with pytest.raises(StateMismatchError, match="bfloat16"):
        tg.load(tmp_path / "ck", {"model": nn.Linear(4, 3).to(torch.bfloat16)})


def test_load_strict_false_warns_about_shape_difference_and_keeps_tensor(tmp_path):
    tg.save(tmp_path / "ck", {"model": nn.Linear(4, 3)})
    dest = nn.Linear(4, 5)
    before = {k: v.clone() for k, v in dest.state_dict().items()}
    with pytest.warns(UserWarning, match=r"model/weight.*model/bias|model/bias.*model/weight"):
        tg.load(tmp_path / "ck", {"model": dest}, strict=False)  # before the fix: silent
    assert all(torch.equal(v, before[k]) for k, v in dest.state_dict().items())


# ---------------------------------------------------------------- read-only Mapping state
class _ReadOnly(Mapping):
    def __init__(self, d: dict) -> None:
        self._d = d

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


@pytest.mark.parametrize("replaced", ["json_value", "reshaped_tensor"])
def test_read_only_mapping_state_loads_in_place_and_refuses_entry_that_must_be_replaced(tmp_path, replaced):
    src = nn.Linear(4, 3)
    tg.save(tmp_path / "ck", {"model": src, "w": torch.arange(6.0), "n": 5})
    ok = _ReadOnly({"model": nn.Linear(4, 3), "w": torch.zeros(6), "n": 5})
    tg.load(tmp_path / "ck", ok)  # tensors read in place, an equal JSON value: nothing to replace
    assert torch.equal(ok["w"], torch.arange(6.0)) and torch.equal(ok["model"].weight, src.weight)
    bad = {"model": nn.Linear(4, 3), "w": torch.zeros(6), "n": 5}
    key = "n" if replaced == "json_value" else "w"
    bad[key] = 0 if replaced == "json_value" else torch.zeros(3)
    with pytest.raises(CheckpointError, match=rf"entry '{key}'.*pass a dict"):
        tg.load(tmp_path / "ck", _ReadOnly(bad))  # before the fix: silently dropped


# ---------------------------------------------------------------- only=
def test_load_only_as_a_string_raises_type_error(tmp_path):
    tg.save(tmp_path / "ck", {"model": nn.Linear(2, 2)})
    with pytest.raises(TypeError, match=r"only=\['model'\]"):
        tg.load(tmp_path / "ck", {"model": nn.Linear(2, 2)}, only="model")


def test_load_only_naming_entry_not_in_state_says_so(tmp_path):
    tg.save(tmp_path / "ck", {"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointError) as ei:
        tg.load(tmp_path / "ck", {"model": nn.Linear(2, 2)}, only=["nope"])
    assert "nope" in str(ei.value) and "not in the state" in str(ei.value)
    assert "missing from the checkpoint" not in str(ei.value)


# ---------------------------------------------------------------- malformed RNG state
def test_tampered_rng_state_is_corrupt_checkpoint_and_restore_falls_back(tmp_path):
    _save_steps(tmp_path, lambda s: {"rng": tg.RNGState(), "prog": tg.StateDict(step=s)})
    p = _step(tmp_path, 2) / "manifest.json"
    raw = p.read_bytes()
    start = raw.index(b'"manifest":') + len(b'"manifest":')
    assert raw.endswith(b"}\n")
    body = json.loads(raw[start:-2])
    body["objects"]["rng"]["ranks"][0]["numpy"]["keys"] = 5  # a JSON int where a tensor was
    b = json.dumps(body, separators=(",", ":")).encode()
    p.write_bytes(b'{"checksum":"' + checksum(b).encode() + b'","manifest":' + b + b"}\n")

    with pytest.raises(CorruptCheckpointError, match="RNG"):  # before the fix: AttributeError
        tg.load(_step(tmp_path, 2), {"rng": tg.RNGState(), "prog": tg.StateDict(step=0)})
    state = {"rng": tg.RNGState(), "prog": tg.StateDict(step=0)}
    with _manager(tmp_path) as mgr:
        assert mgr.restore(state) == 1
    assert state["prog"]["step"] == 1


# ---------------------------------------------------------------- consolidate, convert, export
def test_consolidate_records_source_path_in_metadata(tmp_path):
    from trainguard.consolidate import consolidate

    src = tmp_path / "run" / "step-000000001"
    tg.save(src, {"model": nn.Linear(4, 3)})
    out = consolidate(src, tmp_path / "full" / "step-000000001")
    assert out.metadata["consolidated_from"]["path"] == str(src)  # before the fix: a ChunkSource repr
    on_disk = read_manifest(*for_path(tmp_path / "full" / "step-000000001"))
    assert on_disk.metadata["consolidated_from"]["path"] == str(src)


def test_convert_torch_file_with_transposed_tensor_round_trips(tmp_path):
    from trainguard.convert import convert

    w = torch.arange(12.0).reshape(3, 4).t()
    assert not w.is_contiguous()
    torch.save({"w": w, "b": torch.ones(3)}, tmp_path / "w.pt")
    res = convert(tmp_path / "w.pt", tmp_path / "ck")  # before the fix: UnsupportedValueError
    assert res["tensors"] == 2
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
    tg.load(tmp_path / "ck", state)
    assert torch.equal(state["model"]["w"], w) and torch.equal(state["model"]["b"], torch.ones(3))


def test_export_of_single_tensor_entry_writes_that_tensor(tmp_path):
    from safetensors.torch import load_file

    from trainguard.export import export

    tg.save(tmp_path / "ck", {"w": torch.arange(5.0), "model": nn.Linear(2, 2)})
    out = tmp_path / "w.safetensors"
    assert export(tmp_path / "ck", out, entry="w") == 1  # before the fix: "holds no tensors to export"
    got = load_file(str(out))
    assert list(got) == ["w"] and torch.equal(got["w"], torch.arange(5.0))
