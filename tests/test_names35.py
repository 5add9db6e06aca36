"""Session 35: the names optimizer state is keyed by (optnames.py): a tied parameter by its first
name, a parameter several module entries hold by the largest entry; checkpoints keyed the older
ways still load; FSDP1 optimizers over unsharded flat parameters; what a refusal of other
parameter names says.

Each round trip saves to ``tmp_path`` with ``tg.save`` and loads with ``tg.load`` into a fresh
model and optimizer whose state differs before the load and equals the saved one bit for bit
after. Multi-rank cases run real gloo process groups on 127.0.0.1 (``dist_helper.run_ranks``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import capture
from trainguard.names import canonical_key
from trainguard.stateful import ModuleAdapter

from dist_helper import attempt, run_ranks


class LM(nn.Module):
    """A tiny language model whose output layer is tied to its embedding (``lm_head.weight`` IS
    ``wte.weight``); ``alias=True`` adds a later name for the same module (``out``)."""

    def __init__(self, seed: int, alias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.wte.weight
        if alias:
            self.out = self.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(x))))


def _train(m: nn.Module, o: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        o.zero_grad()
        x = torch.randint(0, 7, (5,), generator=g)
        nn.functional.cross_entropy(m(x), x).backward()
        o.step()


def _ostate(m: nn.Module, o: torch.optim.Optimizer) -> dict:
    """The optimizer's state by the parameter's first name, cloned."""
    names = {}
    for n, p in m.named_parameters():
        names.setdefault(id(p), n)
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in o.state.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _same(v, b[k]) if isinstance(v, dict) else torch.equal(v, b[k]) for k, v in a.items())


def _optim_keys(man: tg.Manifest, key: str = "optim") -> set[str]:
    return {p.split("/")[2] for p in man.tensors if p.startswith(f"{key}/state/")}


def _old_param_names(self: ModuleAdapter) -> dict[int, str]:
    """ModuleAdapter.param_names before session 35: a dict over every name, the last one of a tie wins."""
    return {id(p): canonical_key(n) for n, p in self.module.named_parameters(remove_duplicate=False)}


def _old_name_map(state, *, other: bool = False) -> dict[int, str]:
    """stateful.param_name_map before session 35: the first module entry in the state's order names a parameter."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    prefixed = (len(modules) > 1) != other
    out: dict[int, str] = {}
    for key, mod in modules.items():
        for pid, name in ModuleAdapter(mod).param_names().items():
            out.setdefault(pid, f"{key}.{name}" if prefixed else name)
    return out


def _resume(path, state_of, saved: dict, make=LM, **load_kw) -> dict:
    """Load ``path`` into a fresh model and optimizer (state built by ``state_of(m, o)``) whose
    optimizer state differs from ``saved`` before; returns the loaded optimizer state."""
    m = make(1)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train(m, o, 1, seed=5)
    assert not _same(_ostate(m, o), saved)
    tg.load(path, state_of(m, o), **load_kw)
    return _ostate(m, o)


# 1. A tied parameter is keyed by its first name.

def test_tied_parameter_is_keyed_by_its_first_name_and_round_trips(tmp_path):
    """Before: the last name (``lm_head.weight``) keyed the optimizer state while the module entry
    wrote the tensor under its first (``wte.weight``)."""
    m = LM(0)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train(m, o)
    man = tg.save(tmp_path / "ck", {"model": m, "optim": o})
    assert _optim_keys(man) == {"wte.weight", "mid.weight", "mid.bias"}
    saved = _ostate(m, o)
    assert _same(_resume(tmp_path / "ck", lambda m, o: {"model": m, "optim": o}, saved), saved)


def test_a_later_alias_of_a_tied_module_does_not_change_the_optimizer_keys(tmp_path):
    """A model that names the tied module once more (``self.out = self.lm_head``) keys its
    optimizer as before: the first name. Before, the key moved to ``out.weight`` and the
    checkpoint of the model without that alias was refused."""
    m = LM(0)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train(m, o)
    tg.save(tmp_path / "ck", {"model": m, "optim": o})
    saved = _ostate(m, o)
    got = _resume(tmp_path / "ck", lambda m, o: {"model": m, "optim": o}, saved, make=lambda s: LM(s, alias=True))
    assert _same(got, saved)
    m2 = LM(2, alias=True)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    assert _optim_keys(tg.save(tmp_path / "ck2", {"model": m2, "optim": o2})) == set()  # no state yet
    _train(m2, o2)
    assert _optim_keys(tg.save(tmp_path / "ck3", {"model": m2, "optim": o2})) == {"wte.weight", "mid.weight", "mid.bias"}


