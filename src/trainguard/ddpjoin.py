"""Saves inside a ``torch.distributed.algorithms.join.Join`` context (DDP with uneven inputs).

A rank that runs out of batches leaves its loop and, in ``Join.__exit__``, shadows the other ranks'
collectives until every rank has joined; it never reaches a save the others make meanwhile. A save
inside the context at a step where some rank has joined therefore waits for it until the timeout and
fails (2 gloo ranks, 3 and 5 batches, a save every step: "rank(s) [0] did not arrive", and the joined
rank's Join then lost its peer). Saves made while every rank still has a batch succeed, and so does a
save after the block (DDP has synced the model from the last rank to join).

Torch does not mark when the block ends (``Join`` enables the DDP's ``_join_config`` in its
constructor and leaves it so), so a save cannot tell inside from after: no warning at the save. Instead
:func:`note` (``capture.capture``, every rank of a multi-rank save) remembers a DDP entry under Join,
and :func:`hint` (``distwait.wait_for``, when a rank did not arrive) adds the likely cause and the fix
to that timeout's error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_entry: str | None = None  # the last multi-rank save's DDP entry that Join enabled, if any


def note(state: Mapping[str, Any]) -> None:
    """``capture.capture``, every rank of a multi-rank save: remember a DDP entry whose Join is enabled."""
    global _entry
    _entry = None
    for key, value in state.items():
        ddp = getattr(value, "_orig_mod", value)  # torch.compile(ddp)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and getattr(getattr(ddp, "_join_config", None), "enable", False):
            _entry = key
            return


def hint() -> str:
    """``distwait.wait_for``: the sentence a "did not arrive" error gets when the save's DDP is under Join."""
    if _entry is None:
        return ""
    return (
        f" Entry {_entry!r} is a DDP under torch's Join (uneven inputs): a rank that ran out of batches inside the "
        "`with Join(...)` block never reaches a save made there. Save after the block, where every rank has joined "
        "and DDP has synced the model (docs/distributed.md, \"Uneven inputs: Join\")."
    )
