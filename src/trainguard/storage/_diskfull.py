"""The error of a local write that ran out of space (``local._LocalWriter``, ``LocalStorage.write_atomic``)."""

from __future__ import annotations

import errno
import os
import shutil

from ..errors import DiskFullError


def disk_error(e: OSError, path: str, needed: int) -> OSError:
    """``e`` as a ``DiskFullError`` saying how much was needed and is free, when it is one (ENOSPC,
    EDQUOT, EFBIG); ``e`` itself otherwise. Called on the rank whose write failed."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = shutil.disk_usage(os.path.dirname(path)).free
        return DiskFullError(
            e.errno,
            f"no space left writing {path}: {needed} more bytes were needed here, "
            f"{free} bytes are free. Free space, lower retention (keep=...), or save elsewhere",
        )
    return e