@pytest.mark.parametrize("split_state", [False, True])
def test_checkpoint_keyed_by_the_last_name_of_a_tie_still_loads(tmp_path, monkeypatch, split_state):
    """A checkpoint written by trainguard before session 35 (the tie keyed ``lm_head.weight``)
    loads through that name; with ``split_state=True`` too (its pruning keeps every name of a tie)."""
    m = LM(0)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train(m, o)
    with monkeypatch.context() as mp:
        mp.setattr(ModuleAdapter, "param_names", _old_param_names)
        man = tg.save(tmp_path / "old", {"model": m, "optim": o})
    assert _optim_keys(man) == {"lm_head.weight", "mid.weight", "mid.bias"}
    saved = _ostate(m, o)
    got = _resume(tmp_path / "old", lambda m, o: {"model": m, "optim": o}, saved, split_state=split_state)
    assert _same(got, saved)
    # Two module entries (an EMA added since): the tie's prefixed last name.
    with monkeypatch.context() as mp:
        mp.setattr(ModuleAdapter, "param_names", _old_param_names)
        tg.save(tmp_path / "old2", {"model": m, "ema": nn.Linear(2, 2), "optim": o})
    got = _resume(tmp_path / "old2", lambda m, o: {"model": m, "optim": o}, saved, split_state=split_state, only=["model", "optim"])
    assert _same(got, saved)


def test_split_state_load_of_a_tied_model_keeps_the_tie_state(tmp_path):
    """``split_state=True`` prunes the saved optimizer to this rank's parameters by name: the
    tie's state, keyed by its first name now, is kept (and the model entry keeps both names)."""
    m = LM(0)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train(m, o)
    tg.save(tmp_path / "ck", {"model": m, "optim": o})
    saved, weights = _ostate(m, o), {k: v.clone() for k, v in m.state_dict().items()}
    loaded = {}

    def state_of(m2, o2):
        loaded["model"] = m2
        return {"model": m2, "optim": o2}

    got = _resume(tmp_path / "ck", state_of, saved, split_state=True)
    assert _same(got, saved) and _same(dict(loaded["model"].state_dict()), weights)
    assert loaded["model"].lm_head.weight is loaded["model"].wte.weight  # still one tensor


# 2. A parameter several module entries hold is named by the largest.

