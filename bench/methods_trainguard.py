"""ADAPTER: the only place the benchmark touches trainguard. Edit here when the API changes.

Written against the API being built (docs: /work/shared/DESIGN.md):
    tg.save(path, state)                -> writes the step directory ``path``
    tg.load(path, state)                -> loads in place
    tg.save(path, state, async_=True)   -> SaveHandle with .staged(), .done(), .result(timeout=None)
    tg.save(path, state, async_=True, stage_in_background=True)   -> the same, nothing copied in the call

``state`` here is a flat ``{name: CPU tensor}`` dict (names use dots, never slashes).
With several ranks, every rank calls these with the same ``path`` inside an initialised
torch.distributed default group; trainguard is expected to coordinate by itself.

If trainguard cannot be imported or lacks these functions, :func:`unavailable_reason` says why
and the harness skips the trainguard rows with that note (``BENCH_NO_TRAINGUARD=1`` forces it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

State = dict[str, torch.Tensor]


def _tg() -> Any:
    import trainguard as tg

    return tg


def unavailable_reason() -> str | None:
    """None when the adapter can run, else one line saying what is missing."""
    if os.environ.get("BENCH_NO_TRAINGUARD"):
        return "disabled by BENCH_NO_TRAINGUARD in the environment"
    try:
        tg = _tg()
    except Exception as e:  # any import-time failure of a library under construction
        return f"`import trainguard` failed: {type(e).__name__}: {e}"
    missing = [n for n in ("save", "load") if not callable(getattr(tg, n, None))]
    if missing:
        return f"trainguard has no {', '.join('tg.' + m for m in missing)} yet"
    return None


def save(path: Path, state: State) -> None:
    """Synchronous, durable save of ``state`` into the step directory ``path``."""
    _tg().save(str(path), state)


def load_into(path: Path, state: State) -> None:
    """Load the step directory ``path`` into ``state``'s existing tensors."""
    _tg().load(str(path), state)


def async_save(path: Path, state: State, background: bool = False) -> Any:
    """Start an async save; returns trainguard's SaveHandle (``.staged()``, ``.done()``, ``.result()``).
    ``background``: ``stage_in_background=True`` (no copy in the call; the loop waits for ``staged()``)."""
    if background:
        return _tg().save(str(path), state, async_=True, stage_in_background=True)
    return _tg().save(str(path), state, async_=True)
