"""Hunt 54 (review54b): hostile review of ``tg.SeededDataset``/``ResumableIterable(transform=, seed=)`` seeding
the generators a dataset keeps of its own (seeded.py, owngens.py).

Seen before the fix, with real DataLoader loops (0 and 2 worker processes, resumed from a saved sampler):
- ``ConcatDataset([tg.SeededDataset(a), tg.SeededDataset(b)])`` failed in torch with ``TypeError: '<' not
  supported between instances of 'tuple' and 'int'``, saying nothing of what to change;
- a generator the dataset (or a transform) makes on first use, ``if self.rng is None: self.rng =
  np.random.default_rng()``, drew fresh entropy for the first sample of each worker process (every epoch,
  workers being new processes): two identical runs differed there, and so did a resumed one;
- a module global generator drawn from by a helper method of the dataset (``self.augment(x)``), inside a
  comprehension of ``__getitem__``, or by a transform object's ``__call__`` was not found: every sample drew
  from wherever it had got to, and a resume differed from its first batch on;
- a class attribute ``rng = None`` filled in on first use was never found (the class was looked at once, with
  ``None`` there);
- generators kept deeper, in a list or dict of them or in a ``Compose``'s transforms
  (``self.transform.transforms[0].rng``), were not found (documented as such): every worker drew on from its copy;
- a ``SeedSequence`` the dataset spawns from is not seedable: now a ``RuntimeWarning`` when ``SeededDataset`` is
  built (was silent).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

import trainguard as tg

N = 16
RNG = np.random.default_rng(9)


def _loop(make_ds, workers: int, tmp_path, resume_at: int = 2) -> tuple[list, list]:
    """The batches of a straight run, and of a run resumed after ``resume_at`` batches (a fresh dataset whose
    generators drew elsewhere meanwhile: a restarted process)."""
    def make():
        sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
        return sampler, DataLoader(tg.SeededDataset(make_ds(), seed=0), batch_size=4, sampler=sampler,
                                   num_workers=workers, generator=torch.Generator())

    sampler, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        sampler.advance(len(x))
        if len(straight) == resume_at:
            tg.save(str(tmp_path / "step-000000001"), {"data": sampler})
    RNG.random(int(np.random.default_rng().integers(1, 9)))  # the module global drew elsewhere meanwhile
    sampler, loader = make()
    tg.load(str(tmp_path / "step-000000001"), {"data": sampler})
    return straight, list(loader)


def _assert_resumes(straight: list, resumed: list, resume_at: int = 2) -> None:
    assert len(resumed) == len(straight) - resume_at
    for k, (a, b) in enumerate(zip(straight[resume_at:], resumed, strict=True)):
        assert torch.equal(a, b), f"batch {k + resume_at} differs after the resume"


class _Own(Dataset):
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return N // 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


def test_concat_of_seeded_datasets_says_what_to_do() -> None:
    sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
    bad = ConcatDataset([tg.SeededDataset(_Own(), seed=0), tg.SeededDataset(_Own(), seed=0)])
    with pytest.raises(TypeError, match=r"tg\.SeededDataset\(ConcatDataset\(\[a, b\]\), seed=0\)"):
        list(DataLoader(bad, batch_size=4, sampler=sampler))
    with pytest.raises(TypeError, match=r"SeededDataset must be the DataLoader's dataset"):
        list(DataLoader(Subset(tg.SeededDataset(_Own(), seed=0), list(range(8))), batch_size=4,
                        sampler=tg.ResumableSampler(8, seed=0, with_epoch=True)))
    # the order it asks for works
    good = tg.SeededDataset(ConcatDataset([_Own(), _Own()]), seed=0)
    assert torch.cat(list(DataLoader(good, batch_size=4, sampler=sampler))).shape == (N, 2)


class _Lazy(Dataset):
    """Makes its generator on first use, in the process that computes the sample (each worker)."""

    def __init__(self) -> None:
        self.rng = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rng is None:
            self.rng = np.random.default_rng()  # fresh entropy
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


class _ClassLazy(Dataset):
    rng = None  # filled in on first use, on the class

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if type(self).rng is None:
            type(self).rng = np.random.default_rng()
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", [_Lazy, _ClassLazy])
def test_generator_made_on_first_use_resumes(tmp_path, workers: int, kind: type) -> None:
    kind.rng = None
    straight, resumed = _loop(kind, workers, tmp_path)
    kind.rng = None
    again, _ = _loop(kind, workers, tmp_path / "again")
    for k, (a, b) in enumerate(zip(straight, again, strict=True)):
        assert torch.equal(a, b), f"batch {k} differs between two identical runs"
    _assert_resumes(straight, resumed)


class _LazyTransform:
    def __init__(self) -> None:
        self.rng = None

    def __call__(self, i: int) -> torch.Tensor:
        if self.rng is None:
            self.rng = np.random.default_rng()
        return torch.tensor([float(i), float(self.rng.random())], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_transform_generator_made_on_first_call_every_item(workers: int) -> None:
    def run() -> torch.Tensor:
        data = tg.ResumableIterable(lambda epoch: iter(range(N)), batch_size=4, transform=_LazyTransform(), seed=0)
        return torch.cat(list(DataLoader(data, batch_size=4, num_workers=workers)))

    a, b = run(), run()
    assert len(a) == N
    assert torch.equal(a, b), "an item drew from a generator made unseeded on the first call"


class _HelperMethod(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.augment(i)

    def augment(self, i: int) -> torch.Tensor:  # a helper method draws from the module global
        return torch.tensor([float(i), float(RNG.random())], dtype=torch.float64)


class _Comprehension(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), *[float(RNG.random()) for _ in range(2)]], dtype=torch.float64)


class _Jitter:
    def __call__(self, x: float) -> float:
        return x + float(RNG.normal())


class _TransformObject(Dataset):
    def __init__(self) -> None:
        self.transform = _Jitter()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), self.transform(float(i))], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", [_HelperMethod, _Comprehension, _TransformObject])
def test_module_global_drawn_outside_getitem_resumes(tmp_path, workers: int, kind: type) -> None:
    _assert_resumes(*_loop(kind, workers, tmp_path))


def test_global_generators_untouched_with_no_workers() -> None:
    """Saved once per batch now, not around each sample: the training process's streams are still as they were."""
    import random

    class _Draws(Dataset):
        def __init__(self) -> None:
            self.rng = np.random.mtrand._rand  # the global one, as an attribute: seeded and put back once

        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([random.random(), np.random.rand(), self.rng.rand(), torch.rand(1).item()],
                                dtype=torch.float64)

    def streams() -> tuple:
        return random.random(), np.random.rand(), torch.rand(1).item()

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = streams()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    loader = DataLoader(tg.SeededDataset(_Draws(), seed=0), batch_size=4,
                        sampler=tg.ResumableSampler(N, seed=0, with_epoch=True), generator=torch.Generator())
    batches = list(loader)
    assert streams() == expected
    assert len({tuple(r.tolist()) for b in batches for r in b}) == N


