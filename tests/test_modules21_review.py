"""Unusual nn.Module kinds saved and restored (session 21 review, area "modules").

Refusals that say what to do: an optimizer built on a meta-device model before
``module.to_empty()`` (it holds the stale meta parameters), a pruned checkpoint loaded into an
unpruned model and back, a parametrized one into a plain model and back. And resumes that must
equal the uninterrupted run: parametrizations (spectral_norm's u/v buffers), prune's
weight_orig/weight_mask, a ``torch.compile`` wrapper's ``_orig_mod.`` names either way."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import trainguard as tg


def _state_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _step(m: nn.Module, o: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    o.zero_grad()
    m(torch.randn(3, 4)).pow(2).sum().backward()
    o.step()


def test_optimizer_built_before_to_empty_is_refused_saying_why(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    _step(m, o, 1)
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": m, "opt": o})

    with torch.device("meta"):
        m2 = nn.Linear(4, 4)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01)  # the mistake: before to_empty
    m2.to_empty(device="cpu")
    assert o2.param_groups[0]["params"][0] is not m2.weight  # to_empty gave the module new parameters
    with pytest.raises(tg.CheckpointError) as ei:
        tg.load(path, {"model": m2, "opt": o2})
    msg = str(ei.value)
    assert "2 of the optimizer's parameters" in msg and "meta device" in msg and "after to_empty()" in msg, msg

    # Not on the meta device: the module's parameters replaced after the optimizer was built.
    m3 = nn.Linear(4, 4)
    o3 = torch.optim.Adam(m3.parameters(), lr=0.01)
    m3.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    with pytest.raises(tg.CheckpointError, match="belong to no module in the state .*replaced after the optimizer"):
        tg.load(path, {"model": m3, "opt": o3})

    # Built after to_empty: loads, and the next step equals the uninterrupted one.
    with torch.device("meta"):
        m4 = nn.Linear(4, 4)
    m4.to_empty(device="cpu")
    o4 = torch.optim.Adam(m4.parameters(), lr=0.01)
    tg.load(path, {"model": m4, "opt": o4})
    _step(m, o, 2)
    _step(m4, o4, 2)
    _state_equal(m, m4)


def _pruned() -> nn.Sequential:
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    return m


def test_pruned_checkpoint_and_plain_model_say_what_to_do(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = _pruned()
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": m})
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(tg.StateMismatchError, match=r"checkpoint's module was pruned .*prune\.identity.*\(model/0\.weight\)"):
        tg.load(path, {"model": plain})
    # What the message says works: the mask is restored, not the identity's ones.
    prune.identity(plain[0], "weight")
    tg.load(path, {"model": plain})
    _state_equal(m, plain)
    # (``.weight`` itself is recomputed from these at the next forward, as after torch's load_state_dict)
    assert torch.equal(plain[0].weight_orig * plain[0].weight_mask, m[0].weight)
    assert int((plain[0].weight_mask == 0).sum()) == 8

    path2 = str(tmp_path / "b" / "step-000000001")
    tg.save(path2, {"model": nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))})
    with pytest.raises(tg.StateMismatchError, match=r"state's module is pruned .*load, then prune"):
        tg.load(path2, {"model": _pruned()})


def test_parametrized_checkpoint_and_plain_model_say_what_to_do(tmp_path: Path) -> None:
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": nn.Sequential(weight_norm(nn.Linear(4, 4)))})
    with pytest.raises(tg.StateMismatchError, match=r"has a parametrization .*register the same one.*\(model/0\.weight\)"):
        tg.load(path, {"model": nn.Sequential(nn.Linear(4, 4))})
    path2 = str(tmp_path / "b" / "step-000000001")
    tg.save(path2, {"model": nn.Sequential(nn.Linear(4, 4))})
    with pytest.raises(tg.StateMismatchError, match=r"state's module has a parametrization .*load, then register"):
        tg.load(path2, {"model": nn.Sequential(spectral_norm(nn.Linear(4, 4)))})
    # A plain mismatch has no such hint.
    with pytest.raises(tg.StateMismatchError) as ei:
        tg.load(path2, {"model": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))})
    assert "prune" not in str(ei.value) and "parametriz" not in str(ei.value)


@pytest.mark.parametrize("kind", ["spectral_norm", "prune"])
def test_resume_of_parametrized_or_pruned_model_equals_uninterrupted(tmp_path: Path, kind: str) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2)) if kind == "spectral_norm" else _pruned()
        return m, torch.optim.Adam(m.parameters(), lr=0.05)

    ref, ro = build()
    for s in range(6):
        _step(ref, ro, s)
    m, o = build()
    for s in range(3):
        _step(m, o, s)
    path = str(tmp_path / "step-000000003")
    tg.save(path, {"model": m, "opt": o})
    torch.manual_seed(9)  # another init: the load must overwrite all of it (u/v, mask)
    m2, o2 = build()
    for p in m2.parameters():
        p.data.normal_()
    tg.load(path, {"model": m2, "opt": o2})
    for s in range(3, 6):
        _step(m2, o2, s)
    _state_equal(ref, m2)


def test_compiled_and_plain_models_load_each_other(tmp_path: Path) -> None:
    def build(compiled: bool) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        wrapped = torch.compile(base) if compiled else base  # never run: compiling takes ~20 s here
        return base, wrapped, torch.optim.Adam(wrapped.parameters(), lr=0.05)

    for save_compiled in (True, False):
        base, wrapped, o = build(save_compiled)
        assert any(k.startswith("_orig_mod.") for k in wrapped.state_dict()) == save_compiled
        _step(base, o, 1)
        path = str(tmp_path / f"c{int(save_compiled)}" / "step-000000001")
        tg.save(path, {"model": wrapped, "opt": o})
        base2, wrapped2, o2 = build(not save_compiled)
        for p in base2.parameters():
            p.data.zero_()
        tg.load(path, {"model": wrapped2, "opt": o2})
        _step(base, o, 2)
        _step(base2, o2, 2)
        _state_equal(base, base2)


def _qat() -> nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    m.train()
    m.qconfig = get_default_qat_qconfig("fbgemm")  # per-channel weight fake-quant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        return prepare_qat(m)


def test_qat_model_resumes_bit_identically(tmp_path: Path) -> None:
    """A fresh prepare_qat model's per-channel observer buffers are empty (min_val: [0]) and its
    FakeQuantize scale/zero_point hold one element; trained, they hold one per channel. torch's
    load_state_dict resizes them; trainguard refused them as mismatched."""
    ref = _qat()
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(6):
        _step(ref, ro, s)
    m = _qat()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        _step(m, o, s)
    assert m[0].weight_fake_quant.scale.shape == (4,)
    path = str(tmp_path / "step-000000003")
    tg.save(path, {"model": m, "opt": o})
    m2 = _qat()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    assert m2[0].weight_fake_quant.scale.shape == (1,)
    assert m2[0].weight_fake_quant.activation_post_process.min_val.shape == (0,)
    tg.load(path, {"model": m2, "opt": o2})
    _state_equal(m, m2)
    for s in range(3, 6):
        _step(m2, o2, s)
    _state_equal(ref, m2)

    # An observer that is an entry of its own; and a real mismatch is still refused, before
    # anything is read (another number of channels of a plain Linear).
    from torch.ao.quantization import PerChannelMinMaxObserver

    obs = PerChannelMinMaxObserver()
    obs(torch.randn(5, 3))
    tg.save(str(tmp_path / "o" / "step-000000001"), {"obs": obs})
    fresh = PerChannelMinMaxObserver()
    tg.load(str(tmp_path / "o" / "step-000000001"), {"obs": fresh})
    assert torch.equal(fresh.min_val, obs.min_val) and fresh.min_val.shape == (5,)
    other = _qat()
    other[2] = nn.Linear(4, 3)
    before = other[0].weight.detach().clone()
    with pytest.raises(tg.StateMismatchError, match=r"model/2\.weight"):
        tg.load(path, {"model": other, "opt": torch.optim.SGD(other.parameters(), lr=0.1)})
    assert torch.equal(other[0].weight, before)


def _qat_ddp_rank(rank: int, world: int, root: str) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = DDP(_qat())
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def train(m: nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
        for s in steps:
            _step(m, o, 10 * s + rank)

    a, oa = build()
    train(a, oa, range(3))
    b, ob = build()
    train(b, ob, range(2))
    tg.save(f"{root}/step-000000002", {"model": b, "optim": ob})
    c, oc = build()
    tg.load(f"{root}/step-000000002", {"model": c, "optim": oc})
    train(c, oc, range(2, 3))
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values(), strict=True))


def test_qat_ddp_model_resumes_on_two_ranks(tmp_path: Path) -> None:
    from dist_helper import run_ranks

    assert [r.value for r in run_ranks(_qat_ddp_rank, 2, str(tmp_path), timeout=90)] == [True, True]
