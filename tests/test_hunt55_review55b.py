"""Hunt 55 (review55b): hostile review of ``tg.SeededDataset`` and ``ResumableIterable(transform=, seed=)``
(seeded.py, owngens.py, deepgens.py, seedcore.py).

Seen before the fix (a straight run against one saved at a batch and resumed with fresh objects, every sample's
bytes compared):
- a generator kept in ``__slots__`` (``@dataclass(slots=True) class Jitter: rng: np.random.Generator``, as the
  dataset's attribute or in a list of transforms) was never found, ``__dict__`` only being read: it drew on from
  wherever it had got to, and the resume differed from its first batch on, with 0 and 2 DataLoader workers;
- a generator behind a bound method the dataset keeps (``self.transform = aug.apply``, or in a list) was never
  found: the resume differed, with 0 and 2 workers;
- a transform in a ``Compose``'s list that makes its generator on first use (fork-safe) was never found (the deeper
  paths were walked before the first sample only): never seeded, two straight runs and a resume differed;
- a NumPy ``Generator`` of the dataset whose ``spawn()`` a sample used drew children from a counter that
  seeding cannot set (read-only): they differed in each worker and after a resume, silently; now a ``RuntimeWarning``;
- a ``ResumableIterable`` transform that makes its generator on first use and changes its item in place
  (``d["x"] = d["x"] + self.rng.random()``) was run twice on the first item (the generator seeded the second
  time) but on the item the first call had already changed: the item was augmented twice, and the first item
  after a resume differed from the straight run's (two straight runs differed at their first item too).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg
from trainguard.seeded import seeded_items

N = 16
SCRIPT = Path(__file__).with_name("seeded55_run.py")
SRC = str(Path(__file__).resolve().parents[1] / "src")


@dataclass(slots=True)
class _Jitter:
    rng: np.random.Generator

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + float(self.rng.random())


class _SlotTorch:
    __slots__ = ("__gen",)  # a private slot: stored under its mangled name

    def __init__(self) -> None:
        self.__gen = torch.Generator().manual_seed(3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(1, generator=self.__gen)


class _Slotted(Dataset):
    def __init__(self) -> None:
        self.jitter = _Jitter(np.random.default_rng(0))      # an attribute holding a slotted transform
        self.pipeline = [_SlotTorch(), _Jitter(np.random.default_rng(1))]  # deeper: in a list

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((2,), float(i), dtype=torch.float64)
        for t in (self.jitter, *self.pipeline):
            x = t(x)
        return x


def _loop(workers: int, tmp_path, resume_at: int = 2) -> tuple[list, list]:
    def make():
        sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
        return sampler, DataLoader(tg.SeededDataset(_Slotted(), seed=0), batch_size=4, sampler=sampler,
                                   num_workers=workers, generator=torch.Generator())

    sampler, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        sampler.advance(len(x))
        if len(straight) == resume_at:
            tg.save(str(tmp_path / "step-000000001"), {"data": sampler})
    sampler, loader = make()  # a restarted process: fresh generators
    tg.load(str(tmp_path / "step-000000001"), {"data": sampler})
    return straight[resume_at:], list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_generators_in_slots_resume(tmp_path, workers: int) -> None:
    straight, resumed = _loop(workers, tmp_path)
    assert len(straight) == len(resumed) == 2
    for k, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        assert a.numpy().tobytes() == b.numpy().tobytes(), f"batch {k + 2} differs after the resume"


def test_slotted_generator_is_seeded_and_put_back() -> None:
    ds = _Slotted()
    before = ds.jitter.rng.bit_generator.state
    seeded = tg.SeededDataset(ds, seed=0)
    a, b = seeded[(3, 0)], seeded[(3, 0)]
    assert torch.equal(a, b)
    assert ds.jitter.rng.bit_generator.state == before  # the caller's stream untouched



class _Aug:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def apply(self, x: float) -> float:
        return x + self.rng.random()


class _BoundMethods(Dataset):
    """Transforms kept as bound methods: an attribute, and in a list."""

    def __init__(self) -> None:
        self.transform = _Aug().apply
        self.ops = [_Aug().apply]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> float:
        return self.ops[0](self.transform(float(i)))


@pytest.mark.parametrize("workers", [0, 2])
def test_generators_behind_bound_methods_resume(tmp_path, workers: int) -> None:
    def make():
        sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
        return sampler, DataLoader(tg.SeededDataset(_BoundMethods(), seed=0), batch_size=4, sampler=sampler,
                                   num_workers=workers, generator=torch.Generator())

    sampler, loader = make()
    straight = []
    for x in loader:
        straight.append(x)
        sampler.advance(len(x))
        if len(straight) == 2:
            tg.save(str(tmp_path / "step-000000001"), {"data": sampler})
    sampler, loader = make()
    tg.load(str(tmp_path / "step-000000001"), {"data": sampler})
    resumed = list(loader)
    assert [x.numpy().tobytes() for x in straight[2:]] == [x.numpy().tobytes() for x in resumed]



class _Lazy:
    """Makes its generator on first use (in each worker: fork-safe), kept in a Compose's list."""

    def __init__(self) -> None:
        self.rng = None

    def __call__(self, x: float) -> float:
        if self.rng is None:
            self.rng = np.random.default_rng()
        return x + self.rng.random()


class _Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, x: float) -> float:
        for t in self.transforms:
            x = t(x)
        return x


class _LazyDeep(Dataset):
    def __init__(self) -> None:
        self.transform = _Compose([_Lazy()])

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> float:
        return self.transform(float(i))


