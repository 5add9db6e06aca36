"""Load-path cases found in review: each failed before its fix. One process."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import trainguard as tg


def test_a_view_read_through_staging_before_a_later_view_still_loads_in_path_order(tmp_path):
    # "a" (a strided view: staged, copied in after the reads) comes first in path order, "b"
    # (contiguous: read in place) second; "b" must win where they overlap, as when both are
    # contiguous. Before, "b" was read first and "a"'s copy overwrote every other element.
    tg.save(tmp_path / "c", {"a": torch.ones(5), "b": torch.arange(10.0)})
    base = torch.zeros(10)
    tg.load(tmp_path / "c", {"a": base[::2], "b": base})
    assert base.tolist() == [float(i) for i in range(10)]

    # "c" is "a" saved as a tie (an alias, the same bytes): it is not skipped as read already,
    # since "b" is copied over part of it in between.
    x = torch.arange(10.0)
    tg.save(tmp_path / "d", {"a": x, "b": torch.full((5,), -1.0), "c": x})
    base = torch.zeros(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "a" and "c" hold the same values: no warning says otherwise
        tg.load(tmp_path / "d", {"a": base, "b": base[::2], "c": base})
    assert base.tolist() == x.tolist()


def test_an_optimizer_that_does_not_fit_is_named_by_its_own_entry(tmp_path):
    # The refusal named "entry 'optim'" whatever the state called the optimizer.
    model = torch.nn.Linear(3, 2)
    tg.save(tmp_path / "c", {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
    groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    with pytest.raises(tg.CheckpointError, match=r"^entry 'opt': the checkpoint has 1 parameter group\(s\)") as ei:
        tg.load(tmp_path / "c", {"model": model, "opt": groups})
    assert "'optim'" not in str(ei.value)
    other = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(tg.CheckpointError, match=r"^entry 'opt': parameter group 0 holds other parameters"):
        tg.load(tmp_path / "c", {"model": model, "opt": other})


def test_strict_false_keeps_a_reshaped_tensor_whose_name_holds_a_space(tmp_path):
    # The loader found the tensors to leave alone by the first word of each mismatch line:
    # "model/my" for "model/my layer.weight", so the tensor was read all the same, its box
    # overlapping the checkpoint's overwritten (rows 0-2 of 5) while the warning said it kept
    # its values; a dtype change to cast was listed as kept.
    model = torch.nn.ModuleDict({"my layer": torch.nn.Linear(4, 3)})
    tg.save(tmp_path / "c", {"model": model})
    wider = torch.nn.ModuleDict({"my layer": torch.nn.Linear(4, 5)})
    before = wider["my layer"].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"2 tensor\(s\) .* keep their current values: model/my layer\.weight"):
        tg.load(tmp_path / "c", {"model": wider}, strict=False)
    assert torch.equal(wider["my layer"].weight, before)

    doubled = torch.nn.ModuleDict({"my layer": torch.nn.Linear(4, 3)}).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cast into the state's dtype, as documented: nothing kept
        tg.load(tmp_path / "c", {"model": doubled}, strict=False)
    assert torch.equal(doubled["my layer"].weight, model["my layer"].weight.double())


def test_a_read_only_state_refuses_values_it_cannot_take_compared_leaf_by_leaf(tmp_path):
    # Whether the read-only state already held the loaded value was asked with == on the whole
    # structure: {"a": 1} == {"a": True}, and a new one-element tensor of another dtype or
    # shape "equal" to the state's; the loaded values were dropped without an error.
    # Since session 56 a dict entry is filled in place (tests/test_hunt56_review56c.py): the refusal
    # is for an entry that cannot be, a tuple here.
    tg.save(tmp_path / "c", {"p": (True, torch.tensor([2.0]), float("nan"))})
    for p in (
        (1, torch.tensor([2.0]), float("nan")),
        (True, torch.tensor([2.0], dtype=torch.float64), float("nan")),
        (True, torch.tensor(2.0), float("nan")),
    ):
        with pytest.raises(tg.CheckpointError, match=r"entry 'p': the state is a read-only mappingproxy"):
            tg.load(tmp_path / "c", types.MappingProxyType({"p": p}))
    t = torch.zeros(1)
    tg.load(tmp_path / "c", types.MappingProxyType({"p": (True, t, float("nan"))}))
    assert t.tolist() == [2.0]  # read in place, the other values equal (nan included): nothing to replace
    tg.save(tmp_path / "d", {"p": {"a": True, "t": torch.tensor([2.0])}})
    p = {"a": 1, "t": torch.tensor(2.0, dtype=torch.float64)}
    tg.load(tmp_path / "d", types.MappingProxyType({"p": p}))  # the dict takes them: the state is not assigned to
    assert p["a"] is True and p["t"].dtype == torch.float32 and p["t"].tolist() == [2.0]


def test_an_expanded_destination_is_refused_before_any_read_or_replaced_when_plain(tmp_path):
    # An expand()ed tensor (stride 0) cannot hold distinct values: the read into it failed with
    # torch's RuntimeError half-way, after other tensors of the state were already overwritten.
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 5)
            self.register_buffer("scale", torch.arange(5.0))

    saved = Net()
    tg.save(tmp_path / "c", {"model": saved, "w": torch.arange(6.0)})
    net = Net()
    net.scale = torch.ones(1).expand(5)
    before = net.lin.weight.detach().clone()
    with pytest.raises(tg.StateMismatchError, match=r"model/scale \(the state's tensor is expanded"):
        tg.load(tmp_path / "c", {"model": net, "w": torch.zeros(6)})
    assert torch.equal(net.lin.weight, before)  # refused before any read
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) .* keep their current values: model/scale"):
        tg.load(tmp_path / "c", {"model": net}, strict=False)
    assert torch.equal(net.lin.weight, saved.lin.weight) and net.scale.tolist() == [1.0] * 5

    state = {"w": torch.zeros(1).expand(6)}  # a plain entry: read into a new tensor, as for another shape
    tg.load(tmp_path / "c", state, only=["w"])
    assert state["w"].tolist() == list(range(6)) and state["w"].stride() == (1,)


def test_destinations_with_a_conjugate_or_negative_bit_load_their_values(tmp_path):
    # x.conj() and torch._neg_view(x) are contiguous views whose memory holds the conjugate /
    # negation of their values: read in place they failed with torch's RuntimeError (their
    # .numpy() is refused); they are read beside and copied in, as a strided view is.
    z = torch.randn(4, dtype=torch.complex64)
    tg.save(tmp_path / "c", {"z": z, "n": torch.arange(4.0), "nested": {"z": z * 2}})
    zc, nz = torch.zeros(4, dtype=torch.complex64).conj(), torch._neg_view(torch.zeros(4))
    inner = torch.zeros(4, dtype=torch.complex64).conj()
    tg.load(tmp_path / "c", {"z": zc, "n": nz, "nested": {"z": inner}})
    assert torch.equal(zc, z) and torch.equal(nz, torch.arange(4.0)) and torch.equal(inner, z * 2)
