"""Split saves (``split_state=True``): one group writes a tensor that several groups hold.

Ranks with the same entries form a group (``split.groups``). A tensor that several groups hold
(a buffer every pipeline stage keeps; with expert parallelism on plain tensors, the whole
shared block on every rank) was written by every group, and rank 0 kept one group's chunks
(``split.dedupe``): the other copies stayed in the data files, unreferenced. Now, before a
byte is written, one round decides which group writes each such tensor (:func:`owners`, called
by ``api.persist_and_commit`` on every rank after the "begin" round); the other groups' ranks
take the same chunks as before (``capture.my_chunks``) and compute their block checksums in
memory (from each chunk's start, every ``block`` bytes, as a written chunk's), without writing
them, and report them with no file (:class:`Hashed`, ``api._write_rank``). ``split.dedupe``
then compares every group's checksums as before and commits the writing group's chunks.

The round, only with ``split_state`` and two or more groups: the first rank of each group sends
rank 0 its tensors' paths, dtypes, shapes and sizes (one gather: O(tensors of a group) per
group, nothing from the other ranks); rank 0 assigns each tensor that two or more groups hold
with the same dtype and shape to one of them, greedily, largest first, to the group with the
fewest bytes per rank so far (as DCP's ``dedup_save_plans`` balances its write items; ties to
the lowest rank: the same answer for the same reports), and broadcasts, for each group that
writes less than it holds, a bitmap over its sorted path list (base64). A rank that dies or
fails in the round fails the save on every rank (rank 0 broadcasts the failure; a rank waiting
for rank 0 gives up after the timeout), before any file is created.
"""

from __future__ import annotations

import base64
import heapq
from typing import Any

from .capture import Snapshot
from .dist import DistContext
from .errors import (
    CheckpointError,
    RankFailureError,
    describe_error,
    failure,
    failure_record,
    from_record,
    raise_failures,
)
from .manifest import checksum
from .split import groups


def _paths(snap: Snapshot) -> list[Any]:
    """The leaves a group's bitmap is over: every tensor of its shared entries (aliases too), by
    path. The entry signature covers them, so every rank of a group lists the same paths."""
    return sorted((lf for lf in snap.leaves if lf.kind != "local"), key=lambda lf: lf.path)


def proposal(snap: Snapshot) -> list[list[Any]]:
    """A group's first rank (:func:`owners`): ``[path, dtype, shape, bytes]`` of each tensor of
    :func:`_paths`; bytes -1 for one this group writes whatever rank 0 decides (an alias; a
    DTensor sharded over all ranks, format 2's regular parts, which no group dedupes)."""
    out = []
    for lf in _paths(snap):
        n = lf.tensor.element_size()
        for s in lf.shape:
            n *= s
        ok = lf.kind in ("replicated", "sharded") and lf.regular is None and lf.alias is None
        out.append([lf.path, lf.dtype, list(lf.shape), n if ok else -1])
    return out


