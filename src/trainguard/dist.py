"""``DistContext``: the only module that knows torch.distributed.

One process: :class:`DistContext` itself, a null object whose collectives return at once.
Many processes: :class:`StoreDistContext`, whose collectives go through the c10d *store*
(never the training process group), so a background save thread can coordinate while the
training loop runs its own collectives, and a dead or absent rank becomes an error with its
rank number after a bounded wait instead of a hang.

Every collective must be called by every rank in the same order (like any collective); a
call that some rank never makes ends on the others with ``RankFailureError`` naming it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

from .errors import RankFailureError

DEFAULT_TIMEOUT = float(os.environ.get("TRAINGUARD_TIMEOUT", "600"))
# A rank whose heartbeat has not moved for this long is declared dead.
DEAD_AFTER = float(os.environ.get("TRAINGUARD_DEAD_AFTER", "10"))
HEARTBEAT_EVERY = 0.5


class DistContext:
    """The single-process context (also the base class): rank 0 of 1, collectives are identity."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, tag: str, value: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank contributes a JSON value; every rank gets the list, indexed by rank."""
        return [value]

    def broadcast(self, tag: str, value: Any = None, *, timeout: float | None = None) -> Any:
        """Rank 0's value, on every rank."""
        return value

    def close(self) -> None:
        pass

    @staticmethod
    def current() -> DistContext:
        """The context for this process: store-based when torch.distributed is initialised."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return _NULL
        pg = dist.group.WORLD
        ctx = _CACHE.get(id(pg))
        if ctx is None:
            from torch.distributed.distributed_c10d import _get_default_store

            ctx = StoreDistContext(_get_default_store(), dist.get_rank(), dist.get_world_size())
            _CACHE.clear()
            _CACHE[id(pg)] = ctx
        return ctx


_NULL = DistContext()
_CACHE: dict[int, DistContext] = {}


class StoreDistContext(DistContext):
    """Collectives through a c10d ``Store`` with liveness: each rank bumps a heartbeat key from a
    daemon thread; a waiter declares a rank dead when its heartbeat stops moving."""

    def __init__(self, store: Any, rank: int, world_size: int, *, dead_after: float = DEAD_AFTER) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.dead_after = dead_after
        # All ranks create their context at their first collective call; the counter gives
        # the same generation to all of them, so keys of an earlier job on the store never clash.
        gen = (int(store.add("trainguard/contexts", 1)) - 1) // world_size
        self.prefix = f"trainguard/{gen}"
        self._round = 0
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, name="trainguard-heartbeat", daemon=True)
        self._hb.start()

    def _beat(self) -> None:
        key = f"{self.prefix}/hb/{self.rank}"
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:
                return  # the store is gone (job ending); nothing to report to
            self._stop.wait(HEARTBEAT_EVERY)

    def close(self) -> None:
        self._stop.set()

    def all_gather(self, tag: str, value: Any, *, timeout: float | None = None) -> list[Any]:
        self._round += 1
        base = f"{self.prefix}/r{self._round}/{tag}"
        self.store.set(f"{base}/{self.rank}", json.dumps(value))
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        self._wait(keys, tag, timeout)
        out = [json.loads(self.store.get(k)) for k in keys]
        self._cleanup(self._round - 2)
        return out

    def broadcast(self, tag: str, value: Any = None, *, timeout: float | None = None) -> Any:
        self._round += 1
        key = f"{self.prefix}/r{self._round}/{tag}/0"
        if self.rank == 0:
            self.store.set(key, json.dumps(value))
            return value
        self._wait([key], tag, timeout)
        return json.loads(self.store.get(key))

    def _cleanup(self, round_no: int) -> None:
        # Keys two rounds back are no longer read by anyone (every rank passed the round after).
        if round_no < 1 or self.rank != 0:
            return
        try:
            for k in _list_round_keys(self, round_no):
                self.store.delete_key(k)
        except Exception:
            pass

    def _wait(self, keys: list[str], tag: str, timeout: float | None) -> None:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + timeout
        seen: dict[int, tuple[int, float]] = {}
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=1.0))
                return
            except Exception:
                pass  # a timeout of this short wait: look at who is missing
            missing = [r for r, k in zip(self._ranks_of(keys), keys) if not self.store.check([k])]
            if not missing:
                return
            now = time.monotonic()
            dead = []
            for r in missing:
                beat = int(self.store.add(f"{self.prefix}/hb/{r}", 0))
                last = seen.get(r)
                if last is None or last[0] != beat:
                    seen[r] = (beat, now)
                elif now - last[1] > self.dead_after:
                    dead.append(r)
            if dead:
                raise RankFailureError(
                    f"{tag}: rank(s) {dead} stopped responding (no heartbeat for {self.dead_after:.0f} s): "
                    "the process died or hangs",
                    {r: "process died or hung (no heartbeat)" for r in dead},
                )
            if now > deadline:
                raise RankFailureError(
                    f"{tag}: rank(s) {missing} did not arrive within {timeout:.0f} s. Every rank must call "
                    "save/load with the same step and state (e.g. not under `if rank == 0:`)",
                    {r: f"did not call {tag} within {timeout:.0f} s" for r in missing},
                )

    def _ranks_of(self, keys: list[str]) -> list[int]:
        return [int(k.rsplit("/", 1)[1]) for k in keys]


def _list_round_keys(ctx: StoreDistContext, round_no: int) -> list[str]:
    # Tags used per round are not tracked; deleting by known tags keeps this cheap.
    return [
        f"{ctx.prefix}/r{round_no}/{tag}/{r}"
        for tag in ("begin", "written", "commit", "load")
        for r in range(ctx.world_size)
    ]


def shard_of(t: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...], bool]:
    """For a tensor leaf: ``(local tensor, global shape, global offsets of the local box, writer)``.

    Plain tensors are whole (offsets 0). A DTensor gives its local shard; ``writer`` is False
    on ranks that hold a replica of a box another rank writes (coordinate > 0 on a mesh
    dimension with a ``Replicate`` placement), so each box is written once.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # type: ignore[assignment]
    if not isinstance(t, DTensor):
        return t, tuple(t.shape), tuple(0 for _ in t.shape), True
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    for p in placements:
        if not isinstance(p, (Shard, Replicate)):
            raise TypeError(
                f"DTensor with placement {p} cannot be saved as is; call .redistribute() to Shard/Replicate first"
            )
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coord = mesh.get_coordinate() or []
    writer = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    return t.to_local(), tuple(t.shape), tuple(offsets), writer


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)
