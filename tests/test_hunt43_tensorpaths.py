"""Unusual tensor values through the library's other paths (hunt 43, tensorpaths).

- ``save(metrics=...)`` with a one-element tensor whose ``.item()`` fails (``float4_e2m1fn_x2``,
  nested): ``mgr.save`` raised torch's bare ``NotImplementedError`` past the save's preflight, so
  with several ranks the rank holding it left the save while the others waited in its first round
  until the heartbeat timeout ("rank 1 stopped responding: the process died or hangs"), where the
  docs promise a refusal on one rank fails the save on every rank at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.policies import metric_values

from dist_helper import run_ranks


def _float4_scalar() -> torch.Tensor:
    return torch.tensor([0x12], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)


@pytest.mark.parametrize("make", [_float4_scalar, lambda: torch.nested.nested_tensor([torch.ones(1)])], ids=["float4", "nested"])
def test_a_metric_tensor_without_a_python_number_is_refused_naming_it(make: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(tg.UnsupportedValueError, match=r"metrics\['loss'\].*\.item\(\) fails"):
        metric_values({"loss": make()})


def test_such_a_metric_fails_the_managers_save_and_keeps_the_previous(tmp_path: Path) -> None:
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 0.5})
        with pytest.raises(tg.UnsupportedValueError, match=r"metrics\['loss'\]"):
            mgr.save(2, {"w": torch.zeros(2)}, metrics={"loss": _float4_scalar()})
        assert mgr.latest_step() == 1


def _one_rank_passes_a_float4_metric(rank: int, world: int, root: str) -> str:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), timeout=60, handle_signals=False) as mgr:
        try:
            mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": _float4_scalar() if rank == 1 else 1.0})
        except Exception as e:  # noqa: BLE001  (the test compares what each rank raised)
            return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_metric_refused_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path: Path) -> None:
    results = run_ranks(_one_rank_passes_a_float4_metric, 2, str(tmp_path / "run"), timeout=90)
    said = [r.value for r in results]
    # Before: rank 1 raised NotImplementedError, rank 0 waited out the heartbeat ("stopped responding").
    assert all(s.startswith("RankFailureError") and "save failed on rank(s) [1]" in s for s in said), said
    assert all("stopped responding" not in s for s in said), said
    assert not any(p.name.startswith("step-") for p in (tmp_path / "run").iterdir())


# - An export to DCP of an entry holding a tuple of tensors (DCP flattens lists, not tuples: it
#   pickles the tuple whole) converted back dropped the tuple, listed as skipped, though the
#   export counted its tensors: the import took only JSON values out of a pickled value.


def test_a_tuple_of_tensors_survives_an_export_to_dcp_and_back(tmp_path: Path) -> None:
    from trainguard.convert import convert

    tt = (torch.tensor([0.0, -0.0]), torch.arange(3, dtype=torch.bfloat16), [torch.ones(1, dtype=torch.int64), 5])
    tg.save(tmp_path / "src", {"model": {"w": torch.ones(2), "tt": tt}})
    with pytest.warns(UserWarning):
        assert convert(tmp_path / "src", tmp_path / "dcp", dst_format="dcp", entry=None)["tensors"] == 4
        back = convert(tmp_path / "dcp", tmp_path / "back")
    assert back["skipped"] == [] and back["tensors"] == 4
    out: dict = {"model": None}
    tg.load(tmp_path / "back", out)
    got = out["model"]["tt"]
    assert type(got) is tuple and type(got[2]) is list and got[2][1] == 5
    for a, b in zip((tt[0], tt[1], tt[2][0]), (got[0], got[1], got[2][0]), strict=True):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# - A tensor named ``__metadata__`` (safetensors' header key) or with a name that is not UTF-8: an
#   export to .safetensors exited 0 writing a file that safetensors cannot read ("duplicate field
#   `__metadata__`", "unexpected end of hex escape"), replacing an earlier good export; convert
#   wrote the same broken file for ``__metadata__`` (save_file does not refuse it).


@pytest.mark.parametrize("name", ["__metadata__", "w\ud800"], ids=["metadata", "surrogate"])
@pytest.mark.parametrize("how", ["export", "convert"])
def test_a_tensor_name_safetensors_cannot_hold_is_refused_before_writing(tmp_path: Path, name: str, how: str) -> None:
    from safetensors.torch import load_file

    from trainguard.convert import convert
    from trainguard.export import export

    ckpt, out = tmp_path / "ckpt", tmp_path / "model.safetensors"
    tg.save(ckpt, {"model": {name: torch.arange(3.0), "ok": torch.ones(2)}})
    tg.save(tmp_path / "good", {"model": {"ok": torch.ones(2)}})
    export(tmp_path / "good", out)  # an earlier export at the destination
    write = export if how == "export" else convert
    with pytest.raises(tg.CheckpointError, match="cannot be stored in a safetensors file"):
        write(ckpt, out)
    assert list(load_file(out)) == ["ok"]  # left as it was, and still readable
    export(ckpt, tmp_path / "model.pt")  # a .pt file holds any str name
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)[name], torch.arange(3.0))
