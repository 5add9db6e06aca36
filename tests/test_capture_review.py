"""Save-side edges found by a review of ``capture``/``flatten``: what is captured and whether it
round-trips exactly or is refused at save time, never silently changed."""

from __future__ import annotations

import sys

import pytest
import torch

import trainguard as tg


def test_conjugate_or_negative_view_of_an_earlier_tensor_is_refused_not_aliased(tmp_path):
    # x.conj() and x.conj().imag (a negative view) start at the memory of x / x.imag, with its
    # dtype, shape and strides: they were taken for a tie and saved as x's values, silently.
    x = torch.randn(4, dtype=torch.complex64)
    for i, (state, bad) in enumerate([({"a": x, "b": x.conj()}, "b"), ({"a": x.imag, "b": x.conj().imag}, "b")]):
        with pytest.raises(tg.UnsupportedValueError, match=rf"^{bad}: .*resolve_conj"):
            tg.save(tmp_path / f"c{i}", state)
        assert not (tmp_path / f"c{i}").exists()
    # Resolved, they are saved as their values.
    tg.save(tmp_path / "ok", {"a": x, "b": x.conj().resolve_conj()})
    out = {"a": None, "b": None}
    tg.load(tmp_path / "ok", out)
    assert torch.equal(out["a"], x) and torch.equal(out["b"], x.conj())


@pytest.mark.parametrize("where", ["value", "key", "metadata"])
def test_int_with_more_digits_than_json_reads_back_is_refused_at_save(tmp_path, where):
    # json reads no int of more than 4300 digits (Python's default): such a checkpoint, saved
    # after sys.set_int_max_str_digits(0) as the old error said, was "corrupt" to every reader.
    big = 10**4300
    state = {"t": torch.ones(2), "p": tg.StateDict(v=big if where == "value" else 0, d={big: 1} if where == "key" else {})}
    meta = {"n": big} if where == "metadata" else None
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(tg.UnsupportedValueError, match=r"more than 4300 decimal digits.*hex\(v\)"):
            tg.save(tmp_path / "c", state, metadata=meta)
    finally:
        sys.set_int_max_str_digits(old)
    assert not (tmp_path / "c").exists()
    # The largest int JSON reads back round-trips exactly, as does its hex form.
    edge = 10**4300 - 1
    tg.save(tmp_path / "ok", {"p": tg.StateDict(v=edge, n=-edge, h=hex(big), d={edge: 1})}, metadata={"n": edge})
    p = tg.StateDict()
    m = tg.load(tmp_path / "ok", {"p": p})
    assert p == {"v": edge, "n": -edge, "h": hex(big), "d": {edge: 1}} and int(p["h"], 16) == big
    assert m.metadata == {"n": edge}


def test_step_past_what_a_manifest_holds_is_refused_before_writing(tmp_path):
    # manifest.validate takes steps up to 2**62; a save of a larger one (named by the directory,
    # or given to the manager) committed a checkpoint that every load called corrupt.
    big = 2**62 + 1
    with pytest.raises(ValueError, match=r"at most 2\*\*62"):
        tg.save(tmp_path / f"step-{big}", {"t": torch.ones(2)})
    assert not (tmp_path / f"step-{big}").exists()
    with tg.CheckpointManager(tmp_path / "m", handle_signals=False) as mgr:
        with pytest.raises(ValueError, match=r"at most 2\*\*62"):
            mgr.save(big, {"t": torch.ones(2)}, force=True)
        mgr.save(2**62, {"t": torch.ones(2)}, force=True)
    out = {"t": torch.zeros(2)}
    with tg.CheckpointManager(tmp_path / "m", handle_signals=False) as mgr:
        assert mgr.restore(out) == 2**62
    assert torch.equal(out["t"], torch.ones(2))
    assert not [n for n in (tmp_path / "m").iterdir() if n.name.startswith("step-") and n.name != f"step-{2**62}"]


def test_tie_whose_first_name_is_longer_than_an_alias_target_may_be_is_saved_twice(tmp_path):
    # manifest.validate takes alias targets of up to 4096 characters; a tie whose first name was
    # longer committed an alias that every load called corrupt. Now its bytes are saved twice.
    x = torch.arange(3.0)
    long = "k" * 5000
    tg.save(tmp_path / "c", {"s": {long: x, "b": x}})
    out = {"s": None}
    tg.load(tmp_path / "c", out)
    assert torch.equal(out["s"][long], x) and torch.equal(out["s"]["b"], x)
    # A tie with a name of ordinary length stays one tensor, stored once.
    tg.save(tmp_path / "t", {"s": {"a": x, "b": x}})
    out = {"s": None}
    tg.load(tmp_path / "t", out)
    assert out["s"]["a"] is out["s"]["b"]