class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _net_train(m: Net, o: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        o.zero_grad()
        m(torch.randn(6, 4, generator=g)).square().mean().backward()
        o.step()


def _net_resume(path, order: list[str], saved: dict, **kw) -> dict:
    m = Net(1)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _net_train(m, o, 1, seed=5)
    assert not _same(_ostate(m, o), saved)
    parts = {"model": m, "head": m.head, "optim": o}
    tg.load(path, {k: parts[k] for k in order}, **kw)
    return _ostate(m, o)


def test_parameter_of_several_module_entries_is_named_by_the_largest_whatever_the_order(tmp_path):
    """Before: the first entry in the state's order named it (``head.weight`` with the head
    listed first, ``model.head.weight`` with the model first)."""
    keys = []
    for i, order in enumerate((["model", "head", "optim"], ["head", "model", "optim"], ["optim", "head", "model"])):
        m = Net(0)
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        _net_train(m, o)
        parts = {"model": m, "head": m.head, "optim": o}
        keys.append(_optim_keys(tg.save(tmp_path / f"ck{i}", {k: parts[k] for k in order})))
        saved = _ostate(m, o)
        for load_order in (order, order[::-1]):
            assert _same(_net_resume(tmp_path / f"ck{i}", load_order, saved), saved)
    assert keys == [{"model.body.weight", "model.body.bias", "model.head.weight", "model.head.bias"}] * 3


def test_equal_entries_are_broken_by_key(tmp_path):
    """Two entries of the same size holding the same parameters: the smaller key names them."""
    m = nn.Linear(3, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    for i, state in enumerate(({"b": m, "a": m, "optim": o}, {"a": m, "b": m, "optim": o})):
        assert _optim_keys(tg.save(tmp_path / f"ck{i}", state)) == {"a.weight", "a.bias"}


def test_checkpoint_named_by_the_first_entry_in_order_still_loads(tmp_path, monkeypatch):
    """Written before session 35 with the head listed first (``head.weight``): loads in any order."""
    m = Net(0)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _net_train(m, o)
    with monkeypatch.context() as mp:
        mp.setattr(capture, "param_name_map", _old_name_map)
        man = tg.save(tmp_path / "old", {"head": m.head, "model": m, "optim": o})
    assert _optim_keys(man) == {"model.body.weight", "model.body.bias", "head.weight", "head.bias"}
    saved = _ostate(m, o)
    for order in (["head", "model", "optim"], ["model", "head", "optim"]):
        assert _same(_net_resume(tmp_path / "old", order, saved), saved)
    # and into a state with the model alone (only=: the head entry is left out)
    m2 = Net(1)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    tg.load(tmp_path / "old", {"model": m2, "optim": o2}, only=["model", "optim"])
    assert _same(_ostate(m2, o2), saved)


def test_split_state_load_in_another_order_keeps_the_state_named_by_the_other_entry(tmp_path, monkeypatch):
    """``split_state=True`` prunes the saved optimizer to this rank's parameters by name: it kept
    only the names the state's order gave, and dropped a checkpoint's state named by the other
    entry (the head listed first at save time), then refused the groups."""
    m = Net(0)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _net_train(m, o)
    with monkeypatch.context() as mp:
        mp.setattr(capture, "param_name_map", _old_name_map)
        tg.save(tmp_path / "old", {"head": m.head, "model": m, "optim": o})
    saved = _ostate(m, o)
    assert _same(_net_resume(tmp_path / "old", ["model", "head", "optim"], saved, split_state=True), saved)


# 4. What a refusal of other parameter names says.

class Renamed(nn.Module):
    """``Net`` with its ``body`` renamed ``trunk``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)


class Grown(Net):
    """``Net`` with a layer added."""

    def __init__(self) -> None:
        super().__init__(0)
        self.extra = nn.Linear(3, 3)


def _saved_net(path, groups=None) -> None:
    m = Net(0)
    o = torch.optim.Adam(groups(m) if groups else m.parameters(), lr=1e-2)
    _net_train(m, o)
    tg.save(path, {"model": m, "optim": o})


def _refusal(path, m: nn.Module, params) -> str:
    o = torch.optim.Adam(params, lr=1e-2)
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, {"model": m, "optim": o}, only=["optim"])
    assert not o.state  # refused before anything was read
    return str(e.value)


def test_refusal_of_renamed_parameters_lists_pairs(tmp_path):
    """Before: 'holds other parameters than at save time (differences: [four names, sorted])' and the
    advice for frozen layers."""
    _saved_net(tmp_path / "ck")
    m = Renamed()
    msg = _refusal(tmp_path / "ck", m, m.parameters())
    assert msg.startswith("entry 'optim': parameter group 0 holds other parameters than at save time"), msg
    assert "2 of its 4 parameters have other names" in msg, msg
    assert "'body.weight' -> 'trunk.weight', 'body.bias' -> 'trunk.bias'" in msg and "renamed since the save" in msg, msg
    assert "frozen" not in msg, msg


def test_refusal_of_added_and_removed_parameters_names_them(tmp_path):
    _saved_net(tmp_path / "ck")
    m = Grown()
    msg = _refusal(tmp_path / "ck", m, m.parameters())
    assert "holds 2 parameter(s) ['extra.weight', 'extra.bias'], which the checkpoint's lacks (added" in msg, msg
    assert "which the optimizer's lacks" not in msg, msg
    m = Net(0)
    msg = _refusal(tmp_path / "ck", m, m.body.parameters())
    assert "holds ['head.weight', 'head.bias'], which the optimizer's lacks (removed" in msg, msg
    assert "which the checkpoint's lacks" not in msg and "frozen since the save" in msg, msg


def test_refusal_of_the_same_groups_in_another_order_says_so(tmp_path):
    """Before: the differences of group 0 (all four names) and the advice for frozen layers."""
    _saved_net(tmp_path / "ck", lambda m: [{"params": m.body.parameters()}, {"params": m.head.parameters(), "lr": 0.1}])
    m = Net(0)
    msg = _refusal(tmp_path / "ck", m, [{"params": m.head.parameters(), "lr": 0.1}, {"params": m.body.parameters()}])
    assert "the same parameter groups in another order (the checkpoint's group 0 is the optimizer's group 1; " \
           "the checkpoint's group 1 is the optimizer's group 0)" in msg and "order of save time" in msg, msg
    assert "frozen" not in msg, msg
    m = Net(0)
    msg = _refusal(tmp_path / "ck", m, [{"params": [m.body.weight]}, {"params": [m.body.bias, *m.head.parameters()]}])
    assert "the same parameters, grouped otherwise: 'body.bias' (checkpoint group 0, optimizer group 1)" in msg, msg


# 3. FSDP1 with use_orig_params=False and unsharded flat parameters (NO_SHARD, or one rank).

def _fsdp1(seed: int, strategy: str, names: tuple[str, str] = ("0", "2")) -> tuple[nn.Module, torch.optim.Optimizer]:
    from collections import OrderedDict

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    m = nn.Sequential(OrderedDict([(names[0], nn.Linear(8, 16)), ("1", nn.ReLU()), (names[1], nn.Linear(16, 5))]))
    m = FSDP(m, use_orig_params=False, sharding_strategy=getattr(ShardingStrategy, strategy),
             device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _fsdp1_step(m: nn.Module, o: torch.optim.Optimizer, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    o.zero_grad()
    nn.functional.mse_loss(m(torch.randn(4, 8, generator=g)), torch.randn(4, 5, generator=g)).backward()
    o.step()


def _fsdp1_whole(m: nn.Module, o: torch.optim.Optimizer) -> dict:
    """The model's parameters and the optimizer's state by name, whole on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(m, o, options=StateDictOptions(full_state_dict=True))
    return {"p": {k: v.clone() for k, v in m.state_dict().items()},
            "o": {k: {n: v.clone() for n, v in st.items()} for k, st in osd["state"].items()}}


def _fsdp1_names(rank: int, world: int, root: str, strategy: str) -> dict:
    m, o = _fsdp1(0, strategy)
    for s in range(2):
        _fsdp1_step(m, o, s)
    man = tg.save(f"{root}/ck", {"model": m, "optim": o})
    tg.save(f"{root}/ema", {"model": m, "ema": nn.Linear(2, 2), "optim": o})
    saved = _fsdp1_whole(m, o)
    out = {"keys": sorted(_optim_keys(man)), "loads": {}}
    if strategy == "NO_SHARD" or world == 1:
        with pytest.MonkeyPatch.context() as mp:  # written as before session 35: keyed by the flat parameters
            mp.setattr(capture, "refuse_unsupported", lambda *a, **k: None)
            out["old_keys"] = sorted(_optim_keys(tg.save(f"{root}/flat", {"model": m, "optim": o})))
    for path, extra in (("ck", {}), ("ck", {"ema": nn.Linear(2, 2)}), ("ema", {}), ("flat", {})):
        if path == "flat" and "old_keys" not in out:
            continue
        m2, o2 = _fsdp1(1, strategy)
        _fsdp1_step(m2, o2, 7)
        before = _fsdp1_whole(m2, o2)
        r = attempt(lambda p=path, s={"model": m2, **extra, "optim": o2}: tg.load(f"{root}/{p}", s, only=["model", "optim"]))
        out["loads"][f"{path}+{sorted(extra)}"] = (r, not _same(before, saved) and _same(_fsdp1_whole(m2, o2), saved))
    m3, o3 = _fsdp1(1, strategy, names=("first", "second"))  # renamed since the save
    _fsdp1_step(m3, o3, 7)
    before = _fsdp1_whole(m3, o3)
    out["renamed"] = attempt(lambda: tg.load(f"{root}/ck", {"model": m3, "optim": o3}))
    out["untouched"] = _same(before, _fsdp1_whole(m3, o3))
    return out


@pytest.mark.parametrize(("world", "strategy"), [(1, "FULL_SHARD"), (2, "NO_SHARD"), (2, "FULL_SHARD")])
def test_fsdp1_unsharded_flat_parameters_keyed_by_their_parameters_names(tmp_path, world, strategy):
    """Before, unsharded (1 rank, NO_SHARD): the optimizer state was keyed by FSDP1's flat
    parameters ('0._flat_param'), which load into nothing but the same FSDP1 wrapping (such
    checkpoints still load). Sharded (FULL_SHARD on 2 ranks): a checkpoint saved with two module
    entries (an EMA) was refused by torch's set_optimizer_state_dict at the entry's turn when
    loaded into a state with the FSDP1 model alone, and a renamed model was refused there too,
    after the model had loaded; now both are checked before anything is read."""
    for r in run_ranks(_fsdp1_names, world, str(tmp_path), strategy, timeout=120):
        v = r.value
        assert v["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"], v["keys"]
        assert v.get("old_keys", ["0._flat_param", "2._flat_param"]) == ["0._flat_param", "2._flat_param"], v["old_keys"]
        for what, (res, same) in v["loads"].items():
            assert res == {"type": None} and same, (what, res)
        assert v["renamed"]["type"] in ("CheckpointError", "RankFailureError"), v["renamed"]
        assert "'0.weight' -> 'first.weight'" in v["renamed"]["msg"] and "other names" in v["renamed"]["msg"], v["renamed"]
        assert v["untouched"]  # refused before anything was read
    if world == 1:  # the names load into a plain model and its optimizer
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        tg.load(tmp_path / "ck", {"model": m, "optim": o})
        assert len(o.state) == 4
