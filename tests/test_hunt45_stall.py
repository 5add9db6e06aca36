"""Session 45's cuts in the async save's call (capture._leaf's fast path asks fewer questions per
tensor; flatten tests a dict's keys without a call per key): what they skip must still be refused
or encoded as before. Guards, not timings: each test would fail if a skipped check were not implied
by the ones left (a quantized dtype is no stored dtype, a meta tensor's storage has no address, only a
complex tensor has a conjugate bit) or if a key took the plain-dict path that must not."""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard.capture import _leaf
from trainguard.flatten import flatten, unflatten


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.empty(3, device="meta"), r"a meta tensor holds no data"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.qint8), r"quantized"),
        (lambda: torch.randn(4, dtype=torch.complex64).conj(), r"lazy conjugate/negative view"),
        (lambda: torch._neg_view(torch.randn(4)), r"lazy conjugate/negative view"),  # float32, contiguous, neg bit
    ],
    ids=["meta", "qint8", "conj", "neg_real"],
)
def test_tensors_the_fast_path_no_longer_asks_about_are_still_refused(tmp_path, make, match, async_):
    t = make()
    with pytest.raises(tg.CheckpointError, match=match):
        h = tg.save(tmp_path / "ck", {"model": tg.StateDict(w=t), "ok": torch.ones(2)}, async_=async_)
        if async_:
            h.result()
    assert not (tmp_path / "ck" / "manifest.json").exists()


def test_the_fast_path_still_takes_complex_and_real_tensors_and_their_values(tmp_path):
    c = torch.randn(5, dtype=torch.complex64)
    r = torch.randn(3, 2)
    conj_resolved = torch.randn(4, dtype=torch.complex128).conj().resolve_conj()
    for t in (c, r, conj_resolved):
        lf = _leaf("x", t, False, "sharded")
        assert lf.kind == "replicated" and lf.tensor.data_ptr() == t.data_ptr()  # the fast path: no copy
    state = {"s": tg.StateDict(c=c, r=r, k=conj_resolved)}
    tg.save(tmp_path / "ck", state, async_=True).result()
    got = {"s": tg.StateDict(c=torch.zeros_like(c), r=torch.zeros_like(r), k=torch.zeros_like(conj_resolved))}
    tg.load(tmp_path / "ck", got)
    assert torch.equal(got["s"]["c"], c) and torch.equal(got["s"]["r"], r) and torch.equal(got["s"]["k"], conj_resolved)


def test_flatten_keys_that_are_not_plain_strings_still_take_the_dict_form():
    t = torch.ones(2)
    value = {"a": {"$x": 1, "y": t}, "b": {1: 2.5}, "c": {"": None, "z": [t]}, "d": {"plain": "s"}}
    skel, tensors = flatten(value, "e")
    assert skel["a"] == {"$dict": [["$x", 1], ["y", {"$t": "e/a/y"}]]}
    assert skel["b"] == {"$dict": [[1, 2.5]]}
    assert skel["c"] == {"": None, "z": [{"$t": "e/c/z/0"}]} and skel["d"] == {"plain": "s"}
    back = unflatten(skel, tensors.__getitem__)
    assert back["a"]["$x"] == 1 and back["b"] == {1: 2.5} and back["c"][""] is None and back["d"] == {"plain": "s"}
