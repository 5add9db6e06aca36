"""Explicit random generators of a training loop, saved by ``tg.RNGState(generators={...})``.

A loop that draws from its own generator (``torch.randn(..., generator=g)``,
``np.random.default_rng(0)``, ``random.Random(0)``) resumes bit-identically only if that
generator's state is saved too: ``RNGState`` covers the global ones. ``RNGState.state_dict``
(every rank) calls :func:`state_of` for each named generator, ``RNGState.load_state_dict``
calls :func:`check_saved` and :func:`parse` (every rank that has a saved state; before any
generator changes), then :func:`load`, ``RNGState.reseed_for_rank`` calls :func:`reseed` (a rank the checkpoint
has no state for). States are tensors and JSON values: NumPy's arrays become lists with their
dtype, so no pickle is involved.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError
from .permanent import mark
from .seeded import seed_of

KINDS = {"torch": torch.Generator, "numpy": np.random.Generator, "numpy_legacy": np.random.RandomState,
         "python": random.Random}


def kind_of(g: Any) -> str | None:
    """The kind of generator ``g`` is (a key of :data:`KINDS`), or None for anything else."""
    return next((k for k, t in KINDS.items() if isinstance(g, t)), None)


def check_generators(generators: Mapping[str, Any] | None) -> dict[str, Any]:
    """``RNGState(generators=...)``: a dict of str names to supported generators, else TypeError."""
    if generators is None:
        return {}
    if not isinstance(generators, Mapping):
        raise TypeError(f"RNGState(generators=...) takes a dict of names to generators, e.g. {{'noise': g}}; got "
                        f"{type(generators).__name__}")
    for name, g in generators.items():
        if type(name) is not str or not name:
            raise TypeError(f"RNGState(generators=...): name {name!r} must be a non-empty str")
        if kind_of(g) is None or isinstance(g, random.SystemRandom):
            raise TypeError(
                f"RNGState(generators=...): {name!r} is a {type(g).__module__}.{type(g).__qualname__}; supported are "
                "torch.Generator, numpy.random.Generator, numpy.random.RandomState and random.Random (not SystemRandom: "
                "it has no state)"
            )
    return dict(generators)


def to_plain(v: Any) -> Any:
    """NumPy's state dict as JSON values: an array becomes ``{"dtype": ..., "values": [...]}``."""
    if isinstance(v, np.ndarray):
        return {"dtype": str(v.dtype), "values": v.tolist()}
    if isinstance(v, dict):
        return {k: to_plain(x) for k, x in v.items()}
    return v.item() if isinstance(v, np.generic) else v


def from_plain(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"dtype", "values"}:
        return np.asarray(v["values"], dtype=v["dtype"])
    return {k: from_plain(x) for k, x in v.items()} if isinstance(v, dict) else v


def state_of(g: Any) -> dict[str, Any]:
    """The state of generator ``g``: ``{"kind": ..., "state": ...}``."""
    kind = kind_of(g)
    if kind == "torch":
        state: Any = g.get_state()  # a uint8 CPU tensor, for a CUDA generator too
    elif kind == "numpy":
        state = to_plain(g.bit_generator.state)
        if (n := _spawned(g)) is not None:  # not in bit_generator.state: see _spawned
            return {"kind": kind, "state": state, "spawned": n}
    elif kind == "numpy_legacy":
        state = to_plain(g.get_state(legacy=False))
    else:
        state = g.getstate()
    return {"kind": kind, "state": state, **({"device": g.device.type} if kind == "torch" else {})}


def _spawned(g: np.random.Generator) -> int | None:
    """How many children ``g.spawn()`` (``bit_generator.seed_seq.spawn()``) has made: NumPy's way to
    split a generator into independent streams (a worker's or an epoch's). The count lives in the
    generator's ``SeedSequence``, not in ``bit_generator.state``: a load that restored the state only
    left it at the rebuilt generator's 0, so the resumed run's ``spawn()`` handed out the streams its
    first epochs had drawn again, silently. None for a generator without one."""
    n = getattr(getattr(g.bit_generator, "seed_seq", None), "n_children_spawned", None)
    return n if type(n) is int else None


def _respawn(name: str, g: np.random.Generator, saved: Any) -> None:
    """``load``: bring ``g``'s spawn count (:func:`_spawned`) up to the ``saved`` one, by spawning
    the children it lacks (the count is read-only and only grows); a generator that has spawned
    more already (a reload in the same process) keeps its count, with a warning. ``saved`` None:
    a checkpoint from before the count was saved."""
    have = _spawned(g)
    if type(saved) is not int or have is None or have == saved:
        return
    if have < saved:
        g.bit_generator.seed_seq.spawn(saved - have)
        return
    import warnings

    warnings.warn(f"RNGState: numpy generator {name!r} has spawned {have} children (spawn()), the checkpoint's "
                  f"{saved}: the count cannot go back, so its next spawn() does not give the saved run's next child; "
                  "pass a generator built afresh from the same seed (np.random.default_rng(seed)) to the load",
                  stacklevel=2)


