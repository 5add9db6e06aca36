"""``tg.RNGState``: every random generator a training step draws from, as one entry of the state.

``api.save`` (through ``capture``) calls its ``state_dict()`` on every rank; ``loader._load``
calls its ``load_state_dict()`` on every rank whose saved state exists, else ``reseed_for_rank``.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from . import genstate
from .errors import CheckpointError, CorruptCheckpointError
from .permanent import mark
from .userframe import user_stacklevel


class RNGState:
    """Every random generator a training step draws from: Python ``random``, NumPy's global
    generator, torch CPU, and each CUDA device once this process has initialised CUDA (before,
    they hold only the seed ``torch.manual_seed`` queued, queued again by a restarted program;
    reading them would give a CPU-trained process a CUDA context, which its forks cannot use).

    Rank-local: in a multi-rank save every rank stores its own; see ``docs/distributed.md`` for
    what happens when the world size changes (rank r takes saved rank r when it exists,
    otherwise its generators are re-seeded deterministically from ``(reseed, rank, checkpoint step)``).

    ``generators={"name": g, ...}``: the explicit generators the loop draws from too, saved and
    restored with the global ones (``torch.Generator``, CPU or CUDA; ``numpy.random.Generator``;
    ``numpy.random.RandomState``; ``random.Random``), each under its name (``genstate.py``).
    """

    trainguard_rank_local = True

    def __init__(self, *, reseed: int = 0, generators: Mapping[str, Any] | None = None) -> None:
        if isinstance(reseed, bool) or not hasattr(reseed, "__index__"):
            raise TypeError(f"RNGState(reseed={reseed!r}): pass an int seed (used when the world size grows)")
        self.reseed = int(reseed)
        self.generators = genstate.check_generators(generators)

    def state_dict(self) -> dict[str, Any]:
        algo, keys, pos, has_gauss, cached = np.random.get_state()
        sd: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"algo": str(algo), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_initialized():  # not is_available(): reading them creates a CUDA context (class docstring)
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        if self.generators:
            sd["generators"] = {name: genstate.state_of(g) for name, g in self.generators.items()}
        return sd

    def check_generators(self, skeleton: Any, strict: bool) -> None:
        """``loader._load``, before anything of the load is read: the generators against the saved
        entry (``genstate.check_saved``); with ``strict=False`` one it has no state for is warned
        about and left as it is by the ``load_state_dict`` that follows. An entry saved from
        something else (a dict of seeds) is refused as a state that does not fit: no older
        checkpoint would fit either (it read as a corrupt one, and a restore tried them all)."""
        if skeleton is not None and not (isinstance(skeleton, Mapping) and {"python", "numpy", "torch_cpu"} <= set(skeleton)):
            what = sorted(map(str, skeleton))[:8] if isinstance(skeleton, Mapping) else type(skeleton).__name__
            raise mark(CheckpointError(
                f"the state's tg.RNGState() meets a checkpoint entry saved from something else (it holds {what}, not the "
                "python, numpy and torch_cpu states RNGState saves); load it into what saved it, or leave it out with only="))
        saved = skeleton.get("generators") if isinstance(skeleton, Mapping) else None
        if missing := genstate.check_saved(self.generators, saved, strict):
            warnings.warn(f"RNGState: the checkpoint holds no state for generator(s) {missing}; left as they are "
                          "(strict=False)", stacklevel=user_stacklevel())  # 4 named dist.py's wrapper
        if extra := sorted(set(saved) - set(self.generators)) if isinstance(saved, Mapping) else []:
            # A resume script that builds its RNGState without them: they went on from their seed, silently.
            warnings.warn(f"RNGState: the checkpoint holds the state of generator(s) {extra}, which this RNGState does "
                          "not name: they are not restored and draw as after a fresh start. Pass them as at save time "
                          f"(RNGState(generators={{{extra[0]!r}: g, ...}})), or ignore this if they were dropped on purpose",
                          stacklevel=user_stacklevel())
        self._lenient = not strict

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        strict, self._lenient = not getattr(self, "_lenient", False), False
        genstate.check_saved(self.generators, state_dict.get("generators"), strict)  # before anything changes
        try:
            random.setstate(_as_python_rng(state_dict["python"]))
            n = state_dict["numpy"]
            np.random.set_state(
                (n["algo"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
            )
            torch.set_rng_state(state_dict["torch_cpu"].to("cpu", torch.uint8))
            genstate.load(self.generators, state_dict.get("generators", {}))
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as e:
            # Saved by RNGState itself: a state that does not parse is a damaged checkpoint (a word of the python
            # state below 0 or past an unsigned long, a numpy pos past a C long: OverflowError).
            raise CorruptCheckpointError(f"RNGState: the saved RNG state is malformed ({type(e).__name__}: {e})") from e
        cuda = state_dict.get("cuda")
        if cuda and torch.cuda.is_available():
            count = torch.cuda.device_count()
            if len(cuda) != count:
                warnings.warn(
                    f"checkpoint has RNG state for {len(cuda)} CUDA devices, this process sees {count}; "
                    f"restoring the first {min(len(cuda), count)}",
                    stacklevel=2,
                )
            for i, s in enumerate(cuda[:count]):
                torch.cuda.set_rng_state(s.to("cpu", torch.uint8), i)
        elif cuda:
            warnings.warn("checkpoint has CUDA RNG state but CUDA is not available; it is ignored", stacklevel=2)

    def reseed_for_rank(self, rank: int, step: int = 0) -> None:
        """Seed every generator deterministically from ``(reseed, rank, step)``; the loader calls it
        on a rank that has no saved state (the world size grew), with the checkpoint's ``step``:
        the same checkpoint gives the same streams, and a rank added again at a later growth draws
        a new stream instead of replaying the one it had after the first growth."""
        seed = int(np.random.SeedSequence([self.reseed % 2**63, int(rank), int(step) % 2**63]).generate_state(1)[0])
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        genstate.reseed(self.generators, seed)


def _as_python_rng(v: Any) -> tuple:
    version, internal, gauss = v
    return (int(version), tuple(int(x) for x in internal), gauss)
