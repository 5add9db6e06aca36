"""At interpreter exit, let go of process groups that ``destroy_process_group`` destroyed but torch's own
default arguments still hold, so that gloo's group is torn down in an ``atexit`` hook, not during
interpreter finalization (where a thread taking the GIL aborts the process: "terminate called
without an active exception", a torchrun ``trainguard bench`` rank in CI of 2026-12-07).

``torch.distributed.nn.functional`` declares ``def all_reduce(tensor, op=..., group=group.WORLD)``
(and 9 more): the default is evaluated when the module is first imported. Imported after
``init_process_group``, each function's defaults hold the default group for the process's life,
whatever ``destroy_process_group`` does. torch imports it late by itself: the first
``optimizer.step()`` imports ``torch._dynamo``, which imports it (torch 2.13; FSDP and
``torch.distributed._shard`` do too). So after ``dist.destroy_process_group()`` in a script that
stepped an optimizer, gloo's threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) were still running at
the end of the ``atexit`` hooks, the ``trainguard bench`` command included.

Registered with ``atexit`` when trainguard is imported (``__init__``); runs on the main thread,
after the script's last line. Only defaults holding a group that is no longer registered (destroyed)
are replaced, by ``None``: what they hold when the module is imported before ``init_process_group``
(the functions then use the default group of the moment). A group still in use is left alone.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

# Modules whose functions take ``group=group.WORLD`` as a default evaluated at import (torch 2.13).
MODULES = ("torch.distributed.nn.functional",)


def _live_groups(c10d: Any) -> set[int] | None:
    """ids of the registered process groups (None: torch's registry is not where it was: do nothing)."""
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if not isinstance(pg_map, dict):
        return None
    return {id(pg) for pg in pg_map}


def release_destroyed_groups() -> int:
    """Replace by ``None`` each default argument of :data:`MODULES`' functions that holds a
    destroyed process group; return how many were replaced. Main thread, at exit (``atexit``)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return 0
    pg_type = getattr(c10d, "ProcessGroup", None)
    live = _live_groups(c10d)
    if pg_type is None or live is None:
        return 0
    replaced = 0
    for name in MODULES:
        mod = sys.modules.get(name)
        for fn in list(vars(mod).values()) if mod is not None else ():
            defaults = getattr(fn, "__defaults__", None)
            if not isinstance(defaults, tuple) or not any(isinstance(d, pg_type) and id(d) not in live for d in defaults):
                continue
            try:
                fn.__defaults__ = tuple(None if isinstance(d, pg_type) and id(d) not in live else d for d in defaults)
            except (AttributeError, TypeError):  # not a Python function: nothing to change
                continue
            replaced += 1
    return replaced


atexit.register(release_destroyed_groups)
