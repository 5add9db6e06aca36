"""Round trips of every kind of leaf and entry, one process."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.flatten import flatten, unflatten


def test_every_json_leaf_kind_round_trips_with_tuples_and_int_keys(tmp_path):
    value = {
        "i": 3, "neg": -(2**62), "f": 1.5, "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"),
        "b": True, "none": None, "s": "héllo/with slash", "l": [1, [2, 3], ()], "t": (1, (2.0, "x"), [None]),
        "d": {"nested": {"deeper": [1, 2]}}, "intkeys": {0: "a", 5: {1: 2}}, "$odd": {"$t": "not a tensor"},
        "empty": {}, "tensor_in_tuple": (torch.arange(3),),
    }
    state = {"extra": value}
    tg.save(tmp_path / "step-000000001", state)
    out = {"extra": None}
    tg.load(tmp_path / "step-000000001", out)
    got = out["extra"]
    assert math.isnan(got["nan"]) and got["inf"] == math.inf and got["ninf"] == -math.inf
    for k in ("i", "neg", "f", "b", "none", "s", "l", "t", "d", "intkeys", "$odd", "empty"):
        assert got[k] == value[k] and type(got[k]) is type(value[k]), k
    assert type(got["t"][1]) is tuple and type(got["l"][2]) is tuple
    assert torch.equal(got["tensor_in_tuple"][0], torch.arange(3)) and type(got["tensor_in_tuple"]) is tuple


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64,
     torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn],
)
def test_tensor_dtypes_and_shapes_round_trip_in_place(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5)]
    src = {f"t{i}": (torch.randn(s, generator=g) * 10).to(dtype) for i, s in enumerate(shapes)}
    tg.save(tmp_path / "c", {"x": src})
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    if any(v.numel() for v in src.values() if v.dtype != torch.bool):
        assert not all(_same(dst[k], src[k]) for k in src if src[k].numel())
    tg.load(tmp_path / "c", {"x": dst})
    for k in src:
        assert dst[k].data_ptr() == ptrs[k], "loaded in place, not replaced"
        assert dst[k].dtype == dtype and _same(dst[k], src[k]), k


def test_flat_dict_of_tensors_loads_in_place_and_replaces_entries_whose_shape_changed(tmp_path):
    """Top-level entries that are plain tensors take the loader's per-entry fast path; the
    cases it hands to the general path (a Parameter, a non-contiguous view, a changed shape or
    dtype, an empty tensor) behave as there."""
    g = torch.Generator().manual_seed(1)
    src = {f"w{i}": torch.randn(3 + i, 2, generator=g) for i in range(40)}
    src.update(empty=torch.empty(0, 3), p=nn.Parameter(torch.randn(4, generator=g)), t=torch.randn(3, 5, generator=g))
    tg.save(tmp_path / "c", src)
    dst = {k: torch.zeros_like(v.detach()) for k, v in src.items()}
    dst["p"] = nn.Parameter(torch.zeros(4))
    base = torch.zeros(5, 3)
    dst["t"] = base.t()  # non-contiguous destination: read into a staging tensor, copied back
    dst["w7"] = torch.zeros(5, 5)  # shape changed: replaced by the checkpoint's tensor
    dst["w8"] = torch.zeros(11, 2, dtype=torch.float64)  # dtype changed: replaced too
    ptrs = {k: v.data_ptr() for k, v in dst.items() if k not in ("w7", "w8", "empty")}
    assert not torch.equal(dst["w0"], src["w0"])
    tg.load(tmp_path / "c", dst, verify=False)
    tg.load(tmp_path / "c", dst)
    for k, v in src.items():
        assert dst[k].shape == v.shape and dst[k].dtype == v.dtype and torch.equal(dst[k], v.detach()), k
        if k in ptrs:
            assert dst[k].data_ptr() == ptrs[k], f"{k}: loaded in place, not replaced"
    assert torch.equal(base, src["t"].t()) and isinstance(dst["p"], nn.Parameter)
    mod = {"w7": torch.zeros(5, 5)}
    with pytest.raises(tg.StateMismatchError):  # strict and a missing entry: still reported
        tg.load(tmp_path / "c", {**mod, "absent": torch.zeros(1)}, only=["w7", "absent"])


def _same(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_unsupported_leaf_fails_at_save_naming_its_path(tmp_path):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    opt.param_groups[0]["foo"] = object()
    with pytest.raises(tg.UnsupportedValueError, match=r"optim/param_groups/0/foo.*without pickle"):
        tg.save(tmp_path / "c", {"optim": opt})
    with pytest.raises(tg.UnsupportedValueError, match=r"x/arr.*tolist"):
        tg.save(tmp_path / "c", {"x": {"arr": np.zeros(3)}})
    assert not (tmp_path / "c").exists()


def test_flatten_unflatten_inverse_on_nested_structure():
    v = {"a": [1, (2, {"b": torch.ones(2)})], 3: "int key"}
    skel, tensors = flatten(v, "root")
    assert list(tensors) == ["root/a/1/1/b"]
    back = unflatten(skel, tensors.__getitem__)
    assert back[3] == "int key" and back["a"][1][1]["b"] is tensors["root/a/1/1/b"]


def test_flatten_and_unflatten_leave_no_garbage_cycles():
    # A save or load of a flat dict of 10,000 tensors calls both once per tensor, inside a GC
    # pause: a cycle per call (recursive closure) was 50,000 objects for the next pass to find.
    import gc

    # Only cycles of flatten's own making count: DEBUG_SAVEALL keeps what the pass finds, and a
    # thread of an earlier test may drop garbage meanwhile (69,453 objects in one CI run).
    import types

    values = [{"a": [1, (2, {"b": torch.ones(2)})], "f": float("nan")}, torch.zeros(3), [torch.ones(1)] * 2]
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for v in values:
            skel, tensors = flatten(v, "root")
            unflatten(skel, tensors.__getitem__)
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, types.FunctionType) and o.__module__ == "trainguard.flatten"]
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert flatten(values[1], "k") == ({"$t": "k"}, {"k": values[1]})  # the one-tensor shortcut


def _model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_module_prefixes_are_stripped_and_load_into_wrapped_or_plain(tmp_path):
    torch.manual_seed(0)
    m = _model()
    compiled = torch.compile(m)  # wraps as OptimizedModule (._orig_mod); nothing is compiled here
    tg.save(tmp_path / "c", {"model": compiled})
    names = set(tg.inspect.describe(tmp_path / "c").tensors)
    assert names == {"model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"}
    torch.manual_seed(1)
    plain = _model()
    assert not torch.equal(plain[0].weight, m[0].weight)
    tg.load(tmp_path / "c", {"model": plain})
    assert torch.equal(plain[0].weight, m[0].weight)
    torch.manual_seed(2)
    wrapped = torch.compile(_model())
    tg.load(tmp_path / "c", {"model": wrapped})
    assert torch.equal(wrapped._orig_mod[2].weight, m[2].weight)


def test_optimizer_state_keyed_by_name_survives_reordered_params(tmp_path):
    torch.manual_seed(0)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    tg.save(tmp_path / "c", {"model": m, "optim": opt})
    names = tg.inspect.describe(tmp_path / "c").tensors
    assert "optim/state/0.weight/exp_avg" in names and "optim/state/2.bias/exp_avg_sq" in names
    m2 = _model()
    # Parameters in another order (and another group split) than at save time.
    opt2 = torch.optim.AdamW([{"params": [m2[2].bias, m2[2].weight]}, {"params": [m2[0].bias, m2[0].weight]}], lr=0.1)
    saved = {n: opt.state[p]["exp_avg"] for n, p in m.named_parameters()}
    with pytest.raises(tg.CheckpointError, match="entry 'optim'"):
        tg.load(tmp_path / "c", {"model": m2, "optim": opt2})  # two groups now, one at save time
    opt3 = torch.optim.AdamW(list(reversed(list(m2.parameters()))), lr=0.1)
    tg.load(tmp_path / "c", {"model": m2, "optim": opt3})
    for n, p in m2.named_parameters():
        assert torch.equal(opt3.state[p]["exp_avg"], saved[n]), n


def test_scheduler_scaler_statedict_and_generic_stateful_round_trip(tmp_path):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(5):
        opt.step()
        sched.step()
    scaler.scale(torch.tensor(1.0))
    scaler.update(new_scale=64.0)

    class Counter:
        def __init__(self, n=0):
            self.n = n

        def state_dict(self):
            return {"n": self.n, "hist": torch.arange(self.n)}

        def load_state_dict(self, sd):
            self.n = sd["n"]
            assert torch.equal(sd["hist"], torch.arange(self.n))

    prog = tg.StateDict(step=5, tokens=1 << 40)
    tg.save(tmp_path / "c", {"sched": sched, "scaler": scaler, "progress": prog, "counter": Counter(7)})
    opt2 = torch.optim.SGD(_model().parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    prog2, c2 = tg.StateDict(), Counter()
    tg.load(tmp_path / "c", {"sched": sched2, "scaler": scaler2, "progress": prog2, "counter": c2})
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == [0.25]
    assert scaler2.get_scale() == 64.0 and prog2 == {"step": 5, "tokens": 1 << 40} and c2.n == 7


def test_rng_state_restores_every_generator():
    state = tg.RNGState()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian in numpy's state
    sd = state.state_dict()
    expected = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) != expected
    state.load_state_dict(sd)
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == expected


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    tg.save(tmp_path / "c", {"rng": tg.RNGState()})
    expected = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    tg.load(tmp_path / "c", {"rng": tg.RNGState()})
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == expected


def test_rank_writes_two_files_in_parallel_and_both_are_verified(tmp_path, monkeypatch):
    from trainguard import streams

    monkeypatch.setattr(streams, "TWO_FILES_FROM", 0)  # the real threshold is 64 MiB
    g = torch.Generator().manual_seed(0)
    src = {f"t{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(6)}
    tg.save(tmp_path / "c", {"x": src})
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["data-00000-1.bin", "data-00000.bin", "manifest.json"]
    m = tg.inspect.describe(tmp_path / "c")
    used = {c.file for e in m.tensors.values() for c in e.chunks}
    assert used == {"data-00000.bin", "data-00000-1.bin"}
    sizes = sorted(m.files.values())
    assert sizes[0] > 0.6 * sizes[1]  # balanced by bytes
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    tg.load(tmp_path / "c", {"x": dst})
    assert all(torch.equal(dst[k], src[k]) for k in src)
    second = tmp_path / "c" / "data-00000-1.bin"
    raw = bytearray(second.read_bytes())
    raw[10] ^= 1
    second.write_bytes(bytes(raw))
    assert not tg.verify(tmp_path / "c").ok
    with pytest.raises(tg.CorruptCheckpointError, match="data-00000-1.bin"):
        tg.load(tmp_path / "c", {"x": dst})


def test_sync_save_of_device_chunks_goes_through_a_bounded_reused_host_buffer(tmp_path, monkeypatch):
    # CUDA chunks of a sync save reach the host in batches through one buffer of HOST_BATCH
    # bytes, not as one .cpu() copy of the whole state. Here every chunk is treated as a device
    # chunk (the seam), with a 5 MiB batch: the 24 MiB tensor is split into block pieces.
    from trainguard import streams

    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(6 << 20, generator=g),  # 24 MiB
        "mid": torch.randn(300_000, generator=g).to(torch.bfloat16),
        "small": {f"s{i}": torch.randn(100 * (i + 1), generator=g) for i in range(20)},
        "flags": torch.rand(1000, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
    }
    flat = tg.save(tmp_path / "plain", state)  # straight from the tensors' memory
    batches: list[int] = []
    real = streams._host_batches

    def spy(items):
        for b in real(items):
            batches.append(sum(t.numel() for _i, _s, t in b))
            yield b

    monkeypatch.setattr(streams, "needs_host_copy", lambda t: True)
    monkeypatch.setattr(streams, "HOST_BATCH", 5 << 20)
    monkeypatch.setattr(streams, "_HOST_POOL", None)
    monkeypatch.setattr(streams, "_host_batches", spy)
    staged = tg.save(tmp_path / "staged", state)
    assert len(batches) >= 5 and max(batches) <= 5 << 20, batches
    pool = streams._HOST_POOL
    assert pool is not None and 0 < pool.capacity <= 5 << 20  # the kept buffer, reused by the next save
    tg.save(tmp_path / "again", state)
    assert streams._HOST_POOL is pool and pool.allocations == 1 and not pool.in_use
    for name, e in staged.tensors.items():  # the same bytes: the same block checksums
        assert [c.checksums for c in e.chunks] == [c.checksums for c in flat.tensors[name].chunks], name
    back = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {n: torch.zeros_like(t) for n, t in v.items()})
            for k, v in state.items()}
    tg.load(tmp_path / "staged", back)
    assert torch.equal(back["big"], state["big"]) and torch.equal(back["mid"], state["mid"])
    assert torch.equal(back["flags"], state["flags"]) and back["empty"].shape == (0, 3)
    assert all(torch.equal(back["small"][n], t) for n, t in state["small"].items())
