"""Split states: ranks that hold different parts of the state (``split_state=True``).

Pipeline parallelism gives each stage's ranks their own layers (torchtitan keeps the full
model's names: stage 0 holds ``layers.0-3``, stage 1 ``layers.4-7``); expert parallelism gives
ranks different experts. By default a save refuses ranks whose entries differ (a rank that
built another model by mistake is caught at the first save); with ``split_state=True`` on every
rank, the checkpoint holds the union:

- ranks with the same entries (the same ``Snapshot.entry_sig``) form a *group* (a stage); the
  group's replicated tensors are spread over its ranks (``capture.my_chunks``), DTensors are
  written by their owners as always;
- a tensor that several groups hold (a buffer every stage keeps; with expert parallelism on
  plain tensors, the shared block) is written by one group, chosen before the writes to balance
  the groups' bytes (``splitplan.owners``); the other groups compute the block checksums of the
  same chunks in memory, without writing them, and those must be equal (:func:`dedupe`), or the
  save fails naming the tensor and the ranks. The data files hold one copy;
- rank 0 merges the entries' skeletons (:class:`Merger`): dicts are united, and an optimizer's
  parameter groups by position, their ``params`` lists joined (the other hyperparameters must
  be equal).

A load with ``split_state=True`` reads into each rank the entries its state holds
(:func:`prune`): a module takes its own tensors, an optimizer its own parameters' state and
its groups restricted to them. Loading a split checkpoint into one unsplit state (the whole
model on one rank, ``trainguard consolidate``) needs no flag: the union is an ordinary checkpoint.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any, NoReturn

from .errors import CheckpointError, RankFailureError, UnsupportedValueError
from .flatten import single_tensor, tensor_refs


def groups(sigs: list[str]) -> dict[str, list[int]]:
    """Each distinct entry signature -> the ranks that passed it, in rank order."""
    out: dict[str, list[int]] = {}
    for r, s in enumerate(sigs):
        out.setdefault(s, []).append(r)
    return out


def check_flags(flags: list[bool], sigs: list[str]) -> None:
    """``api._check_begin``, every rank: all ranks passed the same ``split_state``, and without
    it the same entries (the error says what to pass when ranks differ on purpose)."""
    if len(set(flags)) > 1:
        on = [r for r, f in enumerate(flags) if f]
        raise RankFailureError(
            f"save: rank(s) {on} passed split_state=True and the others not; pass the same on every rank",
            {r: f"split_state={flags[r]}, rank 0's {flags[0]}" for r in range(len(flags)) if flags[r] != flags[0]},
        )
    if flags and flags[0]:
        return
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if bad:
        raise RankFailureError(
            f"save: rank(s) {bad} passed a different set of entries/tensors than rank 0; every rank must "
            "save the same state keys with the same tensor names, shapes and dtypes (and the same tied tensors). "
            "If ranks hold different parts of the model on purpose (pipeline stages, experts), pass "
            "split_state=True to every save and load (docs/distributed.md)",
            {r: "state differs from rank 0's" for r in bad},
        )


def load_flags_differ(flags: list[bool]) -> CheckpointError | None:
    """``errors.agree_load``, the "load" round, every rank: the error when ranks passed different
    ``split_state`` to a load. Before, a flag on some ranks only sent them to ``check_taken``'s
    round and the others elsewhere: "ranks called different trainguard operations" on every rank."""
    if len(set(flags)) < 2:
        return None
    from .permanent import mark

    return mark(CheckpointError(
        f"load: rank(s) {[r for r, f in enumerate(flags) if f]} passed split_state=True and rank(s) "
        f"{[r for r, f in enumerate(flags) if not f]} did not; pass the same on every rank (split_state=True on every "
        "rank when ranks hold different parts of the model: pipeline stages, experts)"
    ))


def leader_report(snap: Any, sigs: list[str], rank: int) -> dict[str, Any] | None:
    """``api._write_rank``: what rank 0 cannot know of this rank's group: its entries' skeletons
    and the tensors that have no chunk to report (aliases, empty tensors). Sent by the first
    rank of each group other than rank 0's; None from every other rank."""
    if not snap.split or sigs[rank] == sigs[0] or groups(sigs)[sigs[rank]][0] != rank:
        return None
    return {
        "skeletons": {k: v for k, v in snap.objects.items() if k not in snap.rank_local},
        "classes": getattr(snap, "classes", {}),  # scheduler entries' classes (schedclass.py)
        "leaves": [[lf.path, lf.dtype, list(lf.shape), lf.alias] for lf in snap.leaves if lf.kind != "local"],
    }


