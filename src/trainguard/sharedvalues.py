"""JSON values of shared entries that are not equal on every rank.

A shared (not rank-local) entry is saved once for all ranks: its JSON skeleton, the plain values
beside its tensors (``torch.optim.LBFGS``'s ``prev_loss``/``n_iter``, ``ReduceLROnPlateau``'s
``best``/``num_bad_epochs``/``cooldown_counter``, a counter in a dict), is rank 0's (with
``split_state``: the first rank's of each group holding the entry), and every rank resumes with
it. Where a rank steps such an object with its own values (its own loss, a metric it did not
all-reduce) the other ranks' values were dropped without a word: ``replicas.py`` compares the
replicated tensors only.

Order, on every rank of a multi-rank save:

1. :func:`digests` (``replicas.values``, building the hello, in the save's thread): a short xxh3
   of each shared entry's skeleton, for entries whose skeleton is more than one tensor (a plain tensor entry holds no JSON value).
   Dict keys are sorted first (:func:`_dumps`): equal dicts filled in another order are equal, and
   -0.0 is digested as 0.0 (equal values: a metric rounded to zero from either side).
   Not digested: rank-local entries, data positions (``capture.check_data_positions`` refuses
   those that differ), one process.
2. The digests ride in the "begin" round (``api.persist_and_commit``'s hello, ``"vals"``): no
   new round.
3. :func:`compare` (``replicas.compare``, after ``check_begin``): within each group of ranks
   holding the same entries (``split.groups``), rank 0 warns ONCE PER SAVE
   (``SharedValuesDifferWarning``) naming each differing entry, which ranks hold which copy, and
   whose copy the checkpoint keeps. The save goes on.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .manifest import checksum
from .replicas import ReplicasDifferWarning
from .split import groups

log = logging.getLogger("trainguard")
SHOWN = 8  # entries named in the warning


class SharedValuesDifferWarning(ReplicasDifferWarning):
    """JSON values of a shared entry (saved once for all ranks) differ between ranks; every rank resumes with one copy."""


def digests(objects: Mapping[str, Any], skip: Iterable[str], world: int) -> dict[str, str] | None:
    """``replicas.values``, every rank of a multi-rank save, before the "begin" round: entry -> a
    12-hex digest of its skeleton, for the shared entries (not in ``skip``: rank-local ones, data positions) whose skeleton holds more
    than one tensor reference; None in one process. About 30 ms for an Adam over 10,000 parameters
    (a 1.4 MB skeleton: json.dumps)."""
    if world < 2:
        return None
    out, skip = {}, set(skip)
    for key, skel in objects.items():
        if key in skip or (type(skel) is dict and len(skel) == 1 and "$t" in skel):
            continue
        try:
            raw = _dumps(skel)
        except (TypeError, ValueError):  # not JSON (a skeleton flatten never makes): not compared
            continue
        out[key] = checksum(raw)[:12]
    return out


def _dumps(skel: Any) -> bytes:
    """The skeleton's JSON with each dict's keys sorted: dicts equal on every rank but filled in
    another order (``{t: 0 for t in set_of_strings}``, whose order follows each process's own
    string-hash seed under torchrun) digest the same; before, they were warned as differing. Keys
    that do not sort (ints and strings in one dict): in their order."""
    raw = _json(skel)
    # -0.0 and 0.0 are equal values (a metric rounded to zero from either side): digested as 0.0. JSON writes
    # -0.0 as "-0.0" only, so a skeleton without that text (nearly all) is walked no further.
    return _json(_unsigned_zeros(skel)) if b"-0.0" in raw else raw


def _json(skel: Any) -> bytes:
    try:
        return json.dumps(skel, separators=(",", ":"), default=repr, sort_keys=True).encode()
    except TypeError:
        return json.dumps(skel, separators=(",", ":"), default=repr).encode()


def _unsigned_zeros(v: Any) -> Any:
    """``v`` with each float -0.0 in it (in dicts and lists, as a skeleton holds them) as 0.0."""
    if type(v) is float:
        return 0.0 if v == 0.0 else v
    if type(v) is dict:
        return {k: _unsigned_zeros(x) for k, x in v.items()}
    return [_unsigned_zeros(x) for x in v] if type(v) in (list, tuple) else v


def compare(ctx: Any, begin: list[Any], sigs: list[str], step: int) -> list[dict[str, Any]]:
    """``replicas.compare``, every rank, after ``check_begin`` (the same ``begin`` everywhere): the
    differing entries, ``{"entry", "copies": [[ranks], ...], "kept": rank}``; rank 0 warns once."""
    found = []
    for ranks in groups(sigs).values():
        got = [(r, begin[r].get("vals")) for r in ranks]
        if len(ranks) < 2 or not all(type(v) is dict for _, v in got):
            continue
        for key in got[0][1]:
            copies: dict[str, list[int]] = {}
            for r, v in got:
                copies.setdefault(v.get(key, ""), []).append(r)
            if len(copies) > 1:
                found.append({"entry": key, "copies": sorted(copies.values()), "kept": ranks[0]})
    if found and ctx.rank == 0:
        _warn(found, step)
    return found


def _warn(found: list[dict[str, Any]], step: int) -> None:
    named = "; ".join(
        f"{f['entry']!r} (ranks {' | '.join(','.join(map(str, c)) for c in f['copies'])} hold different values; "
        f"the checkpoint keeps rank {f['kept']}'s)"
        for f in found[:SHOWN]
    )
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    msg = (
        f"trainguard: save of step {step}: the JSON values (numbers, strings, lists: not tensors) of {len(found)} shared "
        f"entr{'y' if len(found) == 1 else 'ies'} differ between ranks: {named}{more}. A shared entry is saved once for "
        "all ranks and every rank resumes with that copy (LBFGS's prev_loss, ReduceLROnPlateau's best and "
        "num_bad_epochs stepped with each rank's own loss). Step such objects with values equal on every rank "
        "(all-reduce the metric first), or set trainguard_rank_local = True on the entry (each rank saves and "
        "resumes its own; docs/distributed.md)."
    )
    try:
        warnings.warn(msg, SharedValuesDifferWarning, stacklevel=3)
    except Warning:  # warnings turned into errors: the save goes on (every rank is mid-save), logged instead
        log.error("%s", msg)
