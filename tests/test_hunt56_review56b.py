"""Hunt 56 (review56b): hostile review of the dataset-RNG capture of ``tg.SeededDataset`` (seeded.py, owngens.py,
deepgens.py, collategens.py).

Seen before the fix (a straight run against one saved at batch 2 and resumed with fresh objects, as a new process
would build them, every batch's bytes compared):
- a ``collate_fn`` that keeps its own generator (a random-crop collator object, ``self.rng =
  np.random.default_rng(0)``; a ``functools.partial(mix, rng=...)``; a collator holding a list of ops with
  generators) was never seeded: it drew on from wherever it had got to, and the resume differed from its first batch
  on, with 0 and with 2 DataLoader workers (the docs listed it as not covered);
- ``DataLoader(batch_size=None)``: a ``collate_fn`` drawing from the global generators in a worker drew from
  wherever the worker's generators had got to (they were put back after each sample, never seeded for it): the
  resume differed with 2 workers;
- a generator kept in a ``collections.deque`` or behind a ``weakref.ref`` was never found: the resume differed, with
  0 and 2 workers; generators in a ``set``/``frozenset`` (no order the same in every process) are now warned about;
- a ``collate_fn`` that makes its generator on first use drew from fresh entropy at its first batch in each process:
  now a ``RuntimeWarning`` saying to make it before the loop.
"""

from __future__ import annotations

import collections
import functools
import random
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg

N = 16


class _Plain(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i), dtype=torch.float64)


def _stack(xs: list[torch.Tensor] | list[int] | torch.Tensor) -> torch.Tensor:
    if not isinstance(xs, list):  # batch_size=None: one sample
        return xs
    return torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in xs])


