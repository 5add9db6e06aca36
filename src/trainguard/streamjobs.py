"""The write streams of a save: jobs run on a few threads of their own (``io.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


def run_parallel(
    jobs: Sequence[Callable[[], None]], streams: int, fault: Callable[[str], None] | None = None, point: str = ""
) -> None:
    """``io.write_file``/``write_batches`` (the save's thread, any rank): run ``jobs`` on ``streams``
    threads that take them in turn from one iterator (work stealing keeps both busy whatever the
    size mix), calling ``fault(point)`` after each; raise the first error once all have stopped."""
    if not jobs:
        return
    if streams <= 1 or len(jobs) == 1:
        for j in jobs:
            j()
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
                job()
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