def dedupe(written: list[dict[str, Any]], sigs: list[str]) -> None:
    """Rank 0, before the manifest is built: keep each path's chunks from one group only (the
    group that wrote them, ``splitplan.owners``; else that of its lowest writing rank), after
    checking that every other group hashed (or wrote) the same bytes (block checksums) for the
    same boxes; a group with other boxes (a tensor sharded differently) is refused
    (:func:`_refuse_overlap`). Replicated tensors are in the same row boxes in every group
    (``capture.my_chunks``). Chunks hashed and not written (no file) are never kept. Modifies
    the reports' chunk lists in place."""
    gid = {r: g[0] for g in groups(sigs).values() for r in g}
    owner: dict[str, int] = {}  # path -> its group (the group's first rank)
    kind: dict[str, tuple[int, str, list[int]]] = {}  # path -> (first writer, dtype, shape)
    for r, w in enumerate(written):
        for c in w["chunks"]:
            if len(c) < 9 or c[8] is not None:  # written, not only hashed
                owner.setdefault(c[0], gid[r])
            first = kind.setdefault(c[0], (r, c[1], list(c[2])))
            if first[1:] != (c[1], list(c[2])):
                raise UnsupportedValueError(
                    f"split_state: tensor {c[0]!r} is {first[1]}{first[2]} on rank {first[0]} and {c[1]}{list(c[2])} on "
                    f"rank {r}; a tensor that several stages hold must have the same shape and dtype on each"
                )
    kept: dict[tuple[Any, ...], tuple[int, Any]] = {}  # (path, offsets, sizes) -> (writer, block checksums)
    boxes: dict[str, list[tuple[int, list[int], list[int]]]] = {}  # path -> its kept chunks' (writer, offsets, sizes)
    dropped: list[tuple[int, Any]] = []
    for r, w in enumerate(written):
        mine = []
        for c in w["chunks"]:
            if owner.get(c[0]) == gid[r] and (len(c) < 9 or c[8] is not None):
                kept[(c[0], tuple(c[3]), tuple(c[4]))] = (r, c[7])
                boxes.setdefault(c[0], []).append((r, c[3], c[4]))
                mine.append(c)
            else:
                dropped.append((r, c))
        w["chunks"] = mine
    bad: dict[str, str] = {}  # path -> why it is refused (the first chunk found), every such tensor named
    for r, c in dropped:
        k = kept.get((c[0], tuple(c[3]), tuple(c[4])))
        if c[0] not in owner:
            raise CheckpointError(f"split_state: no rank wrote tensor {c[0]!r}, which rank {r} hashed (internal error)")
        if k is None:  # another box: block checksums (from each chunk's start) cannot be compared
            why = _refuse_overlap(c, r, boxes.get(c[0], []))
        elif k[1] != c[7]:
            why = (
                f"split_state: tensor {c[0]!r} is held by rank {k[0]} and rank {r} (different stages) with different "
                "values; give each stage's copy its own name, or make the entry rank-local (trainguard_rank_local = True)"
            )
        else:
            continue
        if why:
            bad.setdefault(c[0], why)
    if bad:  # the groups that write a tensor vary (balanced): the first found is any of them
        head, *more = sorted(bad)
        also = f" (also refused: {', '.join(map(repr, more[:8]))}{', ...' if len(more) > 8 else ''})" if more else ""
        raise UnsupportedValueError(bad[head] + also)


