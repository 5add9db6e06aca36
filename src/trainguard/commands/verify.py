"""``trainguard verify``: check every checksum of a checkpoint, or of every checkpoint in a run directory (any process).

Moved out of ``checkpoints.py`` (``ls``/``inspect``/``export``), whose console and helpers it shares;
``cli._register`` finds ``verify_cmd`` here. Reads manifests and checksums without torch
(test_hunt51_cli51.py), importing the checkpoint modules when it runs (test_hunt50_import50.py).
"""

from __future__ import annotations

import os
import sys

import click

from ..errors import CheckpointError, CorruptCheckpointError, NotACheckpointError, is_media_error
from ..layout import MANIFEST, RAM_BASE
from ..storage import for_path
from . import ram_tier_given
from .checkpoints import _print_json, _shown, _size, _stale, console

_RELISTS = 3  # verify_cmd: how many times more a run directory is listed when checkpoints vanished while checked


@click.command("verify")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (one object per checkpoint checked).")
@click.option("--ram-tier", "ram_base", default=RAM_BASE, show_default=True, metavar="DIR", callback=ram_tier_given,
              help="Where the manager's ram_tier= keeps its RAM copies: a run directory with no valid checkpoint "
                   "says whether this node's RAM tier holds one (which a restart here resumes from).")
def verify_cmd(path: str, as_json: bool, ram_base: str) -> None:
    """Check every checksum of a checkpoint, or of every checkpoint in a run directory. Exit code 0 only when every
    committed checkpoint matches, and there is one (a step directory without a manifest, a save in progress or a
    crashed one, is incomplete and does not count); 1 when one fails or none verifies; 2: PATH holds none, or is unreadable."""
    from ..commit import read_manifest
    from ..errors import FormatVersionError
    from ..inspect import list_checkpoints, set_aside

    storage, p = for_path(path)
    run_dir = False
    url = getattr(storage, "url", None)  # an object store's key p ("bucket/run/step-N") is a local path to verify()
    one = url(p) if url else p  # the checkpoint as verify() and _deleted() take it back
    aside: list[str] = []
    try:
        read_manifest(storage, p)
        targets: list[tuple[str, str, int | None]] = [(one, "committed", None)]
    except (CorruptCheckpointError, FormatVersionError):  # a manifest there that fails, or a later trainguard's:
        targets = [(one, "committed", None)]  # this checkpoint's row, corrupt or newer format (exit 2 before review56j)
    except NotACheckpointError:  # no manifest: a run directory
        rows, aside, run_dir = list_checkpoints(path), set_aside(path), True  # aside: what the next manager may put back
        if not rows:
            if ram := _in_ram(path, ram_base):  # a first save that crashed before its copy reached the disk
                raise NotACheckpointError(f"{path} holds no step-NNNNNNNNN checkpoint; {ram}") from None
            raise NotACheckpointError(
                f"{path} holds no checkpoint: no {MANIFEST} (a checkpoint directory) and no step-NNNNNNNNN "
                "directories (a run directory); nothing to verify" if not aside else
                f"{path} holds no step-NNNNNNNNN checkpoint, but the next CheckpointManager may put one back "
                f"(`trainguard verify` its path checks it): {'; '.join(aside)}"
            ) from None
        targets = [(r.path, r.status, r.step) for r in rows]
    except OSError as e:  # a medium's error reading it (EIO) too; EACCES and the like are the command's error
        if not is_media_error(e):
            raise
        targets = [(one, "committed", None)]
    ok, out, verified = True, [], 0
    done: dict[str, str] = {}  # checkpoint -> its status
    for _ in range(1 + _RELISTS):
        vanished = False
        for t, listed, step in targets:
            if t in done and (done[t] != "incomplete" or listed == "incomplete"):
                continue  # checked at an earlier listing (a save in progress then, committed now, is checked again)
            status, step, errors, checked = _check(t, listed, step)
            done[t], vanished = status, vanished or status == "deleted"
            ok &= status in ("valid", "incomplete", "deleted")
            verified += status == "valid"
            if as_json:
                out.append({"path": t, "step": step, "ok": status == "valid", "status": status,
                            "bytes_checked": checked, "errors": errors})
            elif status == "valid":
                console.print(f"[green]OK[/]      {_shown(t)}  ({_size(checked)} checked)")
            else:
                console.print({"corrupt": "[red]CORRUPT[/]", "incomplete": "[yellow]INCOMPLETE[/]", "newer format":
                               "[yellow]NEWER FORMAT[/]"}.get(status, "[yellow]DELETED[/]") + f" {_shown(t)}")
                for line in errors[:20]:
                    console.print(f"        {_shown(line)}")
        if not (run_dir and vanished):
            break
        # Retention deleted checkpoints it listed while they were checked: the job committed newer ones since
        # (KeepLatest keeps the newest). Before, the verdict was about the deleted ones only: every step
        # DELETED, "no committed checkpoint verified", exit 1, on a live run that had valid ones.
        targets = [(r.path, r.status, r.step) for r in list_checkpoints(path)]
    if as_json:
        _print_json(out)
    for note in [] if as_json else aside:  # as under ls's table: a step that is not checked here, but may come back
        console.print(f"[yellow]not listed[/]: {_shown(note)}")
    if not verified and not as_json:
        ram = _in_ram(path, ram_base) if run_dir else None
        console.print("[red]no committed checkpoint verified[/]" + (f" in the run directory; {_shown(ram)}" if ram else
                                                                    "" if aside else ": restore would find none to load"))
    sys.exit(0 if ok and verified else 1)  # a run dir of incomplete (or deleted) ones only: nothing to resume from


