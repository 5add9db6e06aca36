"""What a benchmarked method is: small records the worker drives, and the per-rank context.

Calling convention (every rank calls, in the same order, from the main thread):
- ``SyncMethod.save(ctx, d, state)``: write ``state`` under the existing directory ``d``.
  The worker then fsyncs every file under ``d``, ``d`` and its parent, inside the timed span.
- ``LoadVariant.fn(ctx, d, state)``: read the checkpoint under ``d``. In-place variants fill
  ``state``'s own tensors and return None; the others return the new ``{name: tensor}`` dict.
- ``AsyncMethod.start(ctx, d, state)`` returns an :class:`AsyncHandle`; training may mutate
  ``state`` only once ``handle.staged()`` is True. ``AsyncMethod.load`` loads in place (used
  to verify the snapshot, untimed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from .states import State


@dataclass
class Ctx:
    rank: int
    world: int
    pg: Any = None        # default gloo group: used by synchronous saves/loads and the harness
    ckpt_pg: Any = None   # a second gloo group for background saves, so they never share one with training
    cache: dict[str, Any] = field(default_factory=dict)  # per-method objects kept across rounds

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.pg)

    def gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.pg)
        return out


class AsyncHandle(Protocol):
    def staged(self) -> bool: ...
    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> None: ...


SaveFn = Callable[[Ctx, Path, State], None]
LoadFn = Callable[[Ctx, Path, State], "State | None"]


@dataclass(frozen=True)
class LoadVariant:
    name: str
    fn: LoadFn
    in_place: bool
    how: str


@dataclass(frozen=True)
class SyncMethod:
    name: str
    label: str
    save: SaveFn
    loads: tuple[LoadVariant, ...]
    how: str                 # one sentence: exactly what the save does
    multi_rank: str          # what each rank does when world > 1
    limit: bool = False      # a no-serialization reference, not a library
    close: Callable[[Ctx], None] | None = None


@dataclass(frozen=True)
class AsyncMethod:
    name: str
    label: str
    start: Callable[[Ctx, Path, State], AsyncHandle]
    load: Callable[[Ctx, Path, State], None]
    how: str
    close: Callable[[Ctx], None] | None = None
