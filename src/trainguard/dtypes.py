"""The stored dtypes: names in the manifest <-> torch dtypes (a fixed table; a name not in it is
corruption). The names and item sizes without torch:
:mod:`.dtypenames` (what a manifest's validation reads)."""

from __future__ import annotations

import torch

from .dtypenames import BASE, NEWER

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in BASE}
DTYPES.update({name: getattr(torch, name) for name in NEWER if hasattr(torch, name)})
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
