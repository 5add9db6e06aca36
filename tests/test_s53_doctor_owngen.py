"""``trainguard doctor``'s "worker randomness" check did not see a dataset that draws from a generator
it keeps (``self.rng = np.random.default_rng(0)`` in ``__init__``, ``self.rng.random()`` in
``__getitem__``; ``torch.rand(..., generator=self.g)``): each DataLoader worker draws on from its own copy,
no checkpoint holds it, and a resume mid-epoch augmented differently (seen by resume53, session 53).
``tg.SeededDataset`` now seeds such generators per sample, so the fix it names works."""

from __future__ import annotations

import textwrap

from trainguard.doctor import Settings, check

OWN = """
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Aug(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 8)
        self.rng = np.random.default_rng(0)
        self.g = torch.Generator().manual_seed(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(1, generator=self.g) < 0.5:
            x = x.flip(0)
        return x * float(self.rng.uniform(0.9, 1.1))


loader = DataLoader(Aug(64), batch_size=4, num_workers=2, generator=torch.Generator())
"""


def _worker(src: str) -> list:
    return [f for f in check({}, Settings(source=textwrap.dedent(src))) if f.check == "worker randomness"]


def test_a_draw_from_the_datasets_own_generator_is_a_warning_and_seeded_dataset_is_ok() -> None:
    (f,) = _worker(OWN)
    assert f.severity == "warning", f
    assert "line 18: torch.rand(1, generator=self.g) in Aug.__getitem__" in f.message, f
    assert "a generator the dataset keeps" in f.message and "SeededDataset" in f.fix, f
    (f,) = _worker(OWN.replace("if torch.rand(1, generator=self.g) < 0.5:", "if i % 2:"))
    assert "self.rng.uniform(0.9, 1.1)" in f.message and f.severity == "warning", f
    (f,) = _worker(OWN.replace("DataLoader(Aug(64),", "DataLoader(tg.SeededDataset(Aug(64), seed=0),"))
    assert f.severity == "ok" and "generator it keeps" in f.message, f


def test_seeding_or_state_calls_on_the_own_generator_are_no_draw() -> None:
    src = OWN.replace("if torch.rand(1, generator=self.g) < 0.5:", "if self.g.initial_seed() > 0:")
    src = src.replace("float(self.rng.uniform(0.9, 1.1))", "float(self.rng.bit_generator.state['state']['state'] > 0)")
    assert _worker(src) == []


def test_a_class_attribute_generator_is_seen_too() -> None:
    src = OWN.replace("class Aug(Dataset):\n", "class Aug(Dataset):\n    rng = np.random.default_rng(0)\n\n")
    src = src.replace("        self.rng = np.random.default_rng(0)\n", "").replace("if torch.rand(1, generator=self.g) < 0.5:", "if i % 2:")
    (f,) = _worker(src)
    assert f.severity == "warning" and "self.rng.uniform(0.9, 1.1)" in f.message, f
