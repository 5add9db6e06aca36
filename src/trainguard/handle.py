"""``SaveHandle``: what a save returns. Sync saves hand back one that is already done; the
async path completes it from its background writer."""

from __future__ import annotations

import threading
from typing import Any


class SaveHandle:
    """Progress of one save: ``staged()`` (training may mutate the state again), ``done()``
    (committed or failed), ``result(timeout)`` (the manifest, or the save's error raised)."""

    def __init__(self, step: int | None = None) -> None:
        self.step = step
        self._staged = threading.Event()
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.stall_s = 0.0
        self.duration_s = 0.0
        self.bytes = 0

    def staged(self) -> bool:
        return self._staged.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        return self._staged.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    # -- completion, called by whoever runs the save
    def set_staged(self) -> None:
        self._staged.set()

    def set_result(self, value: Any) -> None:
        self._result = value
        self._staged.set()
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._staged.set()
        self._done.set()

    @classmethod
    def completed(cls, value: Any, step: int | None = None) -> SaveHandle:
        h = cls(step)
        h.set_result(value)
        return h
