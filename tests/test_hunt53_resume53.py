"""Hunt 53 (resume53): a dataset that draws its augmentation from generators of its own
(``self.rng = np.random.default_rng(0)``, ``random.Random``, a ``torch.Generator``, or one kept by its
transform object) resumes bit-identically under ``tg.SeededDataset``.

Seen before the fix (a real training loop, /tmp script: AdamW, ``ResumableSampler(with_epoch=True)``,
SIGKILL at step 23 after the save of step 20, resumed): the losses differed from the first resumed step
on and so did every weight, with 2 DataLoader workers and with none: ``SeededDataset`` seeded only the
global generators, and the dataset's own ones drew on from wherever the worker's copy (or the training
process's, which ``RNGState`` does not save) had got to.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg


class _Jitter:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(5)  # a transform object's own generator

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + float(self.rng.normal())


class OwnRng(Dataset):
    def __init__(self) -> None:
        self.x = torch.arange(24.0)
        self.rng = np.random.default_rng(0)
        self.legacy = np.random.RandomState(3)
        self.py = random.Random(1)
        self.gen = torch.Generator().manual_seed(2)
        self.transform = _Jitter()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        draws = [float(self.rng.random()), float(self.legacy.rand()), self.py.random(),
                 float(torch.rand(1, generator=self.gen))]
        return torch.tensor([self.transform(self.x[i]).item(), *draws], dtype=torch.float64)


def test_own_generators_give_each_sample_its_own_draws() -> None:
    ds = tg.SeededDataset(OwnRng(), seed=0)
    first = ds[(7, 1)]
    for k in range(5):  # whatever was drawn before, by other samples
        ds[(k, 1)]
    again = ds[(7, 1)]
    assert torch.equal(first, again), "the same sample of the same epoch drew differently"
    assert not torch.equal(ds[(7, 1)], ds[(7, 2)])  # another epoch: other draws
    assert not torch.equal(ds[(7, 1)], ds[(8, 1)])  # another sample: other draws
    row = ds[(3, 0)]
    assert len(set(row[1:].tolist())) == 4  # each generator its own stream


def test_own_generators_left_as_they_were_in_the_training_process() -> None:
    base = OwnRng()
    ds = tg.SeededDataset(base, seed=0)
    before = base.rng.bit_generator.state, base.py.getstate(), base.gen.get_state(), base.legacy.get_state()[1].copy()
    ds[(2, 0)]
    assert base.rng.bit_generator.state == before[0] and base.py.getstate() == before[1]
    assert torch.equal(base.gen.get_state(), before[2]) and (base.legacy.get_state()[1] == before[3]).all()


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_with_own_generators(tmp_path, workers: int) -> None:
    def make():
        sampler = tg.ResumableSampler(24, seed=0, with_epoch=True)
        loader = DataLoader(tg.SeededDataset(OwnRng(), seed=0), batch_size=4, sampler=sampler,
                            num_workers=workers, generator=torch.Generator())
        return sampler, loader

    sampler, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        sampler.advance(len(x))
        if len(straight) == 2:
            tg.save(str(tmp_path / "step-000000002"), {"data": sampler})
    sampler, loader = make()  # a restarted process, in effect
    tg.load(str(tmp_path / "step-000000002"), {"data": sampler})
    resumed = list(loader)
    assert len(resumed) == len(straight) - 2
    for k, (a, b) in enumerate(zip(straight[2:], resumed, strict=True)):
        assert torch.equal(a, b), f"batch {k + 2} differs after the resume"


class _Decode:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __call__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


def _closure_transform():
    rng = random.Random(4)
    inner = _Decode()  # its generator: one level down

    def decode(i: int) -> torch.Tensor:
        return torch.cat([inner(i), torch.tensor([rng.random()], dtype=torch.float64)])
    return decode


@pytest.mark.parametrize("kind", ["object", "closure"])
@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_transform_with_own_generators_resumes(tmp_path, kind: str, workers: int) -> None:
    def make():
        tf = _Decode() if kind == "object" else _closure_transform()
        data = tg.ResumableIterable(lambda epoch: iter(range(24)), batch_size=4, transform=tf, seed=0)
        return data, DataLoader(data, batch_size=4, num_workers=workers)

    data, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        data.advance(len(x))
        if len(straight) == 2:
            tg.save(str(tmp_path / "step-000000002"), {"data": data})
    data, loader = make()
    tg.load(str(tmp_path / "step-000000002"), {"data": data})
    resumed = list(loader)
    assert len(resumed) == len(straight) - 2
    for k, (a, b) in enumerate(zip(straight[2:], resumed, strict=True)):
        assert torch.equal(a, b), f"batch {k + 2} differs after the resume"


_GLOBAL_RNG = np.random.default_rng(9)


def _global_transform(i: int) -> torch.Tensor:  # draws from a module global of its own
    return torch.tensor([float(i), float(_GLOBAL_RNG.random())], dtype=torch.float64)


def test_iterable_transform_drawing_from_a_module_global_resumes(tmp_path) -> None:
    def make():
        data = tg.ResumableIterable(lambda epoch: iter(range(24)), batch_size=4, transform=_global_transform, seed=0)
        return data, DataLoader(data, batch_size=4, num_workers=2)

    data, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        data.advance(len(x))
        if len(straight) == 2:
            tg.save(str(tmp_path / "step-000000002"), {"data": data})
    data, loader = make()
    tg.load(str(tmp_path / "step-000000002"), {"data": data})
    resumed = list(loader)
    assert all(torch.equal(a, b) for a, b in zip(straight[2:], resumed, strict=True))


class GlobalRng(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(_GLOBAL_RNG.random())], dtype=torch.float64)


def test_dataset_drawing_from_a_module_global_gets_per_sample_draws() -> None:
    ds = tg.SeededDataset(GlobalRng(), seed=0)
    first = ds[(5, 0)]
    ds[(6, 0)]
    assert torch.equal(first, ds[(5, 0)])
