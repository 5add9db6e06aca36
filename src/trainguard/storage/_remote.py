"""``remote``: marks an object store's ``OSError`` as the store's (``FsspecStorage`` and its readers and writers)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def remote(fn: F) -> F:
    """Marks the client's ``OSError`` ``remote``: its errno guesses an HTTP error's (s3fs: EIO for a 502,
    a 429), never a medium's (``errors.is_media_error``: restore does not fall back on it); a 403 is told as
    "refused access: check the credentials" (``errors.error_text``). Reads and writes (a save's 403 was told
    as "PermissionError: the object store answered HTTP 403 (AccessDenied)", nothing to change named)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            e.remote = True  # type: ignore[attr-defined]
            raise
    return call  # type: ignore[return-value]
