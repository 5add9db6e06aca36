"""Session 56, review56k: a hostile review of review56c (the load path: ``flatten.refill``, ``rankload.split_hint``,
``dcp_empty``, the strict=False warning) and review56b (``collategens``: a ``collate_fn``'s own generators seeded per
batch, found from torch's fetcher frame).

Seen before the fix:
- a ``tg.SeededDataset`` subclass whose ``__getitems__`` (or ``__getitem__``) calls ``super()`` (to add a field, to
  log) had its ``collate_fn``'s own generators never seeded, silently: ``collategens.caller_collate`` looked only two
  frames up for torch's fetcher and found the subclass's method there. A resume after 2 of 4 batches differed, and
  so did 0 and 2 workers;
- ``convert --to dcp`` and back lost an empty dict whose DCP key (its path joined with dots) is also a leaf's
  (``{"x": {"y": {}}, "x.y": 5}``: both ``extra.x.y``): ``dcp_empty.KeepEmptyPlanner`` left it out, and a strict
  load of the state it came from was refused (``missing from the checkpoint: extra/x``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import trainguard as tg
from test_hunt56_review56b import N, _Crop, _Plain
from trainguard.convert import convert


class _Logged(tg.SeededDataset):
    """A subclass that wraps the seeded fetch (a user's logging or extra field), calling ``super()``."""

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        return list(super().__getitems__(keys))

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(key)


def _run(workers: int, tmp_path, batch_size: int | None, stop: int = 2) -> tuple[list[bytes], list[bytes]]:
    def make():
        sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
        loader = DataLoader(_Logged(_Plain(), seed=0), batch_size=batch_size, sampler=sampler, num_workers=workers,
                            collate_fn=_Crop())
        return {"data": sampler}, loader

    state, loader = make()
    straight = []
    for x in loader:
        straight.append(x.numpy().tobytes())
        state["data"].advance(len(x) if batch_size else 1)
        if len(straight) == stop:
            tg.save(str(tmp_path / "step-000000002"), state)
    state, loader = make()  # a restarted process: a fresh collator
    tg.load(str(tmp_path / "step-000000002"), state)
    resumed = []
    for x in loader:
        resumed.append(x.numpy().tobytes())
        state["data"].advance(len(x) if batch_size else 1)
    assert len(straight) > stop
    return straight[stop:], resumed


@pytest.mark.parametrize("batch_size", [4, None])
def test_a_subclass_calling_super_has_its_collate_fn_seeded(tmp_path, batch_size: int | None) -> None:
    straight, resumed = _run(0, tmp_path, batch_size)
    assert straight == resumed, "the collate_fn's own generator drew on unseeded after the resume"


def test_a_subclass_calling_super_collates_the_same_with_workers(tmp_path) -> None:
    zero, _ = _run(0, tmp_path / "a", 4)
    two, _ = _run(2, tmp_path / "b", 4)
    assert zero == two


def test_a_dataset_wrapping_seeded_dataset_is_not_taken_for_it() -> None:
    # the frames skipped are the dataset's own methods only: another object's method between is not walked past
    from trainguard.collategens import caller_collate

    ds = tg.SeededDataset(_Plain(), seed=0)

    class Outer:
        def get(self) -> Any:
            return caller_collate(ds)

    assert Outer().get() is None


def _odd(model: torch.nn.Module) -> dict:
    return {"model": model, "extra": {"x": {"y": {}}, "x.y": 5, "a/b": {}, "c.d": {}, "": {}, "k": {"": {}},
                                      "e": {"f.g": {"h": {}}}}}


def test_an_empty_dict_whose_dcp_key_a_leaf_holds_survives_dcp(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, out, back = tmp_path / "ck" / "step-000000001", tmp_path / "dcp", tmp_path / "back" / "step-000000001"
    model = torch.nn.Linear(2, 2)
    tg.save(src, _odd(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's metadata is a pickle: convert warns on import
        convert(src, out, dst_format="dcp", entry=None)
        convert(out, back)
        dcp_to_torch_save(str(out), str(tmp_path / "all.pt"))  # torch's own reader ignores the record
        msd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dcp.load({"model": msd}, checkpoint_id=str(out), no_dist=True)
    state = _odd(torch.nn.Linear(2, 2))
    state["extra"]["x.y"] = 0
    tg.load(back, state)  # before: missing from the checkpoint (1): extra/x
    assert state["extra"] == _odd(model)["extra"]
    assert torch.equal(msd["weight"], model.weight.detach())
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert whole["extra"]["x.y"] == 5 and torch.equal(whole["model"]["bias"], model.bias.detach())
