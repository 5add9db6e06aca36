"""How much more host memory this process may take before the kernel's OOM killer ends it: the
host's ``MemAvailable`` and the room left under each memory cgroup limit above it (v1 or v2: a
Slurm job, a container, a Kubernetes pod), less what a training step takes and gives back.

Called by ``stage.StagingPool`` (the async save's staging pool, before an arena grows: the save
call for the copies made in the call, the save thread for the background buffer) and by
``ramroom`` (rank 0, before a save into the RAM tier, whose tmpfs pages are charged to the
cgroup too). Before, an async save of a state that did not fit next to training allocated the
whole staging pool anyway and the job was OOM-killed (SIGKILL: no error, no checkpoint, the
previous one intact but the run dead); a RAM-tier copy could do the same. See docs/async.md,
"Memory: the staging pool and its cap".

A cgroup's usage counts the page cache its processes read and wrote; its file pages, inactive and
active (``inactive_file``, ``active_file`` in ``memory.stat``), are reclaimed before the OOM killer
runs, so they count as room. Before, only the inactive ones did (the kubelet's "working set"): a
job that had read its dataset twice (active page cache) staged its saves in 4 MiB batches with
2 GB to spare (tests/test_hunt46_review46.py). What a training step allocates and frees again
(activations, gradients of a CPU model) is not in use between steps, when a save is called: the
process's peak RSS less its current RSS (``VmHWM - VmRSS``) is kept free for it.
"""

from __future__ import annotations

import os

MARGIN = 256 << 20  # kept free beyond the step's own peak: allocator slack, page tables, the save's small buffers
SMALL = 16 << 20  # growth the margin covers without a look: a few RNG states and buffers are copied in the call as before
_V1_ROOT = "/sys/fs/cgroup/memory"
_V2_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as 2^63 rounded down to a page


def room() -> int | None:
    """Bytes this process and the other ranks of its host (:func:`local_ranks`: their shares) can
    still allocate and touch without a risk of the OOM killer, or None when it cannot tell (not
    Linux, or nothing readable). Cheap: a few small files in /proc and
    /sys, read when an arena would grow (not at every save of a steady state)."""
    avail = _meminfo("/proc/meminfo", "MemAvailable")
    for limit_room in _cgroup_rooms():
        avail = limit_room if avail is None else min(avail, limit_room)
    if avail is None:
        return None
    status = "/proc/self/status"
    peak, now = _meminfo(status, "VmHWM"), _meminfo(status, "VmRSS")
    transient = max(peak - now, 0) if peak is not None and now is not None else 0
    # Every rank of the host runs the same step: each needs its peak back. Before, one rank's was kept for
    # all, and 2 ranks under one cgroup were OOM-killed in the step after a save (tests/test_hunt46_review46.py).
    return max(avail - transient * local_ranks() - MARGIN, 0)


def local_ranks() -> int:
    """Ranks of this job on this host (``LOCAL_WORLD_SIZE``, set by torchrun; 1 without it): they
    allocate their staging pools and RAM-tier copies at the same time, from the same room."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def describe(nbytes: int) -> str:
    """``nbytes`` for a message: MiB below 10 GiB, else GiB."""
    return f"{nbytes / (1 << 20):.0f} MiB" if nbytes < 10 << 30 else f"{nbytes / (1 << 30):.1f} GiB"


def _meminfo(path: str, key: str) -> int | None:
    """A ``Key:   123 kB`` line of ``path`` (/proc/meminfo, /proc/self/status) in bytes."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_rooms() -> list[int]:
    """Room under each memory limit of this process's cgroup and its ancestors (a child's limit
    may be looser than its parent's): limit - (usage - file pages)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:  # "4:memory:/path" (v1) wins over "0::/path" (v2) when both are there (a hybrid host)
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return _rooms(_V1_ROOT, path, "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_active_file"))
    for line in lines:
        if line.startswith("0::"):
            return _rooms(_V2_ROOT, line[3:], "memory.max", "memory.current", ("inactive_file", "active_file"))
    return []


def _rooms(root: str, path: str, limit_file: str, usage_file: str, file_keys: tuple[str, ...]) -> list[int]:
    """``_cgroup_rooms`` in one hierarchy mounted at ``root``: from the process's cgroup up to the
    root. Inside a cgroup namespace the path may not exist under ``root`` (the mount is the
    process's own cgroup then): the levels that do exist are read."""
    out: list[int] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        d = os.path.join(root, *parts[:depth])
        limit = _number(os.path.join(d, limit_file))
        if limit is None or limit >= _UNLIMITED:
            continue
        usage = _number(os.path.join(d, usage_file))
        if usage is None:
            continue
        cache = sum(_stat(os.path.join(d, "memory.stat"), key) or 0 for key in file_keys)  # reclaimable
        out.append(max(limit - max(usage - cache, 0), 0))
    return out


def _number(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    if text == "max":  # cgroup v2: no limit
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None
