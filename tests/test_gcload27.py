"""What an async save in flight leaves for the interpreter's garbage collector.

CPython runs a full collection (every tracked object of the process: 130 ms for the ~300,000 of a
torch training process on this machine) once the objects that survived the young collections since
the last full one exceed a quarter of the rest. The objects an async save keeps alive until it
is staged are such survivors: training's own young collections promote them while the save runs.
A model + Adam state of 1,904 tensors promoted 8,162 objects per save (4.3 per tensor: its leaf,
a detached view, a box, a (path, tensor) pair to watch, ...), and one of 12 save calls in a row
ran a full collection and took 165 ms against ~30 ms (2026-12-04). Now tensors of one shape share
their box and the watch list holds no pair per tensor: 2.4 per tensor (a leaf and a view each; the
view stays, so that ``t.data = other`` after the call cannot redirect the save's later copy).
``test_async21_review`` checks that a tensor changed before ``staged()`` is still named. Also here:
the call no longer works out the storage keys the pre-step hook needs only for an optimizer
outside the state (``stage.StorageKeys``).
"""

from __future__ import annotations

import gc
import threading

import torch

import trainguard as tg
from trainguard.capture import capture
from trainguard.dist import DistContext
from trainguard.storage import local


def _state(layers: int = 60) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def test_capture_shares_boxes_of_one_shape() -> None:
    state = _state(4)
    snap = capture(state, ctx=DistContext.current())
    weights = [lf for lf in snap.leaves if lf.path.startswith("model/") and lf.path.endswith("weight")]
    assert len(weights) == 4 and len({id(lf.box) for lf in weights}) == 1  # one box per shape
    assert all(lf.shape is lf.box.sizes and lf.shape == (4, 4) and lf.box.offsets == (0, 0) for lf in weights)
    for lf in weights:  # a parameter's leaf drops autograd: a plain tensor on the same memory
        assert type(lf.tensor) is torch.Tensor and not lf.tensor.requires_grad
        assert lf.tensor.data_ptr() in {p.data_ptr() for p in state["model"].parameters()}


def test_rebinding_optimizer_state_after_the_call_does_not_redirect_the_copy(tmp_path, gate) -> None:
    """``exp_avg.data = other`` between the call and the background copy: the checkpoint holds
    the moment as it was at the call (the leaf is a view of that memory, not the tensor object)."""
    state = _state(2)
    opt = state["optim"]
    first = next(iter(state["model"].parameters()))
    at_call = opt.state[first]["exp_avg"].clone()
    h = tg.save(tmp_path / "a", state, async_=True)
    opt.state[first]["exp_avg"].data = torch.full_like(at_call, 7.0)  # before the held copies run
    gate.set()
    h.result(timeout=60)
    fresh = _state(2)
    for s in fresh["optim"].state.values():
        s["exp_avg"].zero_()
    tg.load(tmp_path / "a", fresh)
    got = fresh["optim"].state[next(iter(fresh["model"].parameters()))]["exp_avg"]
    assert torch.equal(got, at_call) and not torch.equal(got, torch.full_like(at_call, 7.0))


def test_an_async_save_in_flight_promotes_few_objects_per_tensor(tmp_path, monkeypatch) -> None:
    state = _state()
    n_leaves = sum(1 + len(s) for s in state["optim"].state.values())  # parameters, their Adam state
    assert n_leaves == 480
    tg.save(tmp_path / "warm", state, async_=True).result(timeout=60)  # the staging pool's objects: once
    release = threading.Event()
    real = local._LocalWriter.pwrite

    def held(self, data, offset):  # the save stays in flight until the count is taken
        assert release.wait(60)
        return real(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", held)
    gc.collect()
    before = {id(o) for o in gc.get_objects(2)}
    try:
        h = tg.save(tmp_path / "a", state, async_=True)
        gc.collect(1)  # what the training loop's young collections do while the save runs
        promoted = sum(1 for o in gc.get_objects(2) if id(o) not in before)
    finally:
        release.set()
    h.result(timeout=60)
    # 4.4 objects per tensor before (2,111 here), 2.4 now (1,152, ~100 of them the save's own).
    assert promoted < 3 * n_leaves, f"{promoted} objects promoted for {n_leaves} tensors"
    fresh = _state()
    for p in fresh["model"].parameters():
        p.data.add_(1.0)
    tg.load(tmp_path / "a", fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh["model"].parameters(), state["model"].parameters(), strict=True))


def test_storage_keys_are_worked_out_only_for_an_optimizer_outside_the_state(tmp_path, gate) -> None:
    """The pre-step hook needs the memory of what the save still copies only when an optimizer
    not in the state steps meanwhile; the call no longer works it out for every save. Such an
    optimizer over other parameters steps at once (that one over the state's parameters waits:
    tests/test_mutate_review.py)."""
    from trainguard import async_save

    state = _state(2)
    other = torch.nn.Linear(4, 4)
    side = torch.optim.SGD(other.parameters(), lr=0.1)
    h = tg.save(tmp_path / "a", state, async_=True)
    job = async_save._INFLIGHT
    assert job is not None and job.handle is h and job.storages._keys is None  # nothing computed in the call
    other(torch.randn(2, 4)).sum().backward()
    side.step()  # not in the state, over nothing the save copies: no wait
    assert not h.staged() and job.storages._keys  # asked now: the keys of the leaves still to copy
    assert h.hook_wait_s == 0.0
    gate.set()
    h.result(timeout=60)
