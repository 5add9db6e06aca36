from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

# A suite started as a background job of a non-interactive shell (`cmd &` in a script, as CI launchers and
# `nohup` do) has SIGINT (and SIGQUIT) ignored, and every process a test starts inherits SIG_IGN: `trainguard run`
# keeps an ignored signal ignored (as nohup asks), so the tests that stop an agent or the demo with SIGINT saw it
# never stop (test_hunt54_agent54[SIGINT]: session 57's 2 of 4 runs, session 58's slow set, each started with
# `(setsid nohup bash -c ... &)`; /proc/<pid>/status SigIgn 0x7). The tests' children get what a terminal gives.
if threading.current_thread() is threading.main_thread():
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
_RUN_TMP = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path plugin: its base directory stays where it was
def pytest_configure(config: pytest.Config) -> None:
    """The controller (or a run without xdist) points ``TMPDIR`` at a directory of this run's own,
    which every worker and child inherits: what torchrun's agents (``torchelastic_*``), the
    SeaweedFS server (its sockets and logs, left when the fixture kills it), multiprocessing
    (``pymp-*``) and pytest's ``tmp_path`` put in the temp directory goes there, and is removed
    at the end of the run (they piled up in ``/tmp`` by the thousand over sessions)."""
    if hasattr(config, "workerinput") or os.environ.get("TRAINGUARD_TESTS_TMPDIR"):
        return  # an xdist worker: it inherited the controller's
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None and config.option.basetemp is None:
        # Fixed in /tmp/pytest-of-<user> now: under this run's directory, tmp_path would be 17 characters longer
        # and the AF_UNIX sockets that tests bind in it (multiprocessing's forkserver) too long.
        factory.getbasetemp()
    run_tmp = tempfile.mkdtemp(prefix="tg-tests-")
    os.environ["TMPDIR"] = os.environ["TRAINGUARD_TESTS_TMPDIR"] = run_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.stash[_RUN_TMP] = run_tmp


def pytest_unconfigure(config: pytest.Config) -> None:
    run_tmp = config.stash.get(_RUN_TMP, None)
    if run_tmp is not None:
        # At exit, after multiprocessing removed its own pymp-* directory in it (priority -100): removed now,
        # that removal would print a FileNotFoundError traceback as the process exits.
        from multiprocessing import util

        util.Finalize(None, shutil.rmtree, args=(run_tmp,), kwargs={"ignore_errors": True}, exitpriority=-200)


def run_py(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a Python child process (bounded in time; killed on timeout by subprocess.run)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / "src"), e.get("PYTHONPATH", "")])
    e.update(env or {})
    return subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def forked():
    """``forked(script, *argv, env=None, log=PATH)``: the exit status of a child that ran ``script`` (a
    file's path or ``python -c`` source) with ``argv``, like ``run_py``'s returncode, its stdout and
    stderr in ``log``; ``env`` is added to its environment (a name given None: taken out). The child is forked by one ``forkserve.py`` process per test module that imported
    torch and trainguard once (a fresh interpreter costs about 2 s of CPU each): for tests whose child
    crashes or is killed mid-save and whose check is what the crash left on disk. A test that needs a
    fresh interpreter (import-time behaviour, a launcher, a process tree) uses ``run_py``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    server = subprocess.Popen([sys.executable, str(TESTS / "forkserve.py")], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    sel = selectors.DefaultSelector()
    sel.register(server.stdout, selectors.EVENT_READ)

    def run(script: str | Path, *argv: Any, env: dict[str, str | None] | None = None, log: str | Path) -> int:
        server.stdin.write(json.dumps([str(script), [str(a) for a in argv], env or {}, str(log)]) + "\n")
        server.stdin.flush()
        assert sel.select(timeout=150), "the forked child did not end in 150 s"
        line = server.stdout.readline()
        assert line, f"forkserve.py ended (status {server.poll()})"
        return json.loads(line)

    try:
        yield run
    finally:
        sel.close()
        server.kill()  # by its PID; each child it forked was waited for (or ended by its alarm)
        server.wait(timeout=30)
        server.stdin.close()
        server.stdout.close()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free now, for a process the test starts to bind
    (torchrun's ``--rdzv-endpoint``, ``MASTER_PORT``, a server's ports).

    A port probed with ``bind(("127.0.0.1", 0))`` and closed comes from the kernel's ephemeral range,
    from which every other socket of the machine takes its port too (a TCPStore or gloo listener bound
    to port 0, each outgoing connection): between the probe and the child's bind, one of the ranks
    other xdist workers run at the same moment could take it (EADDRINUSE in the child). Measured with
    60 such sockets in between: 9 ports of 2000 taken. These ports are drawn at random (the OS's
    random source: tests seed ``random``) from the ports below the ephemeral range, which the kernel
    never hands out by itself, each bound once to check it is free; each xdist worker draws from
    its own slice of them, so two workers never draw the same port."""
    import random
    import socket

    lo, _ = _ephemeral_range()
    first, last = 10000, lo - 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    if last - first < 1000 * max(count, 1):  # a machine whose ephemeral range starts low: the kernel's choice
        first = last = 0
    else:
        span = (last - first + 1) // max(count, 1)
        first, last = first + index * span, first + (index + 1) * span - 1
    rand, ports = random.SystemRandom(), []
    for _ in range(1000):
        if len(ports) == n:
            return ports
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rand.randint(first, last) if last else 0))
            except OSError:
                continue  # in use (or in TIME_WAIT): draw another
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
    raise RuntimeError(f"no {n} free ports in {first}..{last}")


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]