def _in_ram(run_dir: str, base: str) -> str | None:
    """``verify_cmd``'s note for a run directory without a valid checkpoint: the steps of this
    node's RAM tier of it (under ``base``) whose checksums all match, which a manager with
    ``ram_tier=`` restores on this node (``RamTier.candidates``); None when there is none."""
    from ..inspect import list_checkpoints
    from ..ramview import ram_copies

    try:
        here = ram_copies(run_dir, base)
        ram = list_checkpoints(here, verify_data=True) if here else []
        stale = _stale(run_dir, here, ram, list_checkpoints(run_dir)) if here else {}
        steps = [r.step for r in ram if r.status == "valid" and r.step not in stale]
    except (CheckpointError, OSError):  # no RAM tier to speak of: the verdict stays the run directory's
        return None
    if not steps:
        return None
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, sorted(steps, reverse=True)))}"
    return (f"this node's RAM tier ({here}) holds a valid copy of {which}: a restart on this node with ram_tier= "
            "resumes from it, one on another node finds none")


def _check(t: str, listed: str, step: int | None) -> tuple[str, int | None, list[str], int]:
    """``verify_cmd``'s verdict on one checkpoint ``t`` of step ``step`` that ``list_checkpoints``
    found ``listed`` ("incomplete": no manifest; anything else: verified here): status, step,
    errors, bytes checked. Status "valid", "corrupt", "newer format" (a manifest this trainguard cannot read:
    not corruption, it fails verify), "incomplete", or "deleted" (it vanished while verified: a running job's
    retention deleted it); neither of the last two is corruption, and restore never reads a step without a manifest."""
    from ..inspect import verify

    if listed == "incomplete" and os.path.isfile(t):  # not a save's (commit.clean_debris leaves it, warning)
        return "incomplete", step, ["a file, not a checkpoint directory: restore never reads it, the manager leaves it, "
                                    f"and a save of step {step} fails until it is moved away"], 0
    if listed == "incomplete" and _gone(t):  # retention deleting it had removed its manifest when it was listed
        return "deleted", step, ["removed while it was checked (a running job's retention deletes old checkpoints)"], 0
    if listed == "incomplete":
        return "incomplete", step, [f"no {MANIFEST}: a save in progress (object stores write in place) or one that crashed; "
                              "restore never reads it, and the manager removes it when it next opens"], 0
    res = verify(t) if listed != "deleted" else None
    if res is None or (not res.ok and _deleted(t)):
        return "deleted", step, ["removed while it was checked (a running job's retention deletes old checkpoints)"], 0
    return "valid" if res.ok else "newer format" if res.newer else "corrupt", res.step, res.errors, res.bytes_checked


def _gone(path: str) -> bool:
    """Whether step directory ``path``, listed without a manifest, is not there any more."""
    storage, p = for_path(path)
    try:
        return not storage.exists(p)
    except OSError:
        return False


def _deleted(path: str) -> bool:
    """Whether checkpoint ``path`` lost its manifest while ``_check`` verified it: deletion removes
    the manifest first, so a checkpoint retention is still deleting counts (its directory is there)."""
    from ..inspect import deleted_while_read

    storage, p = for_path(path)
    return deleted_while_read(storage, p)
