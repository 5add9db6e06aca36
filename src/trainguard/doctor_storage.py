"""``doctor``'s storage check: the file system under the run directory, found where the manager
writes. Called by ``doctor.check`` (as ``_storage``) with the settings it read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .storage import absolute, local_path

_EPHEMERAL = {"tmpfs": "tmpfs (RAM): gone at reboot, and it eats host memory",
              "ramfs": "ramfs (RAM): gone at reboot, and it eats host memory",
              "overlay": "a container's writable overlay layer: gone when the container is removed",
              "aufs": "a container's writable aufs layer: gone when the container is removed"}


def storage_check(leaves: list[tuple[str, Any]], s: Any) -> Any:
    """The ``storage`` finding for ``s.root`` (a ``doctor.Settings``), or None (no local root, no
    mount table). The directory is resolved as ``storage.for_path`` does for the manager: ``~`` is not
    expanded (the manager writes to a directory named ``~`` under the working directory). Before,
    doctor expanded it and judged the home directory's file system ("ok: ~/ckpts is on ext4") while
    the checkpoints went to the working directory's (a tmpfs, a container's overlay)."""
    from .doctor import Finding, filesystem_of, parse_mountinfo

    if s.root is None or (root := local_path(s.root)) is None:
        return None
    text = s.mountinfo
    if text is None:
        try:
            text = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")  # paths are bytes: the locale's codec (ASCII under LANG=C) failed on "é"
        except OSError:
            return None
    path = str(Path(absolute(root)).resolve())
    fs = filesystem_of(path, parse_mountinfo(text))
    tilde = root.split(os.sep)[0].startswith("~")
    if fs is None and not tilde:
        return None
    on = f"is on {_EPHEMERAL.get(fs, fs)}" if fs else "is there"
    if tilde:
        return Finding("storage", "error",  # refused by the manager (storage.refuse_tilde)
                       f"{s.root} is not under your home directory: trainguard does not expand '~' and refuses "
                       f"the path, which names {absolute(root)} ({on})", f"pass os.path.expanduser({s.root!r})")
    if fs in _EPHEMERAL:
        return Finding("storage", "error", f"{s.root} {on}",
                       "point the manager at persistent storage: a mounted volume, a parallel "
                       "filesystem, or an object store (fsspec URL)")
    return Finding("storage", "ok", f"{s.root} {on}")