def _refuse_overlap(c: list[Any], rank: int, kept: list[tuple[int, list[int], list[int]]]) -> str | None:
    """``dedupe``: a chunk of another group whose box is none of the committed chunks' boxes
    (the stages shard the tensor differently: FSDP over meshes of other sizes, a DTensor on one
    stage and a plain tensor on another) fails the save if it overlaps one of them, since its
    values cannot be checked against theirs (an empty chunk overlaps nothing): the error, or None."""
    for w, offs, sizes in kept:
        if all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(offs, sizes, c[3], c[4], strict=True)):
            return (
                f"split_state: tensor {c[0]!r} is held by rank {w} and rank {rank} (different stages) sharded differently "
                f"(offsets {list(offs)} sizes {list(sizes)}, and {list(c[3])} {list(c[4])}), so their values cannot be "
                "compared; shard it the same way on every stage that holds it (the same mesh size and placements), give "
                "each stage's copy its own name, or make the entry rank-local (trainguard_rank_local = True)"
            )
    return None


def add_reported(tensors: dict[str, Any], objects: dict[str, Any], written: list[dict[str, Any]], entry: Any) -> None:
    """Rank 0, in ``api._build_manifest``: the other groups' skeletons merged into ``objects``,
    and their tensors without chunks (aliases, empty tensors) added to ``tensors``; rank-local
    entries that rank 0 does not hold (a data loader's state on the first stage only) get their
    per-rank list too (None for the ranks without it), as rank 0's own have in ``_build_manifest``."""
    for w in written:
        for key in w.get("objects") or {}:
            if key not in objects:
                objects[key] = {"ranks": [(w2.get("objects") or {}).get(key) for w2 in written]}
    merger = Merger()
    for r, w in enumerate(written):
        rep = w.get("split")
        if not rep:
            continue
        for path, dtype, shape, alias in rep["leaves"]:
            tensors.setdefault(path, entry(dtype, shape, [], None, alias))
        for key, skel in rep["skeletons"].items():
            mine = (had := objects.get(key) or {}).get("skeleton")
            c = had.get("class", (rep.get("classes") or {}).get(key))  # a scheduler's (schedclass.py): whose values won
            objects[key] = {"skeleton": merger.merge(mine, skel, key, r) if mine is not None else skel,
                            **({"class": c} if type(c) is str else {})}


def merge(into: Any, other: Any, where: str, rank: int) -> Any:
    """The union of two skeletons of one entry (rank 0's ``into``, the first rank of another
    group's ``other``), neither modified: :class:`Merger` for one pair (tests, callers outside
    a save). ``add_reported`` keeps one :class:`Merger` for all the groups of a save."""
    return Merger().merge(into, other, where, rank)


