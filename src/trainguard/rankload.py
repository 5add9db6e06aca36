"""Rank-local entries on load (``tg.RNGState()``, objects saved per rank): which saved rank's
state each rank takes, by the rule in docs/distributed.md ("Rank-local state when the world size
changes"). ``loader._load`` calls :func:`skeleton_for` on every rank for each such entry while it
plans the load, and runs what it deferred (:func:`run_deferred`) once the load has succeeded."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from . import split
from .errors import CorruptCheckpointError, StateMismatchError
from .manifest import Manifest
from .prefixhint import insert_hint
from .userframe import user_stacklevel


def _reseed(value: Any, rank: int, step: int) -> None:
    """``value.reseed_for_rank(rank, step=step)``; ``(rank)`` alone for an object of the user's
    whose method takes no ``step`` (the protocol before steps were passed)."""
    params = inspect.signature(value.reseed_for_rank).parameters
    if "step" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        value.reseed_for_rank(rank, step=step)
    else:
        value.reseed_for_rank(rank)


def skeleton_for(manifest: Manifest, key: str, value: Any, rank: int, world: int,
                 later: list[Callable[[], None]]) -> tuple[Any, int | None]:
    """This rank's skeleton for entry ``key`` and the saved rank it comes from (None for an entry
    saved once for all ranks). A rank the checkpoint has no state for whose object can re-seed
    itself gets ``(None, None)``, and the re-seeding goes to ``later``: a load refused after this
    (a state that does not fit, on this rank or another) leaves the object as it was."""
    obj = manifest.objects[key]
    if "skeleton" in obj:
        return obj["skeleton"], None
    ranks = obj["ranks"]
    if rank < len(ranks) and ranks[rank] is not None:  # None: saved by a stage without it (split_state)
        if len(ranks) != world:
            warnings.warn(
                f"{key}: saved by {len(ranks)} rank{'s' * (len(ranks) != 1)}, loading on {world}; rank {rank} takes saved "
                f"rank {rank}'s state",
                stacklevel=user_stacklevel(),
            )
        return ranks[rank], rank
    if hasattr(value, "reseed_for_rank"):
        def reseed() -> None:
            _reseed(value, rank, manifest.step)
            warnings.warn(f"{key}: no saved state for rank {rank} (saved by {len(ranks)} rank{'s' * (len(ranks) != 1)}); "
                          "re-seeded", stacklevel=user_stacklevel())

        later.append(reseed)
        return None, None
    src = split.saved_slot(ranks, rank)
    if src is None:
        raise CorruptCheckpointError(f"rank-local entry {key!r} lists no rank's state", entry=key)
    warnings.warn(f"{key}: no saved state for rank {rank}; taking saved rank {src}'s", stacklevel=user_stacklevel())
    return ranks[src], src


def run_deferred(later: list[Callable[[], None]]) -> None:
    """``loader._load``, after every entry was loaded: the re-seeding :func:`skeleton_for` deferred."""
    for f in later:
        f()


def split_hint(world: int, saved_world: int, *, sentence: bool = True) -> str:
    """What a strict load that finds the state holding part of the checkpoint (tensors or an
    optimizer's parameters it lacks) says about ``split_state=True`` (``mismatch_error``; an
    optimizer's ``OptimizerAdapter._match_groups``), ``world`` the loading world size and
    ``saved_world`` the saving one (the manifest's): the flag is for ranks that each hold part of
    the model (pipeline stages), so a one-process load of a checkpoint that one process saved gets
    no such advice (its model lacks layers the saved one had: before session 56 it was told to pass
    split_state=True, which would have loaded the part silently); one of a checkpoint saved by
    several ranks is told what the flag does in one process. ``sentence``: a sentence of its own
    (" ... ."), else a clause ("; ...")."""
    if world > 1:
        text = "ranks that each hold part of the model (pipeline stages) load with split_state=True"
    elif saved_world > 1:
        text = (f"the checkpoint was saved by {saved_world} ranks: to load into this one process the part of it that "
                "its state holds (one pipeline stage's), pass split_state=True; else build the state as at save time")
    else:
        return ""
    return f" {text[0].upper()}{text[1:]}." if sentence else f"; {text}"


def refuse_or_report(strict: bool, missing: list[str], unexpected: list[str], mismatched: list[str], manifest: Manifest,
                     ctx: Any, modules: set[str]) -> None:
    """``loader._load``, every rank, once the state's fit is known and before anything is read: with
    ``strict``, raise :func:`mismatch_error` when anything differs; without it, warn about the tensors of
    the ``modules`` (entry keys) that the load leaves alone, the state's that the checkpoint lacks (left
    as built: a layer added since the save, a model loaded from another architecture) and the
    checkpoint's that the state lacks (not read), as torch's ``load_state_dict(strict=False)`` returns
    them. Before session 56 ``tg.load(..., strict=False)`` said nothing of them (``restore`` named whole
    entries only), and a model half at its initial values looked loaded. Tensors of another shape are
    warned about by the loader (kept); entries and keys of plain dicts are not warned about here."""
    if strict and (missing or unexpected or mismatched):
        raise mismatch_error(missing, unexpected, mismatched, manifest, ctx.rank, ctx.world_size)
    if strict:
        return
    fresh, unread = ([p for p in side if p.split("/", 1)[0] in modules and "/" in p] for side in (missing, unexpected))
    if fresh or unread:
        parts = [f"{len(fresh)} left as they are, which the checkpoint lacks: {', '.join(fresh[:20])}"] * bool(fresh)
        parts += [f"{len(unread)} of the checkpoint's not read, which the state lacks: {', '.join(unread[:20])}"] * bool(unread)
        warnings.warn(f"strict=False: module tensors {'; '.join(parts)}{' ...' * (len(fresh) > 20 or len(unread) > 20)}"
                      " (a load with strict=True lists the differences with what to change)" + insert_hint(fresh, unread)[0],
                      stacklevel=user_stacklevel())


def record_keys(manifest: Manifest, missing: list[str], unexpected: list[str], mismatched: list[str]) -> None:
    """``loader._load``, every rank, once the state's fit is known (a strict load that got here found none):
    what the load leaves alone, on the manifest that ``tg.load`` returns, as torch's
    ``load_state_dict(strict=False)`` returns its missing and unexpected keys. ``missing_keys``: the
    state's entries and paths (``model/head.weight``: module tensors, plain-dict keys) the checkpoint
    lacks, left as they are; ``unexpected_keys``: the checkpoint's that the state lacks, not read;
    ``mismatched_keys``: tensors of another shape (or without memory, or no cast), kept as they are, by the
    checkpoint's path (``wrapnames.keyed``: a ``module.``-prefixed dict keeps its prefix there).
    Before review58b a fine-tune's ``strict=False`` load only warned them: a script had to parse the text."""
    manifest.missing_keys, manifest.unexpected_keys = list(missing), list(unexpected)  # type: ignore[attr-defined]
    manifest.mismatched_keys = list(mismatched)  # type: ignore[attr-defined]


def mismatch_error(missing: list[str], unexpected: list[str], mismatched: list[str], manifest: Manifest,
                   rank: int, world: int = 1) -> StateMismatchError:
    """``loader._load``'s strict refusal; when a rank-local entry that this rank took from another
    saved rank (the world grew: ``key@src/...``, src != rank) is among the differences, it says so
    and what to change: strict=False alone would leave that entry as built, with a warning.
    ``world``: the loading world size, for :func:`split_hint`."""
    err = StateMismatchError(missing=missing, unexpected=unexpected, mismatched=mismatched,
                             split=split_hint(world, manifest.world_size))
    borrowed = {}  # entry -> the saved rank whose state this rank took
    for line in mismatched:
        key, at, rest = line.partition("@")
        src = rest.split("/", 1)[0]
        if at and src.isdigit() and int(src) != rank and "ranks" in manifest.objects.get(key, {}):
            borrowed[key] = int(src)
    for key, took in borrowed.items():
        n = len(manifest.objects[key]["ranks"])
        err.args = (err.args[0] + (
            f" Rank {rank} has no saved state of the rank-local entry {key!r} (saved by {n} rank{'s' * (n != 1)}) and took "
            f"saved rank {took}'s, whose tensors do not fit its own: resume on {n} rank{'s' * (n != 1)}, give the entry a "
            f"reseed_for_rank(rank, step) method (a rank without saved state then starts it afresh), or leave it out "
            f"of the load (only=[...] without {key!r})."),)
    return err
