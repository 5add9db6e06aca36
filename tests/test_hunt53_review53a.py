"""Hunt 53 (review53a): review of ``seeded.own_generators``/``seeded_own`` (the generators a dataset or a
``ResumableIterable`` transform keeps of its own, seeded around each sample and put back).

Seen before the fix, each with real DataLoader runs:
- one generator reachable by two paths of a transform (``self.rng`` and ``self.crop.rng = self.rng``) was
  seeded twice and put back to the first seeding's state: with ``num_workers=0`` the training process's
  generator was left changed after every item (``SeededDataset`` de-duplicated, the iterable path did not);
- an attribute whose class has ``__slots__`` and a ``__getattr__`` answering every name (a config object)
  made every sample raise ``AttributeError: 'NoneType' object has no attribute 'items'`` (it worked before
  the generators were looked for);
- a ``functools.partial(augment, rng=rng)`` transform's generator and a class attribute generator
  (``class D: rng = np.random.default_rng(0)``) were not found: a resume drew other augmentation, silently.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg


class _Crop:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng


class _Shared:
    """A transform whose generator is shared with its sub-transform (two paths, one generator)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(5)
        self.crop = _Crop(self.rng)

    def __call__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


def test_iterable_transform_generator_by_two_paths_put_back() -> None:
    tf = _Shared()
    before = tf.rng.bit_generator.state
    data = tg.ResumableIterable(lambda epoch: iter(range(8)), batch_size=4, transform=tf, seed=0)
    batches = list(DataLoader(data, batch_size=4, num_workers=0))
    assert len(batches) == 2
    assert tf.rng.bit_generator.state == before, "the transform's generator was not put back after the items"


class _Config:
    __slots__ = ("values",)

    def __init__(self, values: dict) -> None:
        self.values = values

    def __getattr__(self, name: str):  # every name answers: None for a missing key
        return self.values.get(name)


class _WithConfig(Dataset):
    def __init__(self) -> None:
        self.cfg = _Config({"scale": 2.0})
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i * self.cfg.scale, float(self.rng.random())], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_attribute_with_slots_and_getattr_loads(workers: int) -> None:
    sampler = tg.ResumableSampler(8, seed=0, with_epoch=True)
    loader = DataLoader(tg.SeededDataset(_WithConfig(), seed=0), batch_size=4, sampler=sampler,
                        num_workers=workers, generator=torch.Generator())
    batches = list(loader)
    assert len(batches) == 2 and sorted(torch.cat(batches)[:, 0].tolist()) == [2.0 * i for i in range(8)]


def _augment(i: int, rng: np.random.Generator) -> torch.Tensor:
    return torch.tensor([float(i), float(rng.random())], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_partial_transform_generator_resumes(tmp_path, workers: int) -> None:
    def make():
        rng = np.random.default_rng(7)
        rng.random(int(np.random.default_rng().integers(1, 50)))  # where it got to: another one each process
        data = tg.ResumableIterable(lambda epoch: iter(range(16)), batch_size=4,
                                    transform=functools.partial(_augment, rng=rng), seed=0)
        return data, DataLoader(data, batch_size=4, num_workers=workers)

    data, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        data.advance(len(x))
        if len(straight) == 1:
            tg.save(str(tmp_path / "step-000000001"), {"data": data})
    data, loader = make()
    tg.load(str(tmp_path / "step-000000001"), {"data": data})
    resumed = list(loader)
    assert len(resumed) == 3
    for k, (a, b) in enumerate(zip(straight[1:], resumed, strict=True)):
        assert torch.equal(a, b), f"batch {k + 1} differs after the resume"


class _ClassRng(Dataset):
    gen = random.Random(3)  # a class attribute: self.gen in __getitem__

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), self.gen.random()], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_class_attribute_generator_resumes(tmp_path, workers: int) -> None:
    def make():
        _ClassRng.gen.random()  # the class's generator has drawn elsewhere meanwhile
        sampler = tg.ResumableSampler(16, seed=0, with_epoch=True)
        loader = DataLoader(tg.SeededDataset(_ClassRng(), seed=0), batch_size=4, sampler=sampler,
                            num_workers=workers, generator=torch.Generator())
        return sampler, loader

    sampler, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        sampler.advance(len(x))
        if len(straight) == 1:
            tg.save(str(tmp_path / "step-000000001"), {"data": sampler})
    sampler, loader = make()
    tg.load(str(tmp_path / "step-000000001"), {"data": sampler})
    resumed = list(loader)
    assert len(resumed) == 3
    for k, (a, b) in enumerate(zip(straight[1:], resumed, strict=True)):
        assert torch.equal(a, b), f"batch {k + 1} differs after the resume"


def test_generator_shared_with_the_loop_untouched_with_no_workers() -> None:
    shared = torch.Generator().manual_seed(11)

    class _Uses(Dataset):
        def __init__(self) -> None:
            self.gen = shared

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.rand(2, generator=self.gen)

    expected = torch.rand(3, generator=torch.Generator().manual_seed(11))
    sampler = tg.ResumableSampler(8, seed=0, with_epoch=True)
    for _ in DataLoader(tg.SeededDataset(_Uses(), seed=0), batch_size=4, sampler=sampler, num_workers=0):
        pass
    assert torch.equal(torch.rand(3, generator=shared), expected)


class _Failing(Dataset):
    def __init__(self) -> None:
        self.rng = np.random.default_rng(1)
        self.py = random.Random(2)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> float:
        self.rng.random()
        self.py.random()
        raise KeyError(i)


def test_generators_put_back_when_getitem_raises() -> None:
    base = _Failing()
    before = base.rng.bit_generator.state, base.py.getstate()
    with pytest.raises(KeyError):
        tg.SeededDataset(base, seed=0)[(1, 0)]
    assert (base.rng.bit_generator.state, base.py.getstate()) == before


class _Own(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(n)
        self.transform = _Shared()  # its generator two levels down from a Subset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.cat([self.transform(i), torch.tensor([float(self.rng.random())], dtype=torch.float64)])


@pytest.mark.parametrize("wrap", ["concat", "subset"])
def test_wrapped_datasets_generators_found(wrap: str) -> None:
    base = torch.utils.data.ConcatDataset([_Own(8), _Own(8)]) if wrap == "concat" else \
        torch.utils.data.Subset(_Own(8), list(range(8)))
    ds = tg.SeededDataset(base, seed=0)
    first = ds[(5, 0)]
    for k in range(4):  # other samples drew meanwhile
        ds[(k, 0)]
    assert torch.equal(first, ds[(5, 0)]), "the same sample of the same epoch drew differently"


class _Lazy:
    """A transform that makes its generator on its first call (in the process that runs it)."""

    def __init__(self) -> None:
        self.rng = None

    def __call__(self, i: int) -> torch.Tensor:
        if self.rng is None:
            self.rng = np.random.default_rng()  # fresh entropy: its first draw cannot be reproduced
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


def test_iterable_transform_generator_made_on_first_call_seeded_from_then_on() -> None:
    def run() -> torch.Tensor:
        data = tg.ResumableIterable(lambda epoch: iter(range(12)), batch_size=4, transform=_Lazy(), seed=0)
        return torch.cat(list(DataLoader(data, batch_size=4, num_workers=0)))

    a, b = run(), run()
    assert len(a) == 12
    assert torch.equal(a[1:], b[1:]), "items after the first drew from an unseeded generator"
