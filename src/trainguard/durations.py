"""Durations as ``trainguard plan`` and ``doctor`` read and print them (``"30s"``, ``"10m"``, ``"400d"``), without
numpy: :mod:`.reliability` (numpy) re-exports them; ``trainguard plan --help`` imports this module, not that one."""

from __future__ import annotations

import math
import re

DAY = 86400.0
WEEK = 7 * DAY

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": DAY, "w": WEEK}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|min|m|h|d|w)?\s*$", re.IGNORECASE)


def parse_duration(text: str | float) -> float:
    """``"30s"``, ``"10m"``, ``"2.5h"``, ``"400d"``, ``"250ms"`` or a bare number of seconds -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a duration: write e.g. 30s, 10m, 2h or 400d")
    return float(m.group(1)) * _UNITS[(m.group(2) or "s").lower()]


def format_duration(seconds: float) -> str:
    """Seconds as a short human string: ``"45.0s"``, ``"12.3m"``, ``"4.56h"``, ``"2.10d"``."""
    if not math.isfinite(seconds):
        return str(seconds)
    for unit, size, above in (("d", DAY, 2 * DAY), ("h", 3600.0, 3600.0), ("m", 60.0, 60.0)):
        if abs(seconds) >= above:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"
