"""Hunt 55 (review55d): hostile end-to-end review of "save at step N, crash, resume at N, bit-identical",
also at other world sizes, and of what a user is told when the model no longer fits the checkpoint.

Seen before the fix: a submodule renamed since the save (``nn.Sequential``'s index ``2`` become
``self.out``, ``layers.N.attn`` become ``layers.N.attention``) gave a ``StateMismatchError`` listing the
tensors on both sides and saying "Pass strict=False to load what matches": which loads everything but the
renamed submodule and leaves it as built, silently. The optimizer's check names such renames
(``'2.weight' -> 'out.weight'``); the model's error did not, so ``tg.load(..., only=["model"])`` (or a
state without the optimizer) got the bad advice alone. Now the error names the rename and says what
``strict=False`` would do.
"""

from __future__ import annotations

import pytest
from torch import nn

import trainguard as tg


class _Block(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        setattr(self, name, nn.Linear(4, 4))
        self.mlp = nn.Linear(4, 4)


class _Encoder(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(name) for _ in range(3)])
        self.head = nn.Linear(4, 2)


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


def _mismatch(path: str, state: dict) -> str:
    with pytest.raises(tg.StateMismatchError) as info:
        tg.load(path, state)
    return str(info.value)


def test_renamed_submodule_is_named_in_the_error(tmp_path):
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))})
    renamed = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    renamed.add_module("out", nn.Linear(8, 2))
    msg = _mismatch(path, {"model": renamed})
    assert "'2' -> 'out' (2 tensors)" in msg, msg
    assert "strict=False would leave them as built" in msg, msg


def test_renamed_nested_and_alike_submodules_are_named(tmp_path):
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": _Encoder("attn"), "seq": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))})
    msg = _mismatch(path, {"model": _Encoder("attention"), "seq": _Named()})
    for i in range(3):
        assert f"'layers.{i}.attn' -> 'layers.{i}.attention' (2 tensors)" in msg, msg
    assert "'0', '1' -> 'a', 'b' (in some order)" in msg, msg  # two Linear(2, 2): which became which is unknown


def test_no_rename_named_where_none_was_made(tmp_path):
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))})
    cases = [
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),  # another shape
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2)),  # a layer more
        nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2)),  # a tensor less
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double(),  # another dtype
        nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))),  # wrapped: prefix_hint's
    ]
    for model in cases:
        assert "look renamed" not in _mismatch(path, {"model": model})
