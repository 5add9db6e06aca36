"""The states that are saved and loaded: flat ``{name: fp32 CPU tensor}`` dicts, fixed seed.

Shapes come from :mod:`bench.shapes` (``100mb``, ``gpt``, ``small10k``); the ``ddp`` case gives
each of 2 ranks the same replica of ``Config.ddp_base``.
"""

from __future__ import annotations

import torch

from .shapes import state_shapes

State = dict[str, torch.Tensor]


def build_state(name: str, scale: float, n_small: int, seed: int) -> State:
    """Allocate and fill the state (normal values, one fixed generator: the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    state: State = {}
    for n, sh in state_shapes(name, scale, n_small, seed):
        state[n] = torch.empty(sh, dtype=torch.float32).normal_(generator=g)
    return state


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def mark(state: State, value: float) -> None:
    """Set element 0 of every tensor: a cheap stand-in for "the optimizer changed this tensor"."""
    with torch.no_grad():
        for t in state.values():
            t.view(-1)[0] = value


def check_marks(tensors: State, names: list[str], value: float) -> str | None:
    """None if every named tensor carries ``value`` at element 0, else a short description."""
    missing = [n for n in names if n not in tensors]
    if missing:
        return f"{len(missing)} tensors missing after load, e.g. {missing[0]!r}"
    wrong = [n for n in names if float(tensors[n].reshape(-1)[0]) != value]
    if wrong:
        got = float(tensors[wrong[0]].reshape(-1)[0])
        return f"{len(wrong)}/{len(names)} tensors hold other data, e.g. {wrong[0]!r}: {got} != {value}"
    return None
