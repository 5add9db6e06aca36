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
        sd: dict[str, Any] = {"python": random.getstate(), "numpy": _numpy_global(), "torch_cpu": torch.get_rng_state()}
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
        if why := _other_numpy_kind(skeleton.get("numpy") if isinstance(skeleton, Mapping) else None):
            raise mark(CheckpointError(why))
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
        if why := _other_numpy_kind(state_dict.get("numpy")):
            raise mark(CheckpointError(why))
        try:  # every state parsed and tried on a fresh generator first: one that fails leaves all as they were
            python = _as_python_rng(state_dict["python"])
            random.Random().setstate(python)
            numpy = _numpy_parsed(state_dict["numpy"])
            cpu = state_dict["torch_cpu"].to("cpu", torch.uint8)
            torch.Generator().set_state(cpu)
            generators = genstate.parse(self.generators, state_dict.get("generators", {}))
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as e:
            # Saved by RNGState itself: a state that does not parse is a damaged checkpoint (a word of the python
            # state below 0 or past an unsigned long, a numpy pos past a C long: OverflowError). Nothing was set:
            # restore's fallback counts this entry as not loaded (partread.py), and an older checkpoint without
            # it (strict=False) would otherwise leave Python's generator at the newer one's state.
            raise CorruptCheckpointError(f"RNGState: the saved RNG state is malformed ({type(e).__name__}: {e})") from e
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        genstate.load(generators)
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


def _numpy_global() -> dict[str, Any]:
    """NumPy's global generator (``np.random.normal()``...): MT19937's legacy tuple as before, or, when the
    script made the global functions draw from another bit generator (``np.random.set_bit_generator(PCG64())``,
    NumPy 1.25+), whose ``get_state()`` is then a dict, that state under ``"bit_generator"`` (before,
    unpacking it as the tuple failed the save: "too many values to unpack")."""
    if _global_kind() != "MT19937":  # get_state() would warn, then give the dict of legacy=False
        return {"bit_generator": genstate.to_plain(np.random.get_state(legacy=False))}
    algo, keys, pos, has_gauss, cached = np.random.get_state()
    return {"algo": str(algo), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _numpy_parsed(n: Mapping[str, Any]) -> Any:
    """The saved state of NumPy's global generator (``_numpy_global``) as ``np.random.set_state`` takes it,
    tried on a fresh bit generator of the global one's kind (``_other_numpy_kind`` passed): a bad one raises here."""
    if "bit_generator" in n:  # saved from another bit generator than MT19937
        state = genstate.from_plain(n["bit_generator"])
        type(np.random.get_bit_generator())().state = state  # get_bit_generator: NumPy 1.25+, which saved this
        return state
    state = (n["algo"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.RandomState().set_state(state)
    return state


def _global_kind() -> str:
    """The class name of the bit generator behind NumPy's global functions (``np.random.set_bit_generator``)."""
    get = getattr(np.random, "get_bit_generator", None)  # NumPy 1.25+; before, the global one is MT19937
    return type(get()).__name__ if get is not None else "MT19937"


def _other_numpy_kind(saved: Any) -> str | None:
    """Why NumPy's global generator cannot take the ``saved`` state (the bit generators differ: a script
    that calls ``np.random.set_bit_generator()`` at save time and not at load, or the reverse), else None."""
    if not isinstance(saved, Mapping):
        return None
    inner = saved.get("bit_generator")
    was = inner.get("bit_generator") if isinstance(inner, Mapping) else "MT19937"
    if was == (now := _global_kind()):
        return None
    return (f"RNGState: NumPy's global generator was a {was} at save time (np.random.set_bit_generator) and is a {now} "
            f"now; call np.random.set_bit_generator(np.random.{was}()) before the load, as the saved run did")


def _as_python_rng(v: Any) -> tuple:
    version, internal, gauss = v
    return (int(version), tuple(int(x) for x in internal), gauss)
