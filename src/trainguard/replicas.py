"""Replicated tensors that are not equal on every rank.

A plain tensor of a shared entry (DDP: parameters, buffers, optimizer state) is written from ONE
rank (``planner.assign_replicated``) and every rank resumes with that copy. Where the ranks'
copies differ (``DistributedDataParallel(broadcast_buffers=False)`` with BatchNorm, a buffer
updated from each rank's own data, a rank that diverged through a bug) the resumed run is one
silent mix, not the run that was saved. This module finds such tensors and warns.

Order, on every rank of a multi-rank save:

1. :func:`digests` (``capture.capture``, in the call: the state as at the call, before an async
   save lets training go on): xxh3 of each replicated leaf's bytes: all of them on the first save
   of each entry signature in this process; on the later ones the module buffers (small) and the
   first ``SAMPLE_BYTES`` of ``WINDOW`` other leaves, a window that moves on at each save (in path
   order, round the end): a rank whose parameters diverged later (a skipped step) is caught within
   ``ceil(leaves / WINDOW)`` saves, at a cost that does not grow with the model. Ranks whose counts
   of saves differ hash other windows: :func:`compare` then aligns the counts (``_align``).
2. :func:`hello` goes into the "begin" round (``api.persist_and_commit``): one digest, no new round.
3. :func:`compare` (``api.persist_and_commit``, after ``check_begin``): within each group of ranks
   holding the same entries (``split.groups``: every rank without ``split_state``), digests that
   differ start ONE more round, a gather of the per-tensor digests to rank 0, which warns (once
   per process, ``ReplicasDifferWarning``) naming the tensors and ranks, and keeps the finding for
   the manager's event log (:func:`take`, ``policies.report_saved``: a ``replicas_differ`` event).

Not compared: rank-local entries, DTensors (each rank writes its own shard), ``layout="full"``
(rank 0 writes everything), one process. The save itself goes on: a warning, not a refusal.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .buffers import tensor_bytes
from .dtensor import is_dtensor
from .errors import RankFailureError
from .manifest import checksum
from .planner import SPLIT_BYTES, Box, ReplicatedItem, assign_replicated
from .split import groups
from .stateful import is_rank_local

log = logging.getLogger("trainguard")
SHOWN = 8  # tensors named in the warning
_SEEN: dict[str, int] = {}  # entry signature -> how many saves of it this process made (the first: every tensor)
SIGS = 64  # _SEEN keeps the most recently saved signatures: a state whose signature changes at each save
# (a tensor of growing length: a loss history) added one entry per save, ~185 B, 1.85 MB per 10,000 saves
WINDOW, SAMPLE_BYTES = 64, 4096  # later saves: the head of this many other replicated leaves, moving on each save
_FOUND: dict[int, dict[str, Any]] = {}  # step -> the finding, for the manager's event log (rank 0)
_LOCK = threading.Lock()
_warned = False


class ReplicasDifferWarning(UserWarning):
    """Tensors saved once for all ranks (replicated) differ between ranks; every rank resumes with one copy."""


def buffer_sources(value: Any) -> dict[int, int]:
    """``capture.capture``, each shared entry: for a ``DistributedDataParallel`` that syncs its buffers
    (``broadcast_buffers``/``forward_sync_buffers``, the default), each buffer's address -> the global
    rank DDP broadcasts it from before every forward (its process group's rank 0). That rank's copy is
    the one the next step would use on every rank, so it is the one saved (:func:`plan`), and the
    other ranks' copies (each updated by its own batch since) are not compared."""
    ddp = getattr(value, "_orig_mod", value)  # torch.compile(ddp)
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return {}
    if not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", False)):
        return {}
    try:
        src = torch.distributed.get_global_rank(ddp.process_group, 0)
    except Exception:  # a group torch cannot map: the default one's rank 0
        src = 0
    ignore = getattr(ddp, "parameters_to_ignore", ())
    return {b.data_ptr(): src for n, b in ddp.module.named_buffers() if n not in ignore and b.nbytes <= SPLIT_BYTES}


def refuse_subgroup_ddp(state: Mapping[str, Any], world: int) -> None:
    """``capture.capture``, every rank of a multi-rank save without ``split_state``, before anything is
    written: raise ``UnsupportedValueError`` for a shared entry whose ``DistributedDataParallel`` syncs
    over a process group of fewer ranks than the world while its parameters are plain tensors (DDP over
    a subgroup: 2 groups of 2 ranks on 4, each its own replica; Megatron-style tensor parallelism over
    plain tensors). The other ranks hold other values under the same names, and a shared entry is saved
    once for all ranks: every rank resumed with one mix of them (4 ranks, 2 groups: group 0's biases,
    group 1's weights), warned only when the values already differed at the first save."""
    for key, value in state.items():
        ddp = getattr(value, "_orig_mod", value)  # torch.compile(ddp)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) or is_rank_local(value):
            continue
        try:
            ranks = torch.distributed.get_process_group_ranks(ddp.process_group)
        except Exception:  # a group torch cannot map: not judged
            continue
        if len(ranks) >= world or any(is_dtensor(p) for p in ddp.parameters()):
            continue  # the whole world, or DTensor parameters (tensor parallel: each shard is its owner's)
        from .errors import UnsupportedValueError

        raise UnsupportedValueError(
            f"entry {key!r}: its DistributedDataParallel syncs over a process group of ranks {sorted(ranks)}, not all "
            f"{world} ranks, so the other ranks hold other values under the same names (another replica, other shards), "
            "and a shared entry is saved once for all ranks: every rank would resume with one mix of them. Give each "
            "group's entries their own names (state[f\"model{group}\"] = ddp, likewise its optimizer) and pass "
            "split_state=True to every save and load, or set trainguard_rank_local = True on the model and optimizer "
            "entries (each rank saves its own; the run resumes at the same world size)"
        )


def state_buffer_sources(state: Mapping[str, Any]) -> dict[int, int]:
    """``capture.capture``, once per multi-rank save, before it reads the entries: buffer address -> the
    rank whose copy is saved. DDP's synced buffers come from the rank DDP broadcasts them from
    (:func:`buffer_sources`). When those all come from one rank, the buffers of the state's other shared
    module entries come from it too: an EMA (``AveragedModel(use_buffers=True)``, timm's ``ModelEma``)
    copies or averages the trained module's buffers after each step, when each rank's BatchNorm statistics
    have moved with its own batch, so its copies differ on every rank like DDP's own; saved balanced over
    the ranks they were one mix (rank 1's ``running_mean``, rank 0's ``running_var``) that no rank held.
    Rank 0's EMA is then the one that resumes bit-identically. These buffers are not compared either."""
    out: dict[int, int] = {}
    for value in state.values():
        if isinstance(value, torch.nn.Module) and not is_rank_local(value):
            out.update(buffer_sources(value))
    if len(set(out.values())) != 1:
        return out
    src = next(iter(out.values()))
    for value in state.values():
        if isinstance(value, torch.nn.Module) and not is_rank_local(value):
            for b in value.buffers():
                if b.nbytes and b.nbytes <= SPLIT_BYTES:
                    out.setdefault(b.data_ptr(), src)
    return out


def plan(leaves: Sequence[Any], ranks: list[int], loads: list[int], rows: bool) -> list[tuple[Any, Box, int]]:
    """``capture.my_chunks`` (every rank) and :func:`compare` (rank 0): ``(leaf, box, index in ranks)``
    of every replicated piece: a leaf with a ``source`` in ``ranks`` whole by it, the others spread
    by ``planner.assign_replicated`` over what is left (the same answer on every rank)."""
    loads, out, free = list(loads), [], []
    for lf in sorted((lf for lf in leaves if lf.kind == "replicated"), key=lambda lf: lf.path):
        if lf.source is not None and lf.source in ranks:
            i = ranks.index(lf.source)
            out.append((lf, lf.box, i))
            loads[i] += lf.tensor.nbytes
        else:
            free.append(lf)
    by_path = {lf.path: lf for lf in free}
    items = [ReplicatedItem(lf.path, lf.shape, lf.tensor.element_size()) for lf in free]
    return out + [(by_path[p], b, i) for p, b, i in assign_replicated(items, len(ranks), loads, rows)]


def digests(state: Mapping[str, Any], leaves: Sequence[Any], world: int, sig: str, layout_kind: str) -> dict[str, Any] | None:
    """``capture.capture``, every rank, synchronously: ``{"scope", "digest", "sums"}`` for this save's
    replicated leaves (``sums``: path -> xxh3 hex, in path order), or None when nothing is compared."""
    if world < 2 or layout_kind != "sharded":
        return None
    with _LOCK:
        count = _SEEN.pop(sig, 0)
        _SEEN[sig] = count + 1  # last: the most recently saved
        while len(_SEEN) > SIGS:  # an evicted signature saved again is hashed whole, as a first save
            del _SEEN[next(iter(_SEEN))]
    rep = sorted((lf for lf in leaves if lf.kind == "replicated" and lf.source is None), key=lambda lf: lf.path)  # DDP's synced buffers: rank 0's saved
    scope, heads = "all", set()
    if count:  # later saves: module buffers (BatchNorm statistics, a few kB to MB) and a window of the others' heads
        bufs = {b.data_ptr() for v in state.values() if isinstance(v, torch.nn.Module) and not is_rank_local(v)
                for b in v.buffers()}
        other = [lf for lf in rep if lf.tensor.data_ptr() not in bufs]
        start = (count - 1) * WINDOW % len(other) if other else 0
        window = (other + other)[start : start + min(WINDOW, len(other))]
        heads = {lf.path for lf in window}
        rep = sorted([lf for lf in rep if lf.tensor.data_ptr() in bufs] + window, key=lambda lf: lf.path)
        scope = f"buffers+{start}"  # ranks compare only the same window (the same number of saves)

    def head(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1)[: max(1, SAMPLE_BYTES // t.element_size())]

    sums = {lf.path: checksum(tensor_bytes((head(t) if lf.path in heads else t) if (t := lf.tensor).device.type == "cpu"
                                           else (head(t) if lf.path in heads else t).cpu()))
            for lf in rep}
    return {"scope": scope, "digest": checksum("".join(sums).encode() + "".join(sums.values()).encode()), "sums": sums,
            "count": count + 1, "sig": sig}


def hello(snap: Any) -> list[str] | None:
    """What this rank adds to the "begin" round: ``[scope, digest]``."""
    d = getattr(snap, "replicas", None)
    return None if d is None else [d["scope"], d["digest"], d["count"]]


def values(snap: Any, world: int) -> dict[str, str] | None:
    """What this rank adds to the "begin" round for ``sharedvalues.compare``: a digest of each shared
    entry's JSON skeleton (``sharedvalues.digests``; in the save's thread for an async save)."""
    from .sharedvalues import digests as value_digests  # imports this module

    return value_digests(snap.objects, [*snap.rank_local, *snap.data_positions], world)


def compare(ctx: Any, snap: Any, begin: list[Any], sigs: list[str], timeout: float | None, step: int) -> None:
    """``api.persist_and_commit``, every rank, after ``check_begin``: warn on rank 0 when replicated
    tensors differ within a group; the per-tensor round runs only then, on every rank."""
    if not ctx.is_distributed:
        return
    from .sharedvalues import compare as compare_values  # JSON values of shared entries (imports this module)

    compare_values(ctx, begin, sigs, step)  # rank 0 warns, once per save
    bad = []
    for ranks in groups(sigs).values():
        got = [begin[r].get("rep") for r in ranks]
        if ctx.rank in ranks and all(got) and len({g[0] for g in got}) > 1:
            _align(snap, max(g[-1] for g in got))
        if len(ranks) > 1 and all(got) and len({g[0] for g in got}) == 1 and len({g[1] for g in got}) > 1:
            bad.append(ranks)
    if not bad:
        return
    mine = snap.replicas["sums"] if any(ctx.rank in g for g in bad) else None
    try:
        sums = ctx.gather("replicas", mine, timeout=timeout)
    except RankFailureError as e:  # rank 0: a rank died; the "written" round reports it as usual
        log.warning("trainguard: could not compare replicated tensors: %s", e)
        return
    if sums is not None:
        _report(_differ(snap, begin, bad, sums), step)


def _align(snap: Any, count: int) -> None:
    """``compare``, each rank of a group whose ranks hashed other windows (their counts of saves of this
    signature differ: a save that failed on some ranks before their capture, a process that saved it
    before): take the group's highest count, so that their next save hashes the same window."""
    d = snap.replicas
    if type(count) is int and d is not None:
        with _LOCK:
            _SEEN[d["sig"]] = max(_SEEN.get(d["sig"], 0), count)


def _differ(snap: Any, begin: list[Any], bad: list[list[int]], sums: list[Any]) -> list[dict[str, Any]]:
    """Rank 0: each differing tensor with its copies' ranks and the rank(s) whose copy is saved."""
    out = []
    for ranks in bad:
        pieces = plan(snap.leaves, ranks, [begin[r]["own"] for r in ranks], snap.split)
        for path in sums[ranks[0]]:
            copies: dict[str, list[int]] = {}
            for r in ranks:
                copies.setdefault(sums[r].get(path, ""), []).append(r)
            if len(copies) > 1:
                kept = sorted({ranks[i] for lf, _b, i in pieces if lf.path == path})
                out.append({"tensor": path, "copies": sorted(copies.values()), "kept": kept})
    return out


def _report(found: list[dict[str, Any]], step: int) -> None:
    global _warned
    if not found:
        return
    with _LOCK:
        _FOUND[step] = {"tensors": found[:64], "count": len(found)}
        while len(_FOUND) > 16:
            del _FOUND[min(_FOUND)]
        if _warned:
            return
        _warned = True
    named = "; ".join(
        f"{f['tensor']} (ranks {' | '.join(','.join(map(str, c)) for c in f['copies'])} hold different copies; "
        f"the checkpoint keeps {'rank ' if len(f['kept']) == 1 else 'row ranges of ranks '}{','.join(map(str, f['kept']))}'s)"
        for f in found[:SHOWN]
    )
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    msg = (
        f"trainguard: save of step {step}: {len(found)} replicated tensor(s) differ between ranks: {named}{more}. "
        "A tensor of a shared entry is saved from ONE rank and every rank resumes with that copy, so the resumed "
        "run will not be the one that was saved. BatchNorm statistics: keep DDP's buffer sync (broadcast_buffers="
        "True, the default) or use nn.SyncBatchNorm; state each rank keeps on purpose: set trainguard_rank_local = "
        "True on its entry (each rank saves and resumes its own); parameters: a rank diverged (a missed all-reduce, "
        "a rank-dependent update). Warned once per process (docs/distributed.md)."
    )
    try:
        warnings.warn(msg, ReplicasDifferWarning, stacklevel=2)
    except Warning:  # warnings turned into errors: the save goes on (every rank is mid-save), logged instead
        log.error("%s", msg)


def take(step: int) -> dict[str, Any] | None:
    """``policies.report_saved`` (the manager, rank 0, once the save committed): the finding of ``step``, once."""
    with _LOCK:
        return _FOUND.pop(step, None)