class _Crop:
    """A random-crop collator object with its own generator."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(7)

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return _stack(xs) + float(self.rng.random())


def _mix(xs: list[torch.Tensor], rng: np.random.Generator) -> torch.Tensor:
    return torch.stack(xs) * float(rng.random())


class _Ops:
    """A collator holding a list of ops, each with a torch generator: found deeper (a list)."""

    def __init__(self) -> None:
        self.ops = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(xs)
        for g in self.ops:
            x = x + torch.rand(x.shape, generator=g, dtype=torch.float64)
        return x


_COLLATES = {
    "object": _Crop,
    "partial": lambda: functools.partial(_mix, rng=np.random.default_rng(3)),
    "ops in a list": _Ops,
}


def _resume(make_ds, make_collate, workers: int, tmp_path, batch_size: int | None = 4, stop: int = 2):
    """The batches after ``stop`` of a straight run and of a run saved at ``stop`` and resumed with fresh objects."""
    def make():
        torch.manual_seed(0)
        np.random.seed(0)
        sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
        kw = {} if make_collate is None else {"collate_fn": make_collate()}
        loader = DataLoader(tg.SeededDataset(make_ds(), seed=0), batch_size=batch_size, sampler=sampler,
                            num_workers=workers, generator=torch.Generator(), **kw)
        return {"data": sampler, "rng": tg.RNGState()}, loader

    state, loader = make()
    straight = []
    for x in loader:
        straight.append(x.numpy().tobytes())
        state["data"].advance(len(x) if batch_size else 1)
        if len(straight) == stop:
            tg.save(str(tmp_path / "step-000000002"), state)
    state, loader = make()  # a restarted process: fresh generators
    tg.load(str(tmp_path / "step-000000002"), state)
    resumed = []
    for x in loader:
        resumed.append(x.numpy().tobytes())
        state["data"].advance(len(x) if batch_size else 1)
    assert len(straight) > stop
    return straight[stop:], resumed


def _same(straight: list[bytes], resumed: list[bytes], stop: int = 2) -> None:
    assert len(straight) == len(resumed)
    for k, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        assert a == b, f"batch {k + stop} differs after the resume"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", sorted(_COLLATES))
def test_collate_fn_own_generator_resumes(tmp_path, workers: int, kind: str) -> None:
    _same(*_resume(_Plain, _COLLATES[kind], workers, tmp_path))


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_fn_own_generator_same_with_any_workers(tmp_path, workers: int) -> None:
    # the same batch is collated the same way whatever the number of workers
    zero, _ = _resume(_Plain, _Crop, 0, tmp_path / "a")
    other, _ = _resume(_Plain, _Crop, workers, tmp_path / "b")
    assert zero == other


def _noise(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(x.shape, dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("collate", ["global", "object"])
def test_batch_size_none_collate_resumes(tmp_path, workers: int, collate: str) -> None:
    make = (lambda: _noise) if collate == "global" else _Crop
    _same(*_resume(_Plain, make, workers, tmp_path, batch_size=None, stop=5), stop=5)


class _Held(Dataset):
    """Generators kept in a deque and behind a weakref.ref."""

    keep: list = []

    def __init__(self, how: str) -> None:
        self.how = how
        if how == "deque":
            self.rngs = collections.deque([np.random.default_rng(1), random.Random(2)])
        else:
            g = torch.Generator().manual_seed(1)
            _Held.keep = [g]  # the referent lives on elsewhere (a registry)
            self.ref = weakref.ref(g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.how == "deque":
            v = self.rngs[0].random() + self.rngs[1].random()
        else:
            v = torch.rand(1, generator=self.ref(), dtype=torch.float64).item()
        return torch.full((2,), float(i) + v, dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["deque", "weakref"])
def test_generators_in_deque_or_weakref_resume(tmp_path, workers: int, how: str) -> None:
    _same(*_resume(lambda: _Held(how), None, workers, tmp_path))


class _InSet(Dataset):
    def __init__(self, kind: type) -> None:
        self.rngs = kind([np.random.default_rng(1), np.random.default_rng(2)])

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> float:
        return i


@pytest.mark.parametrize("kind", [set, frozenset])
def test_generators_in_a_set_are_warned_about(kind: type) -> None:
    with pytest.warns(RuntimeWarning, match="rngs is a .*set of generators"):
        tg.SeededDataset(_InSet(kind), seed=0)


class _LazyCrop:
    def __init__(self) -> None:
        self.rng = None

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        if self.rng is None:
            self.rng = np.random.default_rng()
        return torch.stack(xs) + float(self.rng.random())


def test_collate_fn_generator_made_on_first_use_is_warned_about() -> None:
    loader = DataLoader(tg.SeededDataset(_Plain(), seed=0), batch_size=4,
                        sampler=tg.ResumableSampler(N, seed=0, with_epoch=True), collate_fn=_LazyCrop())
    with pytest.warns(RuntimeWarning, match="collate_fn _LazyCrop made the generator"):
        list(loader)


def test_collate_with_a_prebuilt_generator_is_not_warned_about_and_untouched_by_hand_calls() -> None:
    crop = _Crop()
    ds = tg.SeededDataset(_Plain(), seed=0)
    before = crop.rng.bit_generator.state
    assert torch.equal(ds[(3, 0)], _Plain()[3])  # called by hand: no collate_fn involved
    assert crop.rng.bit_generator.state == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(DataLoader(ds, batch_size=4, sampler=tg.ResumableSampler(N, seed=0, with_epoch=True), collate_fn=crop))


def _records(epoch: int):
    return iter(range(100 * epoch, 100 * epoch + 40))


def _decode(i: int) -> torch.Tensor:
    return torch.tensor([float(i)], dtype=torch.float64) + torch.rand(1, dtype=torch.float64)


def _coll_global(xs: list[torch.Tensor]) -> torch.Tensor:
    return _stack(xs) + torch.rand(1, dtype=torch.float64) + float(np.random.rand())


def _iterable_resume(tmp_path, workers: int, collate: str, transform: bool, bs: int = 4, stop: int = 3) -> None:
    def make():
        torch.manual_seed(0)
        np.random.seed(0)
        data = tg.ResumableIterable(_records, batch_size=bs, transform=_decode if transform else None, seed=0)
        loader = DataLoader(data, batch_size=bs, num_workers=workers, generator=torch.Generator(),
                            collate_fn=_coll_global if collate == "global" else _Crop())
        return {"data": data, "rng": tg.RNGState()}, loader

    state, loader = make()
    straight = []
    for x in loader:
        straight.append(x.numpy().tobytes())
        state["data"].advance(len(x))
        if len(straight) == stop:
            tg.save(str(tmp_path / "step-000000003"), state)
    state, loader = make()
    tg.load(str(tmp_path / "step-000000003"), state)
    resumed = []
    for x in loader:
        resumed.append(x.numpy().tobytes())
        state["data"].advance(len(x))
    _same(straight[stop:], resumed, stop=stop)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("collate", ["global", "object"])
@pytest.mark.parametrize("transform", [True, False])
def test_resumable_iterable_collate_fn_resumes(tmp_path, workers: int, collate: str, transform: bool) -> None:
    _iterable_resume(tmp_path, workers, collate, transform)


def test_resumable_iterable_collate_fn_partial_last_batch_resumes(tmp_path) -> None:
    # 40 items in batches of 6: the last batch (4 items) is collated after the stream's end; resumed at batch 5 of 7
    # it is the first batch of its worker
    _iterable_resume(tmp_path, 2, "global", True, bs=6, stop=5)
