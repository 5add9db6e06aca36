"""A ``torch.amp.GradScaler`` enabled now that was disabled when the checkpoint was saved (mixed
precision turned on between runs).

A disabled scaler's ``state_dict()`` is ``{}``, and an enabled scaler's ``load_state_dict({})``
raises ("The source state dict is empty..."): the restore failed, with ``strict=False`` too, telling
the user to build the object as when it was saved, when the change is on purpose and the fresh
scaler is the right state (a disabled scaler has no scale to carry over). ``loader._load`` (every
rank, for each entry with ``load_state_dict``) calls :func:`keeps_fresh` before the entry's
``load_state_dict``: with ``strict`` it refuses, saying what to change; with ``strict=False`` it
warns and keeps the fresh scaler. The reverse change (saved enabled, loaded into a disabled scaler)
is torch's: the disabled scaler ignores the saved scale.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .errors import CheckpointError
from .permanent import mark
from .userframe import user_stacklevel


def keeps_fresh(key: str, obj: Any, saved: Any, strict: bool) -> bool:
    """True when ``obj`` is an enabled GradScaler and ``saved`` a disabled one's empty state: the
    caller skips the entry's ``load_state_dict`` (``strict=False``: after a warning). With
    ``strict`` a ``CheckpointError`` (permanent: the same at every restart) says what to change.
    False for anything else: the caller loads as usual."""
    if not isinstance(obj, torch.amp.GradScaler) or saved != {} or not obj.is_enabled():
        return False
    what = (f"entry {key!r}: the checkpoint's GradScaler was disabled (enabled=False: its saved state is empty) "
            "and this one is enabled (mixed precision turned on since the save)")
    if strict:
        raise mark(CheckpointError(
            f"{what}; a disabled scaler has no scale to restore: restore with strict=False to start this one "
            "fresh, or build it with enabled=False as at save time (docs/checkpoints.md, "
            "\"Changing the configuration between runs\")"
        ))
    warnings.warn(f"{what}: it starts fresh (scale {obj.get_scale()})", stacklevel=user_stacklevel())
    return True
