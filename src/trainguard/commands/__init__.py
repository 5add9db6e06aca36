"""One module per group of ``trainguard`` subcommands; :mod:`trainguard.cli` registers them."""

from __future__ import annotations

import re
from typing import Any


def printable(s: Any) -> str:
    """A string from a checkpoint (a tensor name, a path) safe to print: control characters
    written as ``\\xNN``, so that an escape sequence in a name never reaches the terminal, and
    bidirectional overrides as ``\\uNNNN`` (they reorder what a terminal shows)."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", _escaped, str(s))


def _escaped(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