class Merger:
    """Rank 0 (``add_reported``): the union of every group's skeletons, merged in place into
    copies of the containers it changes (each copied once, when first changed: rank 0's snapshot,
    the reports and ``merge``'s arguments are left as they were), with
    the parameter names of each optimizer group and the group of each parameter kept as the
    groups are merged. A merge costs the size of ``other``, not of the union so far: linear in
    the reports (512 groups of 2,032 Adam parameters, 2,000 of them shared: 0.6 s, was 5.6 s).

    Dicts are united key by key; lists of equal length merged element by element, except an
    optimizer group's ``params`` (united: :meth:`_join_params`); other values must be equal."""

    def __init__(self) -> None:
        self.owned: set[int] = set()  # ids of the containers this merger made (changed in place)
        self.names: dict[str, set[str]] = {}  # an optimizer group (by its path) -> its params
        self.group_of: dict[str, dict[str, int]] = {}  # a param_groups list (by path) -> param -> its group

    def _own(self, v: Any) -> Any:
        if id(v) not in self.owned:
            v = dict(v) if type(v) is dict else list(v)
            self.owned.add(id(v))
        return v

    def merge(self, into: Any, other: Any, where: str, rank: int) -> Any:
        """The union of ``into`` (what this merger holds so far, or rank 0's) and ``other``."""
        if into is other or into == other:  # as the walk below gives, at C speed: a shared layer's state
            return into
        if type(into) is dict and type(other) is dict and single_tensor(into) is None and single_tensor(other) is None:
            out = self._own(into)
            joined = self._join_params(out, other, where)
            for k, v in other.items():
                if k in joined:
                    out[k] = joined[k]
                elif k not in out:
                    out[k] = v
                elif (x := out[k]) is not v and x != v:  # equal: the test above, without a call per shared parameter
                    out[k] = self.merge(x, v, f"{where}/{k}", rank)
            return out
        if type(into) is list and type(other) is list and len(into) == len(other):
            out = self._own(into)
            for i, b in enumerate(other):
                out[i] = self.merge(out[i], b, f"{where}/{i}", rank)
            if where.endswith("/param_groups"):
                self._one_group_each(out, other, where, rank)
            return out
        _refuse(into, other, where, rank)

    def _join_params(self, into: dict[str, Any], other: dict[str, Any], where: str) -> dict[str, Any]:
        """``merge``, for an optimizer's parameter group (a dict whose ``params`` are names): its
        ``params`` (and ``param_names``, kept beside them) united, ``into``'s first. A parameter
        that both stages' optimizers hold (the shared layers of expert-parallel ranks, a tied
        embedding of the first and last stage) is listed once: its state tensors, held by both,
        are written by one and checked to be equal (:func:`dedupe`). Empty for any other dict."""
        a, b = into.get("params"), other.get("params")
        if type(a) is not list or type(b) is not list or not set(map(type, b)) <= {str}:
            return {}
        if where not in self.names:
            if not set(map(type, a)) <= {str}:
                return {}
            self.names[where] = set(a)
        have = self.names[where]
        keep = [i for i, n in enumerate(b) if n not in have]
        na, nb = into.get("param_names"), other.get("param_names")
        out: dict[str, Any] = {"params": self._own(a)}
        if type(na) is list and type(nb) is list and len(na) == len(a) and len(nb) == len(b):
            out["param_names"] = self._own(na)
            out["param_names"] += [nb[i] for i in keep]
        out["params"] += [b[i] for i in keep]
        have.update(b[i] for i in keep)
        return out

    def _one_group_each(self, groups: list[Any], other: list[Any], where: str, rank: int) -> None:
        """``merge``, after joining an optimizer's groups by position: a parameter that two
        stages' optimizers hold must be in the same group on each (else the union lists it twice).
        The first time, every parameter of ``groups``; then only ``other``'s."""
        first = where not in self.group_of
        seen = self.group_of.setdefault(where, {})
        for i, g in enumerate(groups if first else other):
            for n in g.get("params", []) if type(g) is dict and type(g.get("params")) is list else []:
                if seen.setdefault(n, i) != i:
                    raise UnsupportedValueError(
                        f"split_state: {where}: parameter {n!r} is in group {min(seen[n], i)} of one stage's optimizer and in "
                        f"group {max(seen[n], i)} of another's (rank 0's or rank {rank}'s); a parameter several stages hold "
                        "must be in the same group on each"
                    )


def _refuse(into: Any, other: Any, where: str, rank: int) -> NoReturn:
    """``Merger.merge``: two values of one entry that cannot be united, named."""
    if where.endswith("/param_groups") and type(into) is list and type(other) is list:
        raise UnsupportedValueError(
            f"split_state: {where}: rank 0's stage has {len(into)} parameter group(s), rank {rank}'s {len(other)}; groups "
            "are joined by position, so build every stage's optimizer with the same groups in the same order (a group "
            "may be empty: {'params': [], ...} where a stage has no such parameters)"
        )
    if "/param_groups/" in where:
        raise UnsupportedValueError(
            f"split_state: {where} is {_short(into)} on rank 0's stage and {_short(other)} on rank {rank}'s; groups are "
            "joined by position and each hyperparameter must be the same on every stage (per-stage values are not supported)"
        )
    if type(into) is list and type(other) is list:
        into, other = f"{len(into)} items: {_short(into)}", f"{len(other)} items: {_short(other)}"
    raise UnsupportedValueError(
        f"split_state: {where} differs between rank 0 ({into if type(into) is str else _short(into)}) and rank {rank} "
        f"({other if type(other) is str else _short(other)}); a value that each stage holds must be the same on every "
        "rank (or rank-local: trainguard_rank_local = True)"
    )


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def prune(skel: Any, current: Any, module: bool = False) -> Any:
    """A load with ``split_state=True`` (``loader._load``, every rank): an entry's skeleton with
    only the keys of ``current``, the entry's own state (a module's ``state_dict()``, a dict):
    the other stages' tensors are left to the ranks that hold them. A key without tensors (a
    step counter, a config value) is kept: it is every stage's, and a dict that the load fills
    (``tg.StateDict()``) gets it as without the flag. Not in a ``module``'s: a key of its state
    dict without tensors is a submodule's extra state, which only the stage holding it takes."""
    if type(skel) is not dict or single_tensor(skel) is not None or not isinstance(current, dict):
        return skel
    if any(type(k) is not str or k.startswith("$") for k in skel):  # an encoded dict or tuple: not pruned
        return skel
    return {k: v for k, v in skel.items() if k in current or not module and not tensor_refs(v)}


