"""What ``tg.SeededDataset`` costs a sample (CPU time of ``__getitems__``, batches of 32), for a dataset
without generators of its own and one with one (``self.rng = np.random.default_rng(0)``), in the training
process (``num_workers=0``: the global generators saved and put back) and as in a DataLoader worker
(``torch.utils.data.get_worker_info`` answering, for the time of the run: seeded for the collate_fn instead).
``--fetch`` calls it as torch's fetcher does (``_MapDatasetFetcher.fetch``: the batch's ``collate_fn`` looked up and
its own generators seeded, ``collategens``), with torch's ``default_collate`` ("fetch") and with a collator object
keeping its own NumPy generator ("fetch+own": the collate call's own time included).

    PYTHONPATH=src python -m bench.seeded_cost [--samples 15360] [--reps 3]
    PYTHONPATH=/path/to/other/src:. python -m bench.seeded_cost      # another version, for comparison

Each figure: microseconds of CPU time (``time.process_time``) a sample, one per rep. Run it on a quiet
machine: a shared 2-core VM varies by +-15 %.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset
from torch.utils.data._utils.fetch import _MapDatasetFetcher

import trainguard as tg


class Plain(Dataset):
    def __init__(self) -> None:
        self.x = torch.arange(30000.0)
        self.files = [f"f{i}" for i in range(1000)]
        self.scale = 2.0
        self.transform = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] * self.scale + random.random()


class Own(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] * self.scale + self.rng.random()


class Mix:
    """A collator object with its own generator."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __call__(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs if self.rng.random() < 2 else []


def per_sample(cls: type, worker: bool, n: int, bs: int = 32, collate: Any = None) -> float:
    ds = tg.SeededDataset(cls(), seed=0)
    batches = [[(i, 0) for i in range(b, b + bs)] for b in range(0, n, bs)]
    get = ds.__getitems__ if collate is None else _MapDatasetFetcher(ds, True, collate, False).fetch
    real = tud.get_worker_info
    tud.get_worker_info = (lambda: object()) if worker else real  # SeededDataset asks torch.utils.data
    try:
        t = time.process_time()
        for keys in batches:
            get(keys)
        return (time.process_time() - t) / n * 1e6
    finally:
        tud.get_worker_info = real


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=15360)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fetch", action="store_true", help="also through torch's fetcher, with a collate_fn")
    a = p.parse_args()
    got: dict[tuple[str, str], list[float]] = {}
    collates = {"": None, **({"fetch": tud.default_collate, "fetch+own": Mix()} if a.fetch else {})}
    for _ in range(a.reps):
        for cls in (Plain, Own):
            for worker in (False, True):
                for how, collate in collates.items():
                    where = ("worker" if worker else "main") + (f" {how}" if how else "")
                    got.setdefault((cls.__name__, where), []).append(per_sample(cls, worker, a.samples, collate=collate))
    for (name, where), v in got.items():
        print(f"{name:6s} {where:16s} us/sample: " + " ".join(f"{x:.1f}" for x in v))


if __name__ == "__main__":
    main()
