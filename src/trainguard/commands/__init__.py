"""One module per group of ``trainguard`` subcommands; :mod:`trainguard.cli` registers them."""

from __future__ import annotations

import re
from typing import Any


def printable(s: Any) -> str:
    """A string from a checkpoint (a tensor name, a path) safe to print: control characters
    written as ``\\xNN``, so that an escape sequence in a name never reaches the terminal."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", str(s))