@pytest.mark.parametrize("workers", [0, 2])
def test_generator_made_on_first_use_in_a_compose_resumes(tmp_path, workers: int) -> None:
    def make():
        sampler = tg.ResumableSampler(N, seed=0, with_epoch=True)
        return sampler, DataLoader(tg.SeededDataset(_LazyDeep(), seed=0), batch_size=4, sampler=sampler,
                                   num_workers=workers, generator=torch.Generator())

    sampler, loader = make()
    straight = []
    for x in loader:
        straight.append(x.numpy().tobytes())
        sampler.advance(len(x))
        if len(straight) == 2:
            tg.save(str(tmp_path / "step-000000001"), {"data": sampler})
    again = [x.numpy().tobytes() for x in make()[1]]
    assert again == straight  # two straight runs agree
    sampler, loader = make()
    tg.load(str(tmp_path / "step-000000001"), {"data": sampler})
    assert [x.numpy().tobytes() for x in loader] == straight[2:]


def test_iterable_transform_in_a_compose_made_on_first_call_resumes() -> None:
    def run(state: dict | None = None, stop: int | None = None) -> tuple[list[float], dict | None]:
        data = tg.ResumableIterable(lambda e: iter(range(N)), transform=_Compose([_Lazy()]), seed=0)
        if state is not None:
            data.load_state_dict(state)
        out: list[float] = []
        for x in data:
            out.append(x)
            data.advance(1)
            if len(out) == stop:
                return out, data.state_dict()
        return out, None

    straight, _ = run()
    first, state = run(stop=5)
    rest, _ = run(state=state)
    assert first + rest == straight


class _InPlace:
    """A stream transform that makes its generator on first use and augments the item in place."""

    def __init__(self) -> None:
        self.rng = None

    def __call__(self, d: dict) -> dict:
        if self.rng is None:
            self.rng = np.random.default_rng()
        d["x"] = d["x"] + self.rng.random()
        return d


def _records(epoch: int):
    return ({"i": i, "x": float(i)} for i in range(N))


def _stream(workers: int, stop: int | None = None, state: dict | None = None) -> tuple[list[float], dict | None]:
    data = tg.ResumableIterable(_records, transform=_InPlace(), seed=0, batch_size=2)
    if state is not None:
        data.load_state_dict(state)
    out: list[float] = []
    for b in DataLoader(data, batch_size=2, num_workers=workers):
        out += b["x"].tolist()
        data.advance(len(b["i"]))
        if stop is not None and len(out) == stop:
            return out, data.state_dict()
    return out, None


@pytest.mark.parametrize("workers", [0, 2])
def test_transform_changing_its_item_in_place_resumes(workers: int) -> None:
    straight, _ = _stream(workers)
    again, _ = _stream(workers)
    assert again == straight  # two straight runs agree, the first item of each worker too
    first, state = _stream(workers, stop=6)
    rest, _ = _stream(workers, state=state)
    assert first + rest == straight


def test_uncopyable_item_with_a_generator_made_on_first_call_is_warned_about() -> None:
    items = [(0, {"x": 1.0, "lock": threading.Lock()})]  # a lock cannot be deep-copied
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = list(seeded_items(0, 0, _InPlace(), items))
    assert len(out) == 1
    assert any(issubclass(w.category, RuntimeWarning) and "could not be copied" in str(w.message) for w in got)
    with warnings.catch_warnings():  # a transform whose generator exists already: nothing copied, no warning
        warnings.simplefilter("error")
        t = _InPlace()
        t.rng = np.random.default_rng(0)
        list(seeded_items(0, 0, t, [(0, {"x": 1.0, "lock": threading.Lock()})]))


class _Spawner(Dataset):
    """Draws from a child of its own generator: ``spawn()`` counts its children, a counter seeding cannot set."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> float:
        return i + self.rng.spawn(1)[0].random()


def test_spawn_from_own_generator_is_warned_about() -> None:
    ds = tg.SeededDataset(_Spawner(), seed=0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ds[(0, 0)]
    assert any(issubclass(w.category, RuntimeWarning) and "spawn()" in str(w.message) for w in got)
    # what it warns about: the same sample of a fresh copy (a resumed process) draws differently
    assert tg.SeededDataset(_Spawner(), seed=0)[(1, 0)] != ds[(1, 0)]


@pytest.mark.parametrize(("workers", "persistent", "prefetch", "stop"), [(0, 0, 2, 3), (2, 1, 4, 12)])
def test_resumed_process_draws_every_batch_as_the_straight_run(tmp_path, workers, persistent, prefetch, stop) -> None:
    """Straight run, a run saved at batch ``stop`` (batch 12: in the second epoch) and a new process resumed from
    it: every batch's bytes equal (tests/seeded55_run.py: every kind of generator a dataset keeps)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(out: Path, *extra: str) -> list[bytes]:
        cmd = [sys.executable, str(SCRIPT), str(out), str(workers), str(persistent), str(prefetch), *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(out, "rb") as f:
            return pickle.load(f)

    straight = run(tmp_path / "straight", "-1")
    first = run(tmp_path / "first", str(stop))
    rest = run(tmp_path / "rest", "-1", str(tmp_path / "first.ckpt"))
    assert len(straight) == 20 and len(first) == stop
    bad = [i for i, (a, b) in enumerate(zip(straight, first + rest, strict=True)) if a != b]
    assert not bad, f"batches {bad} differ from the straight run's"
