"""The registry: every benchmarked method, in the order the rounds run them.

Names (for ``--methods``) are listed in :data:`bench.config.METHOD_NAMES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import methods_trainguard as tgad
from .base import AsyncHandle, AsyncMethod, Ctx, LoadVariant, SyncMethod
from .config import METHOD_NAMES, wanted
from .methods_basic import SAFETENSORS, TORCH_SAVE
from .methods_dcp import DCP_ASYNC, DCP_ASYNC_BG, DCP_ASYNC_REUSE, DCP_T1, DCP_T2
from .methods_raw import RAW_1, RAW_2, RAW_D2
from .states import State

_STEP_DIR = "step-000000001"


class _TgHandle:
    """Tolerates a ``staged()`` that blocks and returns None instead of answering a bool."""

    def __init__(self, h: Any) -> None:
        self._h = h

    def staged(self) -> bool:
        r = self._h.staged()
        return True if r is None else bool(r)

    def done(self) -> bool:
        return bool(self._h.done())

    def result(self, timeout: float | None = None) -> None:
        self._h.result(timeout=timeout)


def _tg_save(ctx: Ctx, d: Path, state: State) -> None:
    tgad.save(d / _STEP_DIR, state)


def _tg_load(ctx: Ctx, d: Path, state: State) -> None:
    tgad.load_into(d / _STEP_DIR, state)


def _tg_start(ctx: Ctx, d: Path, state: State) -> AsyncHandle:
    return _TgHandle(tgad.async_save(d / _STEP_DIR, state))


def _tg_start_bg(ctx: Ctx, d: Path, state: State) -> AsyncHandle:
    return _TgHandle(tgad.async_save(d / _STEP_DIR, state, background=True))


TRAINGUARD = SyncMethod(
    name="trainguard",
    label="trainguard",
    save=_tg_save,
    loads=(LoadVariant("tg.load", _tg_load, True, "tg.load into the existing tensors"),),
    how="tg.save(step_dir, state) (bench/methods_trainguard.py)",
    multi_rank="every rank calls tg.save / tg.load with the same path",
)

TRAINGUARD_ASYNC = AsyncMethod(
    name="trainguard_async",
    label="trainguard async",
    start=_tg_start,
    load=_tg_load,
    how="tg.save(step_dir, state, async_=True); training waits for handle.staged() before mutating",
)

TRAINGUARD_ASYNC_BG = AsyncMethod(
    name="trainguard_async_bg",
    label="trainguard async (stage_in_background)",
    start=_tg_start_bg,
    load=_tg_load,
    how="tg.save(step_dir, state, async_=True, stage_in_background=True): nothing copied in the call (this state "
    "has no optimizer, so the default copies every tensor there); training waits for handle.staged() before mutating",
)

SYNC: tuple[SyncMethod, ...] = (TORCH_SAVE, SAFETENSORS, DCP_T1, DCP_T2, TRAINGUARD, RAW_1, RAW_2, RAW_D2)
ASYNC: tuple[AsyncMethod, ...] = (DCP_ASYNC, DCP_ASYNC_REUSE, DCP_ASYNC_BG, TRAINGUARD_ASYNC, TRAINGUARD_ASYNC_BG)
MEMCPY = "memcpy"
TRAINGUARD_NAMES = ("trainguard", "trainguard_async", "trainguard_async_bg")
assert set(METHOD_NAMES) == {m.name for m in SYNC} | {a.name for a in ASYNC} | {MEMCPY}, \
    "config.METHOD_NAMES and the registry disagree"


@dataclass
class Selection:
    sync: list[SyncMethod] = field(default_factory=list)
    async_: list[AsyncMethod] = field(default_factory=list)
    memcpy: bool = False
    skipped: dict[str, str] = field(default_factory=dict)


def select(filters: tuple[str, ...]) -> Selection:
    """The methods to run, in registry order; trainguard's are skipped (with the reason) when the
    adapter cannot run."""
    names = wanted(filters)
    sel = Selection(memcpy=MEMCPY in names)
    tg_reason = tgad.unavailable_reason() if any(n in TRAINGUARD_NAMES for n in names) else None
    for m in (*SYNC, *ASYNC):
        if m.name not in names:
            continue
        if m.name in TRAINGUARD_NAMES and tg_reason:
            sel.skipped[m.name] = tg_reason
        elif isinstance(m, SyncMethod):
            sel.sync.append(m)
        else:
            sel.async_.append(m)
    return sel


def describe() -> dict[str, dict[str, str]]:
    """What each method measures, for the report."""
    out: dict[str, dict[str, str]] = {}
    for m in SYNC:
        out[m.name] = {"label": m.label, "save": m.how, "multi_rank": m.multi_rank,
                       "loads": "; ".join(f"{v.name}: {v.how}" for v in m.loads)}
    for a in ASYNC:
        out[a.name] = {"label": a.label, "save": a.how}
    out[MEMCPY] = {"label": "limit: memcpy", "save": "torch copy_ of every tensor into an existing, "
                   "already-touched tensor of the same shape (1 process, torch's intra-op threads)"}
    return out
