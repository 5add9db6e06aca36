"""The run lock's holder record, told apart (``runlock``): which job holds it, and whether it is stopping.

Two things a second job needs when it finds the run directory locked (session 58, review58d):

- *which job* holds it: pid, host and start time named a process, not a job. ``who`` adds the holder's
  command line and, under Slurm, its job id, so that a launch script copied from another run (the same
  ``--ckpt-dir`` by mistake) is recognised from the message (``describe``);
- *whether it is about to let go*: a requeued job (or one restarted by hand) whose old incarnation got its
  stop signal and is still writing its last (async) save found the lock held by a live process of this host
  and failed for good (``LockedError``, exit 78 under ``trainguard run``), with the advice to stop that job,
  which loses the save. The holder now marks its record when it stops (``runlock.mark_stopping``), and a new
  job waits for such a holder (``wait_free``), bounded by half the manager's ``timeout`` (its other ranks
  wait for rank 0's open that long at most: 300 s by default), logging once what it waits for. A holder
  that has not marked its record (a job still training) is refused at once, as before; so is one that marked
  it longer ago than the manager's timeout (``budget``): a job that went on training after its stop signal (a
  loop that does not check ``mgr.should_stop``, a notebook interrupted and resumed) is not about to let go, and
  a requeued job waited 300 s at each of its restarts for it (review58g).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("trainguard")
POLL = 0.2  # seconds between two tries of the lock while waiting for a stopping holder


_SECRET = re.compile(r"token|key|secret|passw|pass$|pwd|auth|cred", re.I)
_QUERY_SECRET = re.compile(r"token|key|secret|passw|pwd|sig|auth|cred", re.I)
# In any argument: a URL's user:password@ and query values named like secrets (?sig=, &token=), e.g.
# --db postgresql://u:pw@host/db, --data https://host/x?X-Amz-Signature=...: review58g. Each pattern scans a stretch
# between two delimiters once (the secret names are looked for in the callback): review58j, the single pattern before
# backtracked over every "?" (a 10,000-character argument of questions naming tokens took 58 s in the manager's open).
_CRED = re.compile(r"://[^/@\s]+@")
_QUERY = re.compile(r"[?&]([^=&?\s]*)=")
_QVAL = re.compile(r"[^&\s]+")
# Inside an argument, a name like a secret followed by ":" or "=" (review58j): JSON ({"api_key": "x"}), a header
# ("Authorization: Bearer x"), a YAML/Hydra override list (a=1,hf_token=x). The name at a word's start only: linear.
_PAIR = re.compile(r"(?<![\w.+-])([\"']?)([\w.+-]+)\1(\s*[:=]\s*)(\"[^\"]{0,256}\"|'[^']{0,256}'"
                   r"|(?:(?:bearer|basic|token)\s+)?[^\s,;}\]&\"']+)", re.I)
_NAME = re.compile(r"[-+]*[\w.+-]+")  # an option's or a variable's name (--api-key=, HF_TOKEN=): _shown


def _hide_urls(a: str) -> str:
    a = _CRED.sub("://***@", a)
    out, pos = [], 0
    for m in _QUERY.finditer(a):
        if m.start() >= pos and _QUERY_SECRET.search(m.group(1)) and (v := _QVAL.match(a, m.end())):
            out += [a[pos:m.end()], "***"]
            pos = v.end()
    out.append(a[pos:])
    return _PAIR.sub(lambda m: f"{m[1]}{m[2]}{m[1]}{m[3]}***" if _SECRET.search(m[2])
                     and not m[0].endswith("***") else m[0], "".join(out))


def _shown(argv: list[str]) -> list[str]:
    """``argv`` as the lock record shows it (a 0644 file in the run directory): the value of an option whose
    name looks like a secret (``--hf-token X``, ``--api-key=X``, ``PASSWORD=X``, ``--db-pass X``) is replaced by
    ``***``, and so are a URL's ``user:password@`` and its query values named like secrets (``?sig=``) in any
    argument (before, review58g: ``--db postgresql://u:pw@host/db`` was written as given), and inside an argument
    the value after ``:`` or ``=`` of a name like a secret (review58j: ``'{"api_key": "X"}'``, ``Authorization: Bearer
    X``, ``a=1,hf_token=X`` were shown; ``Authorization: Basic dXNlcjpwdw==`` as ``...dXNlcjpwdw=***``). Linear in
    the argument's length (the manager's ``open`` on rank 0, through ``who``)."""
    out: list[str] = []
    for i, a in enumerate(argv):
        name, eq, _ = a.partition("=")
        if eq and _SECRET.search(name) and _NAME.fullmatch(name):  # not "Authorization: Basic dXNlcjpwdw=="
            out.append(f"{name}=***")
        elif i and argv[i - 1].startswith("-") and "=" not in argv[i - 1] and _SECRET.search(argv[i - 1]):
            out.append("***")
        else:
            out.append(_hide_urls(a))
    return out


def who() -> dict[str, Any]:
    """Fields naming this job in its holder record: its command line (300 characters at most, the values of
    options named like secrets hidden) and Slurm job id. ``sys.argv`` as a program may have set it: items that are
    no str (a ``pathlib.Path``) as ``str``; before (review58g) they failed the manager's ``open``."""
    argv = [str(a) for a in (getattr(sys, "argv", None) or [])]
    out: dict[str, Any] = {"cmd": " ".join([os.path.basename(sys.executable or "python"), *_shown(argv)])[:300]}
    job, array, task = (os.environ.get(f"SLURM_{k}", "") for k in ("JOB_ID", "ARRAY_JOB_ID", "ARRAY_TASK_ID"))
    if job:  # an array task: squeue/scancel name it <array job id>_<task id>; its own SLURM_JOB_ID is another number
        out["job"] = f"slurm {array}_{task} (job {job})" if array and task else f"slurm {job}"
    return out