def decide(reports: list[Any], sigs: list[str]) -> dict[str, str]:
    """Rank 0: the bitmap (base64, little-endian, bit i for the i-th path of that group's
    report) of the tensors each group's ranks hash and do not write, by the group's first rank;
    groups that write all they hold are left out. ``reports``: the "split-owners" gather, a
    proposal from each group's first rank (None from the others). Each tensor held by two or
    more groups with the same dtype and shape goes, largest first, to the holder with the fewest
    bytes per rank so far (ties: the lowest rank), a lazy heap per set of holders. 64 groups of
    6,096 tensors, 6,000 of them shared: 0.4 s (512 groups: 3.8-5.6 s; bench/split_owner_scale.py)."""
    size = {g[0]: len(g) for g in groups(sigs).values()}
    leaders = [r for r, rep in enumerate(reports) if rep and rep.get("items") is not None]
    held: dict[str, list[int]] = {}
    kind: dict[str, Any] = {}  # path -> [dtype, shape, bytes], or None: written by each holder
    for r in leaders:
        for item in reports[r]["items"]:
            held.setdefault(item[0], []).append(r)
            k = kind.setdefault(item[0], item[1:])
            if k is not None and (k != item[1:] or item[3] < 0):
                kind[item[0]] = None  # split.dedupe refuses a dtype or shape that differs
    shared = {path for path, rs in held.items() if len(rs) > 1 and kind[path] is not None}
    load = {r: sum(max(it[3], 0) for it in reports[r]["items"] if it[0] not in shared) for r in leaders}
    heaps: dict[tuple[int, ...], list[tuple[float, int]]] = {}
    owner: dict[str, int] = {}
    for neg, path, rs in sorted((-kind[p][2], p, tuple(held[p])) for p in shared):
        h = heaps.get(rs)
        if h is None:
            h = heaps[rs] = [(load[r] / size[r], r) for r in rs]
            heapq.heapify(h)
        while (top := h[0])[0] != load[top[1]] / size[top[1]]:  # stale: another set's tensor went there
            heapq.heapreplace(h, (load[top[1]] / size[top[1]], top[1]))
        load[top[1]] -= neg
        heapq.heapreplace(h, (load[top[1]] / size[top[1]], top[1]))
        owner[path] = top[1]
    out = {}
    for r in leaders:
        bits = bytearray((len(reports[r]["items"]) + 7) // 8)
        for i, item in enumerate(reports[r]["items"]):
            if owner.get(item[0], r) != r:
                bits[i >> 3] |= 1 << (i & 7)
        if any(bits):
            out[str(r)] = base64.b64encode(bytes(bits).rstrip(b"\0")).decode()
    return out


def owners(ctx: DistContext, snap: Snapshot, sigs: list[str], timeout: float | None) -> set[str]:
    """``api.persist_and_commit``, every rank, right after the "begin" round: the paths whose
    chunks this rank hashes and does not write (another group writes them). One gather
    ("split-owners") and one broadcast ("split-owned"), only with ``split_state`` and two or
    more groups (else the empty set, no round). Raises ``RankFailureError`` on every rank when
    a rank died or failed in the round."""
    if not snap.split or len(set(sigs)) < 2:
        return set()
    leader = groups(sigs)[sigs[ctx.rank]][0]
    mine: dict[str, Any] = {"error": None, "items": None}
    try:
        if leader == ctx.rank:
            mine["items"] = proposal(snap)
    except Exception as e:  # still joins the round: every rank raises it
        mine["error"] = describe_error(e)
    answer: dict[str, Any] | None = None
    try:
        got = ctx.gather("split-owners", mine, timeout=timeout)
    except RankFailureError as e:  # rank 0 only: a rank died or never came
        got, answer = None, failure_record(e)
    if got is not None:
        try:
            raise_failures("save", got, ctx)
            answer = {"value": decide(got, sigs)}
        except RankFailureError as e:
            answer = failure_record(e)
        except Exception as e:
            answer = failure_record(failure(f"save failed on rank 0: {e!r}", {0: describe_error(e)}))
    answer = ctx.broadcast("split-owned", answer, timeout=timeout)
    assert answer is not None
    if "error" in answer:
        raise from_record(answer)
    bits = answer["value"].get(str(leader))
    if not bits:
        return set()
    n = int.from_bytes(base64.b64decode(bits), "little")
    return {lf.path for i, lf in enumerate(_paths(snap)) if n >> i & 1}


class Hashed:
    """``api._write_rank``: the chunks of ``mine`` (``capture.my_chunks``) that this rank hashes
    instead of writing (``skip[i]``: its path is in :func:`owners`' answer), and their block
    checksums, computed from each chunk's start every ``block`` bytes, as ``io.write_batches``
    gives a written chunk's (so ``split.dedupe`` compares them with the writing group's)."""

    def __init__(self, mine: list[Any], paths: set[str], block: int) -> None:
        self.skip = [lf.path in paths and lf.regular is None for lf, _box in mine]
        self.block = block
        self.sums: dict[int, list[str]] = {}

    def keep(self) -> list[int]:
        """The indices (in ``mine``) of the chunks this rank writes."""
        return [i for i, s in enumerate(self.skip) if not s]

    def piece(self, i: int, start: int, data: memoryview) -> None:
        """Hash bytes ``start..`` of chunk ``i``: a whole chunk, or a piece starting on a block of
        it (``stagecopy.pack_batches`` splits a chunk so). Called before the bytes' buffer is reused."""
        if start % self.block:
            raise CheckpointError(f"split_state: a piece of chunk {i} starts at byte {start}, inside a block (internal error)")
        sums = self.sums.setdefault(i, [])
        first = start // self.block
        sums += [""] * (first + -(-len(data) // self.block) - len(sums))
        for b in range(0, len(data), self.block):
            sums[first + b // self.block] = checksum(data[b : b + self.block])

    def take(self, batch: list[tuple[int, int, Any]], as_bytes: Any) -> list[tuple[int, int, Any]]:
        """The async path's batch (``api._write_staged``, save thread): the pieces of skipped
        chunks hashed now, from the staged bytes (or, zero-copy, the live tensor while ``step()``
        still waits); returns the pieces to write."""
        out = []
        for item in batch:
            if self.skip[item[0]]:
                self.piece(item[0], item[1], as_bytes(item[2]))
            else:
                out.append(item)
        return out

    def fill(self, sums: list[list[str]]) -> list[list[str]]:
        """``sums`` (per chunk of ``mine``) with the skipped chunks' checksums; returns it."""
        for i, s in self.sums.items():
            sums[i] = s
        return sums

    def spread(self, keep: list[int], got: tuple[list[int], list[list[str]], list[str], dict[str, int]], cpu: list[memoryview]) -> Any:
        """The sync path: ``write_streams``' answer for the chunks ``keep`` spread over all of
        ``mine``, the skipped chunks hashed from ``cpu`` (their memory: training is blocked), and
        named with no file (``split.dedupe`` drops them). Nothing skipped (every unsplit save):
        ``got`` as it is, no per-chunk copy on the save path."""
        if len(keep) == len(self.skip):
            return got
        offsets, files = [0] * len(self.skip), got[3]
        sums: list[list[str]] = [[] for _ in self.skip]
        names: list[str | None] = [None] * len(self.skip)  # None: a skipped chunk, named with no file
        for j, i in enumerate(keep):
            offsets[i], sums[i], names[i] = got[0][j], got[1][j], got[2][j]
        for i, s in enumerate(self.skip):
            if s:
                self.piece(i, 0, cpu[i])
        return offsets, self.fill(sums), names, files