@pytest.fixture
def loader_workers_ended():
    """Module-level autouse in tests whose DataLoader iterators with worker processes end in an exception
    (refusals): the exception's traceback holds the iterator in a reference cycle, and its workers stayed
    alive in the pytest worker until the cyclic collector ran, where a later test that SIGKILLs every
    multiprocessing child of its process (test_hunt41_elasticrev) had torch's SIGCHLD handler fail it.
    Collected here, after each test: the iterators shut their workers down."""
    import gc
    import multiprocessing

    yield
    gc.collect()
    assert not multiprocessing.active_children(), "DataLoader worker processes outlived the test"


@pytest.fixture(autouse=True)
def _nothing_leaks_into_later_tests():
    """Every test: what it leaves in its pytest process does not reach the tests that run after it
    there (an xdist worker runs whole modules one after the other, in an order that changes from run
    to run, so a leak fails some other test now and then).

    * ``os.environ`` is put back as it was before the test (a variable added, changed or removed
      outside ``monkeypatch``). ``launcher.prepare`` run in the pytest process wrote the agent's
      ``TRAINGUARD_WATCHDOG=1``, ``TRAINGUARD_AGENT_PID=<this process>``, ``TRAINGUARD_RUN_DIR``,
      ``TRAINGUARD_DEAD_AFTER=3`` into it for every later test and every child they started.
    * A hang watchdog thread (``trainguard-watchdog``) the test started and did not stop fails the
      test, and is stopped: one that ``_Heart()`` started with that environment probed this process
      (``os.kill(pid, 0)``) every 0.2 s for good, and ``test_fault_agent42``, which records this
      process's kills, saw two more than its drill's (CI).
    * The stop signals' handlers are put back (main thread only): a test that leaves SIGINT ignored in this
      process would have every child started later inherit SIG_IGN (``trainguard run`` keeps an ignored
      signal ignored, as ``nohup`` asks). Session 57 took this for the cause of ``test_hunt54_agent54``'s
      agent not stopping on SIGINT; session 58 found the suite itself had been started with SIGINT ignored
      (a background job: see the top of this file)."""
    import signal
    import threading

    env = dict(os.environ)
    before = {t.ident for t in threading.enumerate()}
    main = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    handlers = {s: signal.getsignal(s) for s in sigs} if main else {}
    yield
    for s, h in handlers.items():
        if h is not None and signal.getsignal(s) is not h:
            signal.signal(s, h)
    now = dict(os.environ)
    for k in now.keys() - env.keys():
        if k != "PYTEST_CURRENT_TEST":
            del os.environ[k]
    for k, v in env.items():
        if k != "PYTEST_CURRENT_TEST" and now.get(k) != v:
            os.environ[k] = v
    left = []
    for t in threading.enumerate():
        wd = getattr(getattr(t, "_target", None), "__self__", None)
        if t.name != "trainguard-watchdog" or t.ident in before or wd is None:
            continue
        if not wd._stop.is_set():
            left.append(t)
        wd.stop()
        t.join(10)  # it wakes within its check_every (0.2 s)
    assert not left, (f"{len(left)} hang watchdog thread(s) left running by this test (Watchdog.start() without stop(), "
                      "or _Heart() with TRAINGUARD_WATCHDOG=1 in the environment): stop them in the test")


@pytest.fixture
def run_child():
    return run_py


@pytest.fixture
def gate(monkeypatch):
    """Holds an async save's background copies (``async_save._before_background_stage``) until
    the test opens it (test_async.py, test_mutate_review.py)."""
    import threading

    from trainguard import async_save

    ev = threading.Event()
    monkeypatch.setattr(async_save, "_before_background_stage", lambda: ev.wait(60))
    yield ev
    ev.set()


def evict_page_cache(ckpt: Path) -> None:
    """Drop the page cache of checkpoint directory ``ckpt``'s files (fsync, then
    ``POSIX_FADV_DONTNEED``): the next read of them is a cold one."""
    for f in ckpt.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def filled_linear(fill: float) -> torch.nn.Module:
    """``nn.Linear(8, 4)`` whose every parameter holds ``fill``: which checkpoint loaded shows in a value."""
    m = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    return m


def held_pwrite(monkeypatch: pytest.MonkeyPatch, where: str) -> tuple[Any, Any]:
    """Every local write into ``where`` waits for ``gate`` (a stalled file system); ``entered`` is
    set at the first. Returns ``(entered, gate)`` (threading.Event); the test sets ``gate``."""
    import threading

    from trainguard.storage import local

    entered, gate = threading.Event(), threading.Event()
    orig = local._LocalWriter.pwrite

    def held(self, data, offset):
        if where in self.path:
            entered.set()
            assert gate.wait(120), "never released"
        return orig(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", held)
    return entered, gate
