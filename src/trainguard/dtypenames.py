"""The stored dtypes' names and item sizes, without torch: ``manifest`` validates a manifest with
them, so ``trainguard ls``, ``inspect`` and ``verify`` read a checkpoint without importing torch.
:mod:`.dtypes` maps the same names to torch's dtypes (imported where a tensor is made or checked)."""

from __future__ import annotations

# Every torch trainguard supports has these (a name not in either table is corruption).
BASE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
    "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
# Newer dtypes, stored as their bytes like the others (float8_e8m0fnu: MX scales; float4_e2m1fn_x2: two fp4 per
# byte): stored only where the installed torch has them (``dtypes.DTYPES``).
NEWER: dict[str, int] = {
    "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "complex32": 4,
}
ITEMSIZE: dict[str, int] = {**BASE, **NEWER}  # a name ``stored`` took -> bytes per element


def stored(name: str) -> bool:
    """Whether ``name`` (a manifest's ``dtype``, a str) is a stored dtype: one of :data:`BASE`, or of
    :data:`NEWER` that the installed torch has (which imports torch: only for a manifest naming one)."""
    if name in BASE:
        return True
    if name not in NEWER:
        return False
    from .dtypes import DTYPES  # torch

    return name in DTYPES
