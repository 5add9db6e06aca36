"""A bound on each call ``FsspecStorage`` makes to an object store (``TRAINGUARD_STORE_TIMEOUT``).

A client of a *hung* endpoint (the server frozen, a load balancer that accepts connections and
never answers, a black-holed route) may never return: against a SIGSTOPped SeaweedFS, a PUT
through s3fs 2026.9 / aiobotocore 3.10 was still waiting after 400 s, whatever botocore's
``read_timeout`` (its timeouts cover reading the answer, not sending the body), and a GET gave
up only after s3fs's 5 tries of botocore's 5 attempts of 15 s each (417 s measured). A training
job blocked in a save (sync), or one whose async save never reports, hangs for good.

So ``FsspecStorage`` (every rank, every thread that reads or writes through it) calls an async
filesystem's methods (s3fs, gcsfs: fsspec runs them on its event loop) with fsspec's own
``timeout=``: the call, its client's retries included, is cancelled after ``bound`` seconds and
raises ``TimeoutError`` (an ``OSError``: a save fails as for any store error, a restore raises
it instead of rolling back). Synchronous filesystems (``memory://``) are called as they are.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ..errors import SettingError

STORE_TIMEOUT_ENV = "TRAINGUARD_STORE_TIMEOUT"
DEFAULT_STORE_TIMEOUT = 600.0  # above s3fs's own give-up time for a dead endpoint (~420 s): only hangs are cut


def store_timeout() -> float:
    """``TRAINGUARD_STORE_TIMEOUT`` (seconds > 0, default 600): how long one object-store call may take,
    its client's retries included. Read when ``FsspecStorage`` is built (``storage.for_path``)."""
    raw = os.environ.get(STORE_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_STORE_TIMEOUT
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise SettingError(f"{STORE_TIMEOUT_ENV}={raw!r}: set it to the seconds one object-store call may take "
                         f"(a number > 0; default {DEFAULT_STORE_TIMEOUT:.0f})")
    return value


class Bounded:
    """``fs`` with each of its async-backed calls bounded by ``bound`` seconds; everything else
    (``invalidate_cache``, ``split_path``, ``open``, attributes) is ``fs``'s own. It is
    ``FsspecStorage.io``, through which its I/O goes; ``FsspecStorage.fs`` stays ``fs`` itself."""

    def __init__(self, fs: Any, bound: float) -> None:
        self._fs, self._bound = fs, bound
        self._async = bool(getattr(fs, "async_impl", False))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not self._async or name == "open" or not callable(getattr(self._fs, f"_{name}", None)):
            return attr  # not one of fsspec's sync wrappers of an async method: no timeout= to give

        def call(*args: Any, **kwargs: Any) -> Any:
            from fsspec.exceptions import FSTimeoutError

            try:
                return attr(*args, timeout=self._bound, **kwargs)
            except FSTimeoutError as e:
                what = f"{name}({args[0]!r})" if args and isinstance(args[0], str) else name
                raise TimeoutError(errno.ETIMEDOUT, (
                    f"the object store did not answer {what} within {self._bound:g} s ({STORE_TIMEOUT_ENV}); "
                    "its endpoint hangs or is unreachable: check it, or raise the bound for a slow link")) from e

        return call
