"""Save-side edges found by a review of ``capture``/``flatten``: what is captured and whether it
round-trips exactly or is refused at save time, never silently changed."""

from __future__ import annotations

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
