"""Review of the agent's close of a script worker (elastic/spare.py) in the window where the worker
exits on its own while the agent stops it.

torch's ``SubprocessContext._close`` polls each worker and calls ``handler.close(sig)`` for one it
saw running. When that worker exited right after the poll (both ranks of a preempted job exit 143
at once), trainguard's close polled it again, which reaped it, and handed it to torch's close,
whose ``os.killpg`` of the now empty group raised ``ProcessLookupError`` out of the agent:
``trainguard run`` printed ``error: No such process`` and exited 2 instead of 143, which a requeue
wrapper takes for a failed job. Found when test_exitcodes15_review ran under a loaded machine.
The window is made here without timing: the worker has exited and is a zombie (not yet reaped)
when ``close`` is called, as it is right after torch's poll."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from trainguard.elastic import spare


class _Handler(SubprocessHandler):
    """torch's handler with trainguard's close installed on this subclass only."""


spare.install(_Handler)


def _exited_unreaped(tmp_path: Path) -> _Handler:
    """A worker (the leader of its own session, as torch starts it) that has exited and not been
    reaped: what torch's ``_close`` has in hand when the worker ends right after its poll."""
    h = _Handler(sys.executable, ("-c", "pass"), {}, str(tmp_path / "out.log"), str(tmp_path / "err.log"), 0, None)
    os.waitid(os.P_PID, h.proc.pid, os.WEXITED | os.WNOWAIT)  # exited; still a zombie
    return h


@pytest.mark.timeout(60)
def test_closing_a_worker_that_exited_after_the_poll_does_not_raise(tmp_path: Path) -> None:
    h = _exited_unreaped(tmp_path)
    h.close(signal.SIGTERM)  # before: ProcessLookupError from torch's os.killpg
    assert h.proc.returncode == 0
    assert h._stdout.closed and h._stderr.closed  # what torch's close does after its killpg


@pytest.mark.timeout(60)
def test_torchs_close_of_a_context_whose_worker_exits_in_the_window_returns(tmp_path: Path) -> None:
    """torch's own ``_close`` with the poll it makes seeing the worker still running (the race):
    it returns, and the worker is reaped."""
    h = _exited_unreaped(tmp_path)
    real_poll, calls = h.proc.poll, []

    def poll() -> int | None:  # torch's first poll: "running"; every later one: the real one
        calls.append(1)
        return None if len(calls) == 1 else real_poll()

    h.proc.poll = poll  # type: ignore[method-assign]
    ctx = SubprocessContext.__new__(SubprocessContext)
    ctx.subprocess_handlers = {0: h}
    ctx._close(signal.SIGTERM, timeout=10)  # before: ProcessLookupError
    assert real_poll() == 0
