"""Room for open files. A load keeps each data file it reads open until it ends
(``io.read_targets``; ``inspect.verify`` opens them all first), with up to two descriptors a file
(buffered, and O_DIRECT for a cold one: ``storage.local``). A checkpoint holds a file per rank
(two past 64 MB), and a replicated (DDP) state is spread over all of them, so every rank's
restore of a 1,000-rank job touches 1,000 files: past the soft limit of 1024 descriptors that
many systems give a process, it failed with ``OSError: Too many open files``. Before a file is
opened, :func:`ensure_room` raises the process's soft limit as far as its hard limit allows.
"""

from __future__ import annotations

try:
    import resource
except ImportError:  # not POSIX: nothing to raise
    resource = None  # type: ignore[assignment]

# Descriptors left for the rest of the process (the process group's sockets, logs, torch's own).
MARGIN = 256


def ensure_room(files: int) -> None:
    """Make room for ``files`` open data files (two descriptors each) plus ``MARGIN``: raise the
    soft ``RLIMIT_NOFILE`` (at least doubling it, never past the hard limit) when it is lower.
    Called by ``io.read_targets`` before it opens a file, ``inspect.verify`` before it opens all;
    a syscall when the limit suffices, nothing else. A hard limit too low leaves the open's error."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * files + MARGIN
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    new = max(need, 2 * soft)
    if hard != resource.RLIM_INFINITY:
        new = min(new, hard)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):  # a hard limit lowered meanwhile: the open says what is wrong
            pass
