"""``tests/test_hunt55_review55b.py``'s training process: ``python seeded55_run.py OUT WORKERS PERSISTENT PREFETCH
STOP [RESUME_FROM]`` runs 2 epochs of a ``tg.SeededDataset`` loader whose dataset draws from every kind of
generator (the global ones, its own attributes, a class attribute, one made on first use, a module global a helper
method names, a ``@dataclass(slots=True)`` transform and a torch generator in a ``Compose``'s list), with a
``collate_fn`` and a training step drawing from the global generators. It pickles every batch's bytes to OUT;
at batch STOP (-1: never) it saves ``OUT.ckpt`` and exits; RESUME_FROM: the checkpoint to load first."""

import pickle
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import trainguard as tg

RNG = np.random.default_rng(5)


@dataclass(slots=True)
class Jit:
    rng: np.random.Generator

    def __call__(self, x):
        return x + self.rng.random()


class Compose:
    def __init__(self, ts):
        self.transforms = ts

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Flip:
    def __init__(self):
        self.g = torch.Generator().manual_seed(1)

    def __call__(self, x):
        return x * (1 if torch.rand(1, generator=self.g) < 0.5 else -1)


class DS(Dataset):
    cls_rng = np.random.RandomState(3)

    def __init__(self):
        self.lazy = None
        self.rng = random.Random(4)
        self.t = Compose([Jit(np.random.default_rng(1)), Flip()])

    def __len__(self):
        return 40

    def helper(self, x):
        return x + RNG.random()

    def __getitem__(self, i):
        if self.lazy is None:
            self.lazy = np.random.default_rng()
        x = torch.full((3,), float(i), dtype=torch.float64)
        x = x + random.random() + np.random.rand() + torch.rand(1, dtype=torch.float64)
        x = x + self.lazy.random() + self.rng.random() + self.cls_rng.rand()
        return self.t(self.helper(x))


def collate(xs):
    x = torch.stack(xs)
    return x * (torch.rand(x.shape, dtype=torch.float64) > 0.3) + np.random.rand()


def main() -> None:
    out, w, persist, prefetch, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    sampler = tg.ResumableSampler(40, seed=0, with_epoch=True)
    state = {"data": sampler, "rng": tg.RNGState()}
    if len(sys.argv) > 6:
        tg.load(sys.argv[6], state)
    kw = {"persistent_workers": persist, "prefetch_factor": prefetch} if w else {}
    loader = DataLoader(tg.SeededDataset(DS(), seed=0), batch_size=4, sampler=sampler, num_workers=w,
                        collate_fn=collate, generator=torch.Generator(), **kw)
    got, n = [], 0
    while sampler.epoch < 2:
        for x in loader:
            y = x * torch.rand(1, dtype=torch.float64)  # the training step draws from the global generator
            got.append(y.numpy().tobytes())
            sampler.advance(len(x))
            n += 1
            if n == stop:
                tg.save(out + ".ckpt", state)
                break
        else:
            sampler.next_epoch()
            continue
        break
    with open(out, "wb") as f:
        pickle.dump(got, f)


if __name__ == "__main__":
    main()
