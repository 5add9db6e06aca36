"""The commit's fence between ranks (``api.persist_and_commit``, in this order): :func:`check_begin` on
every rank with the "begin" round's answers, :func:`claim_commit` on rank 0 right before the manifest,
:func:`abandon_commit` on a rank whose "commit" broadcast failed. Split from :mod:`.commit` (which
reads checkpoints, without torch) as it takes a process group's context and the capture's checks.
"""

from __future__ import annotations

from typing import Any

from .capture import check_data_positions
from .dist import DistContext
from .errors import (
    CheckpointError,
    RankFailureError,
    StepExistsError,
    failure,
    failure_record,
    from_record,
    raise_failures,
    summary,
)
from .split import check_flags

_COMMITTING = {"committing": 0}


def claim_commit(ctx: DistContext, save_id: str) -> None:
    """Rank 0, right before the manifest (the first irreversible act): claim the commit. If a
    rank already gave up waiting for rank 0 (it was stopped or stalled for longer than that
    rank waits, ``abandon_commit``), raise its failure instead: a rank 0 that resumes late
    must not commit a save that the other ranks reported as failed."""
    first = ctx.fence(f"commit/{save_id}", _COMMITTING)
    if first != _COMMITTING:
        raise from_record(first)


def abandon_commit(ctx: DistContext, save_id: str, target: str, e: RankFailureError) -> None:
    """Any rank whose "commit" broadcast failed with ``e`` (another rank: rank 0 stopped responding
    or is too slow; rank 0: a rank had given up on it): forbid the commit (``claim_commit``) and
    raise ``e``; when rank 0 claimed it first, whether ``target`` got committed is unknown, and
    the error says so; so it does when the store stopped answering (the fence fails too)."""
    try:
        first = ctx.fence(f"commit/{save_id}", failure_record(e))
    except RankFailureError:  # the store stopped answering: nothing can forbid a rank 0 that resumes to commit
        raise failure(f"{summary(e)}. {target} may or may not be committed: rank 0 (the store's host, with env:// "
                      "rendezvous) may still commit it if it resumes (the manifest tells)", e.failures) from None
    if first != _COMMITTING:
        raise e
    raise failure(
        f"commit: rank 0 stopped responding while committing {target}; it may or may not be committed "
        f"(the manifest tells: a CheckpointManager resumes from it only if it is). {summary(e)}",
        {0: "stopped responding while committing"},
    ) from e



def check_begin(begin: list[Any], ctx: DistContext) -> None:
    """``api.persist_and_commit``, every rank, on the "begin" round's answers (rank 0's with
    :func:`occupied`'s): raise on every rank what one rank failed or what the ranks disagree on."""
    raise_failures("save", begin, ctx)
    if begin[0].get("exists"):
        raise StepExistsError(begin[0]["exists"])
    if begin[0].get("refused"):
        raise CheckpointError(begin[0]["refused"])
    for key, also in (("step", ""), ("name", " (the path's last part: not made from each rank's clock or rank)")):
        got = {r: b.get(key) for r, b in enumerate(begin)}  # a name differing: rank 0 looked for the others' files
        if off := [r for r, s in got.items() if s != got[0]]:  # in its own temp directory ("not on shared storage")
            raise RankFailureError(
                f"save: ranks disagree on the {key}: {got}; every rank must save the same {key}{also}",
                {r: f"called save with {key} {got[r]}, rank 0 with {got[0]}" for r in off},
            )
    check_flags([bool(b.get("split")) for b in begin], [b["sig"] for b in begin])
    check_data_positions(begin)