class _Flip:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, x: float) -> float:
        return (x if self.rng.random() < 0.5 else -x) + float(self.rng.random())


class _Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, x: float) -> float:
        for t in self.transforms:
            x = t(x)
        return x


class _Composed(Dataset):
    """Generators kept deeper: in a Compose's list of transforms, in a list of generators, in a dict."""

    def __init__(self) -> None:
        self.transform = _Compose([_Flip(1), _Flip(2)])
        self.rngs = [np.random.default_rng(3), np.random.default_rng(4)]
        self.by_name = {"noise": torch.Generator().manual_seed(5)}
        self.transform.transforms[0].rng.random(int(np.random.default_rng().integers(1, 9)))  # drew elsewhere

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), self.transform(float(i)), float(self.rngs[i % 2].random()),
                             float(torch.rand(1, generator=self.by_name["noise"]))], dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_generators_kept_deeper_resume(tmp_path, workers: int) -> None:
    straight, resumed = _loop(_Composed, workers, tmp_path)
    _assert_resumes(straight, resumed)
    again, _ = _loop(_Composed, workers, tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(straight, again, strict=True))


def test_iterable_transform_compose_resumes(tmp_path) -> None:
    def make():
        tf = _Compose([_Flip(1), _Flip(2)])
        tf.transforms[1].rng.random(int(np.random.default_rng().integers(1, 9)))  # drew elsewhere
        data = tg.ResumableIterable(lambda epoch: iter(range(N)), batch_size=4,
                                    transform=lambda i: torch.tensor([float(i), tf(float(i))], dtype=torch.float64),
                                    seed=0)
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
    _assert_resumes(straight, list(loader))


class _Spawns(Dataset):
    def __init__(self) -> None:
        self.ss = np.random.SeedSequence(0)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(np.random.default_rng(self.ss.spawn(1)[0]).random())])


def test_seed_sequence_kept_by_the_dataset_is_warned_about() -> None:
    with pytest.warns(RuntimeWarning, match=r"ss is a numpy SeedSequence.*default_rng\(\[seed, index\]\)"):
        tg.SeededDataset(_Spawns(), seed=0)