def describe(d: dict[str, Any]) -> str:
    """``runlock._read_holder``: the record's job fields as text after its pid, host and time ("" for records
    written before them)."""
    parts = []
    if isinstance(d.get("job"), str):
        parts.append(d["job"])
    if isinstance(d.get("cmd"), str):
        parts.append(f"running `{d['cmd']}`")
    if isinstance(d.get("stopping"), (int, float)):
        parts.append(f"stopping since {time.ctime(d['stopping'])} (signal {d.get('signal')})")
    return "".join(f", {p}" for p in parts)


def since(fd: int) -> float | None:
    """When the holder record in ``fd`` says its job began stopping (``runlock.mark_stopping``), or None."""
    try:
        t = json.loads(os.pread(fd, 4096, 0)).get("stopping")
        return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
    except (OSError, ValueError, AttributeError, OverflowError):  # OverflowError: an int of 400 digits (review58j)
        return None


def stale(fd: int, wait: float) -> float | None:
    """How long ago the holder in ``fd`` began stopping, where that is longer than ``2 * wait`` (the manager's
    ``timeout``): a job that went on after its stop signal, or is stuck in its last save. None otherwise (a holder
    not stopping, or stopping for less; ``wait`` 0: never stale)."""
    t = since(fd)
    age = None if t is None else time.time() - t
    return age if age is not None and wait > 0 and age >= 2 * wait else None


def budget(fd: int, wait: float) -> float:
    """``runlock.RunLock._take`` on rank 0, the lock held: how long to wait for its holder (``wait_free``). 0
    unless the holder record says stopping; else ``wait`` at most, and no longer than until the holder has been
    stopping for ``2 * wait`` (the manager's timeout): before, a holder that marked itself stopping and went on
    training was waited for at every start of a job, however long ago it got its stop signal."""
    t = since(fd)
    return 0.0 if t is None else max(0.0, min(wait, 2 * wait - (time.time() - t)))


def wait_free(fd: int, wait: float, root: str, holder: Callable[[int], str]) -> bool:
    """``runlock.RunLock._take`` on rank 0, the lock held by a holder that is stopping: try the lock every
    ``POLL`` s for ``wait`` s at most. True once taken (the caller writes its record); False when the time is up,
    or the record no longer says stopping (another job took the lock meanwhile): the caller raises
    ``LockedError``. A lock error other than "held" is raised."""
    if wait <= 0:
        return False
    log.warning("trainguard: %s is locked by a job that is stopping (%s): waiting up to %.0f s for its last save",
                root, holder(fd), wait)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        time.sleep(POLL)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            if ", stopping since " not in holder(fd):  # another job holds it now
                return False
            continue
        log.info("trainguard: the stopping job let go of %s; taking its lock", root)
        return True
    return False
