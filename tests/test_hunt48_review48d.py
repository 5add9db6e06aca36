"""review48d: fresh-eyes review of state capture and the optimizer side (session 48)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg


def _child(rng: np.random.Generator) -> float:
    return float(rng.spawn(1)[0].random())


def test_numpy_generator_spawn_count_is_restored(tmp_path):
    """A loop that splits its numpy generator with ``spawn()`` (one child per epoch or worker, as
    NumPy recommends) resumes with the children the uninterrupted run makes next. The count lives in
    the generator's SeedSequence, not in ``bit_generator.state``: the old code restored the state only,
    so the resumed run's children were the first epochs' again (the same stream twice, silently)."""
    straight = np.random.default_rng(0)
    expected = [_child(straight) for _ in range(4)][2:]

    rng = np.random.default_rng(0)
    [_child(rng) for _ in range(2)]
    rng.random(3)
    after = np.random.default_rng(0)
    [_child(after) for _ in range(2)]
    after.random(3)
    plain = float(after.random())
    tg.save(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": rng})})

    resumed = np.random.default_rng(0)  # as a restarted script builds it
    tg.load(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": resumed})})
    assert resumed.bit_generator.seed_seq.n_children_spawned == 2
    assert float(resumed.random()) == plain  # the generator's own stream, as before
    assert [_child(resumed) for _ in range(2)] == [_child(after) for _ in range(2)] == expected


def test_numpy_generator_that_spawned_more_keeps_its_count_and_warns(tmp_path):
    """A generator that has spawned more children than the checkpoint's cannot go back (the count
    only grows): the load says so instead of leaving the next ``spawn()`` off silently."""
    rng = np.random.default_rng(1)
    _child(rng)
    tg.save(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": rng})})
    [_child(rng) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"'data' has spawned 3 children .* the checkpoint's 1"):
        tg.load(tmp_path / "ck", {"rng": tg.RNGState(generators={"data": rng})})
    assert rng.bit_generator.seed_seq.n_children_spawned == 3


class _CountingOptimizer(torch.optim.Optimizer):
    """The pattern of several public optimizers (Sophia-style Hessian refreshes): a global counter kept
    in ``self.state`` under a key that is no parameter, beside each parameter's state."""

    def __init__(self, params, lr: float = 0.1, period: int = 3) -> None:
        super().__init__(params, {"lr": lr, "period": period})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        refresh = self.state["global_step"] % self.param_groups[0]["period"] == 0
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if "h" not in st or refresh:
                    st["h"] = p.grad.abs() + 1
                p.sub_(g["lr"] * p.grad / st["h"])


def _train(model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        opt.zero_grad()
        model(torch.full((2, 3), float(i))).pow(2).sum().backward()
        opt.step()


def _built() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return model, _CountingOptimizer(model.parameters())


def test_optimizer_state_under_a_key_that_is_no_parameter_saves_and_resumes(tmp_path):
    """torch's ``state_dict()`` keeps a key of ``optimizer.state`` that is no parameter as it is, and
    its ``load_state_dict()`` puts it back; trainguard's save raised ``TypeError: list indices must be
    integers or slices, not str`` (looking the key up as a parameter index): no checkpoint at all."""
    straight, sopt = _built()
    _train(straight, sopt, 0, 8)

    model, opt = _built()
    _train(model, opt, 0, 4)
    tg.save(tmp_path / "ck", {"model": model, "optim": opt})

    resumed, ropt = _built()
    tg.load(tmp_path / "ck", {"model": resumed, "optim": ropt})
    assert ropt.state["global_step"] == 4
    assert torch.equal(ropt.state[resumed.weight]["h"], opt.state[model.weight]["h"])
    _train(resumed, ropt, 4, 4)
    assert ropt.state["global_step"] == 8
    assert torch.equal(resumed.weight, straight.weight) and torch.equal(resumed.bias, straight.bias)


@pytest.mark.parametrize("value,says", [
    (torch.device("cpu"), "str(x) for a torch.device"),
    (np.float32(0.1), "float(x) for a numpy number"),
    ({"a", "b"}, "keep other objects out of the param groups"),
])
def test_param_group_value_refusal_says_what_fits_a_param_group(tmp_path, value, says):
    """A key a script adds to a param group is saved with the optimizer; one that is no JSON value is
    refused naming its path. The old hint said to wrap it in a class with state_dict()/load_state_dict()
    or (a module) to give it its own key of the state: neither can apply inside a param group (the
    wrapped object is refused there in turn)."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": model.parameters(), "extra": value}], lr=0.1)
    with pytest.raises(tg.UnsupportedValueError) as e:
        tg.save(tmp_path / "ck", {"model": model, "optim": opt})
    assert str(e.value).startswith("optim/param_groups/0/extra: ")
    assert says in str(e.value) and "wrap other objects" not in str(e.value)
    assert not (tmp_path / "ck").exists()


@pytest.fixture
def global_bit_generator():
    """Gives the test NumPy's global bit generator to replace, and puts the original back."""
    original = np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(original)


def test_numpy_global_functions_on_another_bit_generator_resume_exactly(tmp_path, global_bit_generator):
    """``np.random.set_bit_generator(PCG64(...))`` (NumPy 1.25+) makes ``np.random.get_state()`` a dict;
    ``RNGState``'s save unpacked it as MT19937's tuple and failed ("too many values to unpack"): a
    script doing so could not save at all."""
    np.random.set_bit_generator(np.random.PCG64(0))
    np.random.normal(size=3)
    tg.save(tmp_path / "ck", {"rng": tg.RNGState()})
    expected = np.random.normal(size=4).tolist()

    np.random.set_bit_generator(np.random.PCG64(123))  # a restarted script, drawn elsewhere since
    np.random.normal(size=2)
    tg.load(tmp_path / "ck", {"rng": tg.RNGState()})
    assert np.random.normal(size=4).tolist() == expected


@pytest.mark.parametrize("saved_kind,load_kind", [("PCG64", "MT19937"), ("MT19937", "Philox")])
def test_numpy_global_bit_generator_of_another_kind_is_refused_before_anything_changes(
        tmp_path, global_bit_generator, saved_kind, load_kind):
    """A load whose global NumPy generator is of another kind than the saved one (``set_bit_generator``
    called at save time and not at load, or the reverse) says which call to make, and changes no
    generator (it read as a corrupt checkpoint, or, the reverse, as MT19937's state set into another)."""
    import random

    np.random.set_bit_generator(getattr(np.random, saved_kind)(0))
    tg.save(tmp_path / "ck", {"rng": tg.RNGState()})
    np.random.set_bit_generator(getattr(np.random, load_kind)(1))
    random.seed(7)
    before = random.getstate()
    with pytest.raises(tg.CheckpointError, match=rf"was a {saved_kind} at save time .* is a {load_kind} now; "
                                                 rf"call np.random.set_bit_generator\(np.random.{saved_kind}\(\)\)"):
        tg.load(tmp_path / "ck", {"rng": tg.RNGState()})
    assert random.getstate() == before