def prune_optimizer(skel: Any, names: Iterable[str]) -> Any:
    """As :func:`prune`, for an optimizer's entry: its ``state`` and its groups' ``params``
    restricted to ``names``, the optimizer's own parameters (both spellings: ``stateful``)."""
    if type(skel) is not dict:
        return skel
    have = set(names)
    out = dict(skel)
    if type(skel.get("state")) is dict:
        out["state"] = {n: s for n, s in skel["state"].items() if n in have}
    if type(skel.get("param_groups")) is list:
        out["param_groups"] = [_group(g, have) for g in skel["param_groups"]]
    return out


def _group(g: Any, have: set[str]) -> Any:
    if type(g) is not dict or type(g.get("params")) is not list:
        return g
    keep = [i for i, n in enumerate(g["params"]) if n in have]
    out = {**g, "params": [g["params"][i] for i in keep]}
    if type(g.get("param_names")) is list and len(g["param_names"]) == len(g["params"]):
        out["param_names"] = [g["param_names"][i] for i in keep]
    return out


def saved_slot(ranks: list[Any], rank: int) -> int | None:
    """``loader._skeleton_for``, for a rank-local entry whose saved slot for ``rank`` is missing
    (the world grew) or None (saved by a stage without the entry, ``split_state``) and whose
    object cannot re-seed: the saved rank whose copy ``rank`` takes, ``rank % W`` over the W
    saved ranks that hold one (every saved rank, without ``split_state``). None if none does."""
    if rank < len(ranks) and ranks[rank] is not None:
        return rank
    held = [i for i, s in enumerate(ranks) if s is not None]
    return held[rank % len(held)] if held else None


def refuse_full(split: bool, layout: str) -> None:
    """``api.save``: a full layout is written by rank 0 alone, which does not hold other stages' tensors."""
    if split and layout == "full":
        raise CheckpointError(
            "split_state=True with layout='full': rank 0 writes a full checkpoint alone and does not hold the other "
            "ranks' tensors; save sharded (the default) and make a full copy offline with `trainguard consolidate`"
        )


def check_taken(ctx: Any, manifest: Any, taken: set[str], timeout: float | None) -> None:
    """A strict load with ``split_state=True`` (``loader.load``, every rank, after the "load"
    round agreed that every rank's state fits): every tensor of the checkpoint's entries
    (rank-local ones aside) is read by some rank, so a stage built without some of the saved
    layers does not load silently. Rank 0 gathers one bit per tensor from each rank and
    broadcasts the tensors that no rank takes; every rank then raises."""
    from .permanent import mark

    expected = [p for obj in manifest.objects.values() if "skeleton" in obj for p in tensor_refs(obj["skeleton"])]
    bits = sum(1 << i for i, p in enumerate(expected) if p in taken)
    got = ctx.gather("split-taken", base64.b64encode(bits.to_bytes((len(expected) + 7) // 8, "little")).decode(), timeout=timeout)
    untaken = None
    if got is not None:
        union = 0
        for g in got:
            union |= int.from_bytes(base64.b64decode(g), "little")
        untaken = [p for i, p in enumerate(expected) if not union >> i & 1]
    untaken = ctx.broadcast("split-untaken", untaken, timeout=timeout)
    if untaken:
        raise mark(CheckpointError(
            f"split_state: no rank's state holds {len(untaken)} tensor(s) of the checkpoint: {untaken[:8]}; build the "
            "stages with every layer the checkpoint has, or pass strict=False (or only=[...]) to load part of it"
        ))
