"""The seeds of ``tg.SeededDataset``, ``ResumableSampler`` and ``ResumableIterable``: a seed argument checked
(:func:`seed_int`), a 64-bit seed from a few ints (:func:`seed_of`), and the global generators seeded
(:func:`seed_globals`) or saved and restored (:func:`save_globals`, :func:`restore_globals`) around a call, in the
process that makes the draws (a DataLoader worker, or the training process)."""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def seed_int(seed: Any, who: str) -> int:
    """``ResumableSampler``/``SeededDataset``: ``int(seed)``, or a TypeError that names the argument (``seed=None``,
    an unset ``args.seed``: int()'s "argument must be a string ... not 'NoneType'" before)."""
    if isinstance(seed, bool | np.bool_) or (isinstance(seed, torch.Tensor) and seed.dtype == torch.bool):
        # seed=True is an int to Python (1): a flag passed where the seed goes (``seed=args.shuffle``)
        raise TypeError(f"{who}(seed={seed!r}): a bool is not a seed; pass an int seed, the same on every rank "
                        "and at every restart (e.g. seed=0)")
    try:
        return operator.index(seed)  # an int, NumPy's or a tensor's (an integer dtype)
    except TypeError:
        pass
    try:
        got = int(seed)
        # int() truncates: seed=1.7 and seed=1.2 gave one order, as two runs "with different seeds" (an int
        # string, "7" from argv, and a whole float, 3.0 from a config, are what they say).
        whole = isinstance(seed, str) or float(seed) == got
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise TypeError(f"{who}(seed={seed!r}): pass an int seed (a whole number, not truncated), the same on every "
                        "rank and at every restart (e.g. seed=0)") from None
    return got


def seed_of(*words: int) -> int:
    """A 64-bit seed from a few non-negative ints (``SeedSequence``: distinct tuples, unrelated seeds)."""
    got = np.random.SeedSequence([int(w) % 2**64 for w in words]).generate_state(2, np.uint32)
    return int(got[0]) | int(got[1]) << 32


# NumPy's key gets this third word: ``random.seed(seed)`` seeds Python's MT19937 with ``init_by_array`` of
# the seed's 32-bit words, which is what ``np.random.seed([lo, hi])`` does too, so both generators drew the
# same numbers (``random.random() == np.random.rand()`` for every sample; torch seeds them apart in its
# DataLoader workers, ``_generate_state``). Python's key never has a third word: every seed here is < 2**64.
_NUMPY_KEY = 0x6E756D70


def seed_globals(seed: int) -> None:
    """Seed Python ``random``, NumPy's global generator and torch's CPU generator from ``seed``, each to
    its own stream (``seeded_call``, ``SeededDataset.__getitems__``)."""
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, _NUMPY_KEY])
    torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed would reseed every CUDA device too


def seeded_call(seed: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the global generators seeded from ``seed``, and their states before the
    call restored after it."""
    saved = save_globals()
    try:
        seed_globals(seed)
        return fn(*args)
    finally:
        restore_globals(saved)


def save_globals() -> tuple[Any, Any, Any]:
    """The states of Python ``random``, NumPy's global generator and torch's CPU generator (NumPy's takes
    ~30 us: its 624 words are copied one by one; ``SeededDataset`` saves once per batch)."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def restore_globals(saved: tuple[Any, Any, Any]) -> None:
    """Put back what :func:`save_globals` returned."""
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])
