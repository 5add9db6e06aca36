"""``trainguard bench DIR``: what one checkpoint costs on this machine and this storage.

The figures ``trainguard plan`` asks for (``--save-stall``, ``--save-duration``) depend on the
disk or object store a job writes to, which no table in a README knows. :func:`run` measures
them, in one process, for a model + Adam state of a given size: a sync save (durable), an async
save (the time the call blocks, then how long ``optimizer.step()`` waits for the background copy
when it comes right after the call, then the time until the commit), a load into the existing
tensors from the page cache and, for local directories, with the files dropped from it, and the
storage's own sequential write+fsync speed for the same bytes as the limit. Every load is
checked: the loaded tensors must be bitwise what was saved, else :class:`BenchError`.

Who calls what: ``trainguard bench`` (``commands/bench.py``) calls :func:`check_room`, then
:func:`run`: in one process, or on every rank of a process group it creates under ``torchrun``
(then each rank saves its own state at the same time as the others, and each figure is the
slowest rank's). Everything is written under a new directory ``DIR/trainguard-bench-<host>-<pid>``
(rank 0's host and pid) that :func:`run` removes at the end, also after an error or Ctrl-C
(``keep=True`` leaves the last round's two checkpoints). A first round comes before the measured
ones: shown apart, it pays for what only a job's first save does (a new staging buffer faulted
in, new files), so that the medians and the ``plan`` options are a running job's.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import shutil
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .storage import for_path, local_path

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MIN_SIZE = 2**20
_STOP_WAIT_S = 30.0  # _raw_write's wait for its writers to stop after an error or Ctrl-C
FIGURES = ("raw_write_s", "sync_save_s", "async_call_s", "async_step_wait_s", "async_stall_s", "async_duration_s",
           "load_cached_s", "load_cold_s", "load_s")


class BenchError(Exception):
    """The benchmark cannot run as asked (no room, bad size) or measured something wrong
    (a load that did not give back the saved bytes)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run`, raised once it cleaned up: ``left`` names what is left in its
    directory (on rank 0): with ``keep=True`` the interrupted round's checkpoints, as the
    interruption left them; empty without it."""

    def __init__(self, left: list[str]) -> None:
        super().__init__()
        self.left = left


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"500MB"``, ``"3g"``, ``"1e9"`` -> bytes (KB/MB/GB decimal, KiB/MiB/GiB binary);
    :class:`BenchError` saying what to write for anything else (negative, nan, inf, ``1e400``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise BenchError(f"cannot read {text!r} as a size: write a positive size with its unit, e.g. 1GiB, "
                         "500MB or 2e9")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value) or value >= 2**60:  # 1e400 is inf: int() raised OverflowError
        raise BenchError(f"{text!r} is far more memory than any machine has: write e.g. 1GiB, 500MB or 2e9")
    n = int(value)
    if n < MIN_SIZE:
        raise BenchError(f"{text!r} is too small: at least 1 MiB is needed to measure anything, e.g. 64MiB")
    return n


@dataclass
class Bench:
    """What :func:`run` measured: one dict of figures (seconds) per round, in order."""

    directory: str
    state_bytes: int  # one rank's
    tensors: int  # one rank's
    device: str
    world: int = 1
    rounds: list[dict[str, float]] = field(default_factory=list)  # measured: the slowest rank's figures
    first: dict[str, float] = field(default_factory=dict)  # the first round, before them: not measured
    kept: list[str] = field(default_factory=list)  # with keep=True: the last round's two checkpoints

    def summary(self) -> dict[str, dict[str, float]]:
        """Per figure: the first round (buffers new, files created: a job's first save) and the
        median, min and max of the measured rounds, which alone give :meth:`plan_flags`."""
        out = {}
        for name in FIGURES:
            vals = [r[name] for r in self.rounds if name in r]
            if vals:
                out[name] = {"first": self.first.get(name, math.nan), "median": statistics.median(vals),
                             "min": min(vals), "max": max(vals)}
        return out

    def plan_flags(self) -> str:
        """The ``trainguard plan`` options these figures give, async and sync."""
        s = self.summary()
        return (f"--save-stall {s['async_stall_s']['median']:.3g}s --save-duration "
                f"{s['async_duration_s']['median']:.3g}s (async) or --save-stall {s['sync_save_s']['median']:.3g}s (sync)")

    def as_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "state_bytes": self.state_bytes, "tensors": self.tensors,
                "device": self.device, "world": self.world, "first_round": self.first, "rounds": self.rounds,
                "summary": self.summary(), "plan_flags": self.plan_flags(), "kept": self.kept}


def build_state(size: int, device: str, rank: int = 0) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """Square linear layers whose fp32 weights and two Adam moments take about ``size`` bytes
    (4 MiB weights from 48 MiB on), one Adam step taken so the moments exist; ``rank``'s
    layers are named apart from the other ranks' (``layer<rank>_<i>``) and filled apart."""
    params = size // 12
    width, layers = (1024, round(params / 1024**2)) if params >= 4 * 1024**2 else (max(8, int((params / 4) ** 0.5)), 4)
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.ModuleDict({f"layer{rank}_{i}": torch.nn.Linear(width, width, bias=False)
                                 for i in range(layers)}).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
            p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    return {"model": model, "optim": opt, "progress": {"step": 1}}, opt


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The weights and moments, the tensors a load must give back bitwise."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p.data)
            out += [t for k, t in sorted(opt.state[p].items()) if k != "step"]
    return out


def check_room(directory: str, size: int, device: str, local_ranks: int = 1, ranks: int = 1) -> None:
    """Refuse, saying what to change, when this machine lacks the memory (the state and the
    async save's staging copy, for each of its ``local_ranks``) or ``directory`` the space (two
    checkpoints of every one of ``ranks``) for ``size``."""
    local = local_path(directory)
    if local is not None and not os.path.isdir(local):
        raise BenchError(f"{directory} is not a directory: create it, or name the directory your checkpoints go to")
    need = local_ranks * (2 * size if device == "cpu" else size) + 256 * 2**20
    avail = _mem_available()
    if avail is not None and need > avail:
        raise BenchError(f"--size {size / 1e9:.2f} GB needs about {need / 1e9:.1f} GB of free memory (the state and "
                         f"the async save's staging copy, {local_ranks} rank(s) here); {avail / 1e9:.1f} GB is "
                         "available: use a smaller --size")
    if local is not None:
        free = shutil.disk_usage(local).free
        if 2 * ranks * size + 64 * 2**20 > free:
            raise BenchError(f"{directory} has {free / 1e9:.2f} GB free; --size {size / 1e9:.2f} GB needs about "
                             f"{2 * ranks * size / 1e9:.2f} GB (two checkpoints at once, {ranks} rank(s)): "
                             "use a smaller --size")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _digests(tensors: list[torch.Tensor]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(t.detach().cpu().contiguous().view(torch.uint8).numpy()) for t in tensors]


def _raw_write(directory: str, nbytes: int, sample: torch.Tensor, name: str) -> float:
    """Seconds to write ``nbytes`` with fsync and nothing else: 2 threads, each its half of one
    new file (``O_DIRECT`` where the file system takes it: refused at the first write, it is
    written again buffered, as ``tg.save`` does), from one page-aligned 32 MiB buffer
    filled with ``sample``'s bytes (not zeros: some storage compresses) and written over and
    over, so no memory is copied or faulted in while timed.

    On an error or Ctrl-C the writers stop after their current write (at most 32 MiB), waited
    for up to ``_STOP_WAIT_S``, before the file is closed and removed and the buffer released:
    closed under a writer, the buffer raised ``BufferError`` in place of the KeyboardInterrupt
    and the descriptor could be reused for another file. A writer still busy after that leaves
    both open (the process is ending; :func:`run` removes the file's directory)."""
    piece = 32 * 2**20
    buf = mmap.mmap(-1, piece)
    data = sample.detach().reshape(-1).view(torch.uint8)[:piece].numpy().tobytes()
    for off in range(0, piece, len(data)):
        buf[off : off + len(data[: piece - off])] = data[: piece - off]
    nbytes = -(-nbytes // 4096) * 4096
    half = nbytes // 2 // 4096 * 4096
    path = os.path.join(directory, name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        out = {"fd": os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600), "direct": hasattr(os, "O_DIRECT")}
    except OSError:  # tmpfs and others refuse O_DIRECT at open
        out = {"fd": os.open(path, flags, 0o600), "direct": False}
    errors: list[BaseException] = []
    stop, refused = threading.Event(), threading.Event()
    live = threading.Condition()
    writing = [0]  # writers counted before they start: each counts itself out when it ends

    def write(start: int, end: int) -> None:
        try:
            first = start
            with memoryview(buf) as view:  # released on any exit: an error's traceback kept them exported
                while start < end and not stop.is_set():
                    with view[: min(piece, end - start)] as part:
                        try:
                            start += os.pwrite(out["fd"], part, start)
                        except OSError as e:  # some devices refuse O_DIRECT at the first write, as tg.save knows
                            if not (e.errno == errno.EINVAL and out["direct"] and start == first):
                                raise
                            refused.set()
                            stop.set()
        except BaseException as e:  # raised by the caller below
            stop.set()
            errors.append(e)
        finally:
            with live:
                writing[0] -= 1
                live.notify_all()

    try:
        while True:
            t0 = time.monotonic()
            for span in ((0, half), (half, nbytes)):
                with live:
                    writing[0] += 1
                threading.Thread(target=write, args=span, daemon=True, name="trainguard-bench-raw-write").start()
            with live:
                live.wait_for(lambda: writing[0] == 0)
            if errors:
                raise errors[0]
            if not refused.is_set():
                break
            os.close(out["fd"])  # again, buffered (the writers have ended)
            out["direct"] = False
            out["fd"] = os.open(path, os.O_WRONLY | os.O_TRUNC, 0o600)
            refused.clear()
            stop.clear()
        os.fsync(out["fd"])
        return time.monotonic() - t0
    finally:
        stop.set()
        with live:
            stopped = live.wait_for(lambda: writing[0] == 0, timeout=_STOP_WAIT_S)
        if stopped:
            os.close(out["fd"])
            os.remove(path)
            buf.close()


def _cache(directory: str, cached: bool) -> None:
    """Read a checkpoint's files once, so that they are in the page cache (an ``O_DIRECT`` save
    leaves them out of it), or drop them from it (written and fsynced: their pages are clean)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            if not cached:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while cached and os.read(fd, 64 * 2**20):
                pass
        finally:
            os.close(fd)


def run(directory: str, size: int, *, rounds: int = 3, device: str = "cpu", keep: bool = False,
        progress: Any = None) -> Bench:
    """Measure a first round, then ``rounds`` rounds, in a new directory under ``directory`` (see
    the module's docstring); ``progress(round_index, figures)`` is called after each round, on
    rank 0 (index 0: the first round, 1 to ``rounds``: the measured ones). The first round pays
    for what only a job's first save does (the staging buffer faulted in, files created): it is
    kept apart (``Bench.first``), never in the medians nor in :meth:`Bench.plan_flags`.

    In a process group (every rank calls it, ``trainguard bench`` under ``torchrun``), each rank
    saves and loads its own ``size`` state at the same time as the others (``split_state``: its
    layers have names of their own), and each figure is the slowest rank's. A Ctrl-C raises
    :class:`Interrupted` once the files are removed (with ``keep``: left, and named in it)."""
    import trainguard as tg

    storage, root = for_path(directory)
    local = type(storage).__name__ == "LocalStorage"
    if local and not os.path.isdir(root):  # an object store's prefix exists once written to
        raise BenchError(f"{directory} is not a directory: create it, or name the directory your checkpoints go to")
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    name = [f"trainguard-bench-{socket.gethostname()}-{os.getpid()}"]
    if world > 1:
        dist.broadcast_object_list(name, src=0)
    work = storage.join(root, name[0])
    url = (lambda p: p) if local else storage.url  # type: ignore[attr-defined]  # tg.save takes s3://..., not bucket/...
    kw: dict[str, Any] = {"split_state": True} if world > 1 else {}
    state, opt = build_state(size, device, rank)
    tensors = state_tensors(opt)
    result = Bench(directory, sum(t.nbytes for t in tensors), len(tensors), device, world)
    if rank == 0:
        storage.makedirs(work)
    handle, finished = None, False
    try:
        try:
            for r in range(rounds + 1):
                sync_ck, async_ck = (url(storage.join(work, f"{kind}-{r}")) for kind in ("sync", "async"))
                fig: dict[str, float] = {}
                if local and device == "cpu":
                    _together(world)
                    fig["raw_write_s"] = _raw_write(work, result.state_bytes, tensors[0], f"raw-{rank}.bin")
                saved = _digests(tensors)
                t0 = _together(world)
                tg.save(sync_ck, state, **kw)
                fig["sync_save_s"] = time.monotonic() - t0
                t0 = _together(world)
                handle = tg.save(async_ck, state, async_=True, **kw)
                fig["async_call_s"] = time.monotonic() - t0
                opt.step()  # training's next step: it waits for the copies of the weights and moments
                fig["async_step_wait_s"] = handle.hook_wait_s
                fig["async_stall_s"] = fig["async_call_s"] + handle.hook_wait_s  # the call as timed here: all of it
                handle.result()
                fig["async_duration_s"] = (handle.finished_at or time.monotonic()) - t0
                wrong = 0.0
                for what in ("load_cached_s", "load_cold_s") if local else ("load_s",):
                    with torch.no_grad():
                        for t in tensors:
                            t.zero_()
                    _cache(sync_ck, what == "load_cached_s") if local else None
                    t0 = _together(world)
                    tg.load(sync_ck, state, **kw)
                    fig[what] = time.monotonic() - t0
                    wrong = wrong or float(_digests(tensors) != saved)
                fig = _slowest(fig, world, wrong, sync_ck)
                if r == 0:  # new staging buffer, files created: a job's first save only
                    result.first = fig
                else:
                    result.rounds.append(fig)
                if progress is not None and rank == 0:
                    progress(r, fig)
                if not (keep and r == rounds) and rank == 0:  # every rank has loaded: _slowest gathered
                    storage.remove_tree(storage.join(work, f"sync-{r}"))
                    storage.remove_tree(storage.join(work, f"async-{r}"))
            result.kept = [sync_ck, async_ck] if keep else []
            finished = True
        finally:
            if handle is not None and not handle.done():  # an error or Ctrl-C while the async save writes
                try:
                    handle.result(timeout=120)
                except Exception:  # its own error: the one in flight is the error to report
                    pass
            if finished:
                _together(world)
            if rank == 0 and not (keep and storage.listdir(work)):  # kept: something to keep
                storage.remove_tree(work)
    except KeyboardInterrupt as e:  # after the cleanup above (unless a second Ctrl-C cut it short)
        raise Interrupted(_left(storage, work, url) if rank == 0 else []) from e
    return result


def _left(storage: Any, work: str, url: Any) -> list[str]:
    """What :func:`run` leaves in ``work`` after a Ctrl-C: nothing, or what ``keep`` kept."""
    try:
        return [url(storage.join(work, n)) for n in storage.listdir(work)]
    except Exception:  # an object store that does not answer: the directory, unlisted
        return [url(work)]


def _together(world: int) -> float:
    """Every rank starts a timed part at once: a barrier, then the clock."""
    if world > 1:
        torch.distributed.barrier()
    return time.monotonic()


def _slowest(fig: dict[str, float], world: int, wrong: float, path: str) -> dict[str, float]:
    """Each figure of the slowest rank (one process: ``fig``); raises on every rank when a load
    gave back other bytes than saved on any."""
    figs = [fig]
    if world > 1:
        figs = [{} for _ in range(world)]
        torch.distributed.all_gather_object(figs, {**fig, "_wrong": wrong})
    bad = [r for r, f in enumerate(figs) if f.get("_wrong", wrong)]
    if bad:
        raise BenchError(f"the load of {path} did not give back the bytes saved"
                         + (f" on rank(s) {bad}" if world > 1 else "")
                         + ": the storage returned wrong data (run `trainguard verify` on it with --keep)")
    return {k: max(f[k] for f in figs) for k in fig}