def check_saved(generators: Mapping[str, Any], saved: Any, strict: bool = True) -> list[str]:
    """``loader._load`` (with the entry's skeleton, before anything is read) and ``RNGState.load_state_dict``:
    every generator has a saved state of its kind. Returns the names the checkpoint has no state for,
    which ``strict=False`` leaves as they are (a generator added to the run since); else refused."""
    saved = saved if isinstance(saved, Mapping) else {}
    missing = [n for n in generators if n not in saved]
    if missing and strict:
        raise mark(CheckpointError(
            f"RNGState: the checkpoint holds no state for generator(s) {missing} (it has {sorted(saved)}): pass the "
            "generators the run was saved with (RNGState(generators=...)), or load with strict=False: a generator the "
            "checkpoint has no state for (added since) is then left as it is"
        ))
    for name, g in generators.items():
        got = saved[name].get("kind") if isinstance(saved.get(name), Mapping) else None
        if name in saved and got != kind_of(g):
            raise mark(CheckpointError(f"RNGState: generator {name!r} was saved as a {got} generator and is a "
                                       f"{kind_of(g)} one now; pass one of the saved kind"))
        device = saved[name].get("device") if got == "torch" else None  # a CPU state does not fit a CUDA generator
        if device is not None and device != g.device.type:
            raise mark(CheckpointError(f"RNGState: torch generator {name!r} was saved on {device} and is on "
                                       f"{g.device.type} now; pass a generator of the saved device"))
    return missing


def parse(generators: Mapping[str, Any], saved: Mapping[str, Any]) -> list[tuple[str, Any, str, Any, Any]]:
    """``RNGState.load_state_dict``, before any generator changes (``check_saved`` passed): each saved state
    the generators will take, as ``(name, g, kind, state, spawned)``, each tried on a fresh generator of
    ``g``'s kind first, so a state that does not parse raises (TypeError, ValueError, RuntimeError...)
    here, while every generator, the global ones too, is still as it was."""
    out = []
    for name, g in generators.items():
        if name not in saved:
            continue
        state, kind = saved[name]["state"], saved[name]["kind"]
        if kind == "torch":
            state = state.to("cpu", torch.uint8)
            torch.Generator(device=g.device).set_state(state)
        elif kind == "numpy":
            state = from_plain(state)
            type(g.bit_generator)().state = state
        elif kind == "numpy_legacy":
            state = from_plain(state)
            np.random.RandomState(type(g._bit_generator)()).set_state(state)  # noqa: SLF001  (see reseed)
        elif type(g).setstate is random.Random.setstate:  # a subclass with its own state is not tried first
            random.Random().setstate(state)
        out.append((name, g, kind, state, saved[name].get("spawned")))
    return out


def load(parsed: list[tuple[str, Any, str, Any, Any]]) -> None:
    """Set each generator to its state as :func:`parse` gave it."""
    for name, g, kind, state, spawned in parsed:
        if kind == "torch":
            g.set_state(state)
        elif kind == "numpy":
            g.bit_generator.state = state
            _respawn(name, g, spawned)
        elif kind == "numpy_legacy":
            g.set_state(state)
        else:  # what getstate() gave, tuples kept: a subclass's own state too
            g.setstate(state)


def reseed(generators: Mapping[str, Any], seed: int) -> None:
    """Seed each generator from ``seed`` and its position in ``generators``."""
    for i, g in enumerate(generators.values()):
        s = seed_of(seed, i + 1)
        if isinstance(g, torch.Generator):
            g.manual_seed(s)
        elif isinstance(g, np.random.Generator):
            _reseed_numpy(g.bit_generator, s)
        elif isinstance(g, np.random.RandomState):  # seed() takes an MT19937 one only
            bits = g._bit_generator  # noqa: SLF001  (RandomState has no public accessor of it)
            bits.state = type(bits)(s).state
        else:
            g.seed(s)


def _reseed_numpy(bits: Any, seed: int) -> None:
    """``reseed``: ``bits`` (a ``numpy.random.Generator``'s bit generator) as ``type(bits)(seed)`` would be,
    its ``SeedSequence`` too: ``Generator.spawn()`` derives its children from that, not from the state, so
    with the state alone the ranks a growth added (each with the generator its script built, from one seed)
    handed out the same children. ``__setstate__((state, seed_seq))`` is how NumPy 2.0+ unpickles a bit
    generator; before 2.0 it takes the state only, which is then all that changes (warned about)."""
    seq = np.random.SeedSequence(seed)
    state = type(bits)(seq).state
    try:
        bits.__setstate__((state, seq))
    except (TypeError, ValueError):  # NumPy < 2.0: __setstate__(state) only
        bits.state = state
    if getattr(bits, "seed_seq", seq) is not seq:
        import warnings

        warnings.warn(f"RNGState: this NumPy ({np.__version__}) cannot re-seed a numpy Generator's SeedSequence, so on "
                      "the ranks the world size grew by its spawn() gives the same children on each; NumPy 2.0+ "
                      "re-seeds it, or derive the children from the rank (np.random.default_rng([seed, rank]))",
                      stacklevel=3)
