"""The write streams of a save: jobs run on a few threads of their own (``io.py``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any


def run_parallel(
    jobs: Sequence[Any], streams: int, fault: Callable[[str], None] | None = None, point: str = "",
    run: Callable[[Any], None] | None = None,
) -> None:
    """``io.write_file``/``write_batches`` (the save's thread, any rank): run ``jobs`` on ``streams``
    threads that take them in turn from one iterator (work stealing keeps both busy whatever the
    size mix), calling ``fault(point)`` after each; raise the first error once all have stopped.
    A job is a callable taking no argument, or with ``run``, the argument of ``run(job)``
    (``io.write_batches``' tasks are tuples of ints: no closure per task)."""
    if not jobs:
        return
    call: Callable[[Any], None] = run if run is not None else _call
    if streams <= 1 or len(jobs) == 1:
        for j in jobs:
            call(j)
            if fault:
                fault(point)
        return
    it = iter(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                job = next(it, None)
            if job is None:
                return
            try:
                call(job)
                if fault:
                    fault(point)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
                return

    # Daemon threads, not a ThreadPoolExecutor's (joined at interpreter exit: one stuck in a write hung it, iostall.py).
    threads = [threading.Thread(target=worker, name=f"trainguard-io-{k}", daemon=True) for k in range(min(streams, len(jobs)))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException as e:  # Ctrl-C, no thread to start: no worker may write on once the caller closes the file
        errors.append(e)  # (its descriptor's number reused by another open): they stop after their current job
        for t in threads:
            if t.ident is not None:
                t.join()
        raise
    if errors:
        raise errors[0]


def _call(job: Callable[[], None]) -> None:
    job()


class DaemonExecutor:
    """``submit``/``shutdown`` of a ``ThreadPoolExecutor`` on daemon threads, for the object-store
    uploads of ``storage/fsspec._PartWriter`` (the save's thread submits, its workers upload).
    Python joins a ``ThreadPoolExecutor``'s workers at interpreter exit: one stuck in an upload (a
    hung store) kept the process from exiting even after ``StuckWriteError`` said so (docs/async.md)."""

    def __init__(self, workers: int, name: str) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._n, self._name = workers, name
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f: Future[Any] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("DaemonExecutor: submit after shutdown")
            self._q.put((f, fn))
            if len(self._threads) < self._n:  # a thread per job up to the limit, as ThreadPoolExecutor
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return f

    def _work(self) -> None:
        while (item := self._q.get()) is not None:
            f, fn = item
            if f.set_running_or_notify_cancel():
                try:
                    f.set_result(fn())
                except BaseException as e:  # the submitter's result() raises it
                    f.set_exception(e)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._shut:
                self._shut = True
                while cancel_futures:
                    try:
                        item = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
                for _ in self._threads:
                    self._q.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
