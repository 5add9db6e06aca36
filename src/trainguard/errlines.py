"""A rank's error as the text ranks exchange (``errors.describe_error``) and as a ``RankFailureError`` shows it.

The text is the error's one readable line (``errors.error_text``), then its traceback. ``RankFailureError`` keeps
the whole text in ``failures`` and shows only the readable part: an object store's error (a save's upload timed
out, ``TimeoutError: ... did not answer ... within 10 s``) came after ~40 lines of asyncio and aiobotocore frames.
Its text is bounded (:func:`rank_lines`): ranks that failed alike are shown once, under all their numbers, and a
long error keeps its start and its end (where a message says what to change).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

TRACEBACK = "Traceback (most recent call last):"


def with_traceback(line: str, e: BaseException) -> str:
    """``line`` (the readable cause), then ``e``'s traceback (``errors.describe_error``, on the failing rank)."""
    return f"{line}\n{''.join(traceback.format_exception(e))}"


def described(e: BaseException, text: Callable[[], str]) -> str:
    """``text()`` (``errors.describe_error``'s text of ``e``), or, where ``e``'s ``str()`` raised in it, ``e``'s
    type and traceback, as ``traceback`` writes such an error."""
    try:
        return text()
    except Exception as bad:
        return with_traceback(f"{type(e).__name__}: <exception str() failed: {type(bad).__name__}>", e)


def readable(text: str) -> str:
    """``text`` (a rank's error) without its traceback; a bare traceback: its exception's text, every line of it
    (what follows the last frame: a message of two lines lost its first, "... .lock was removed ...")."""
    head, tb, _ = text.partition(TRACEBACK)
    if not tb:
        return text
    if head.strip():
        return head.strip()
    lines = text.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    i = frames[-1] + 1 if frames else 1
    while i < len(lines) and lines[i].startswith("    "):  # the frame's source line and its ^^^ marks
        i += 1
    return "\n".join(lines[i:]).strip() or lines[-1]


BUDGET = 32_000  # characters of RankFailureError's text for its ranks' errors, about (each at least SHORTEST)
SHORTEST = 400


def rank_lines(failures: dict[int, str]) -> str:
    """``RankFailureError``'s text after its first line (``errors.RankFailureError.__init__``, on every rank that
    raises it): each failing rank's :func:`readable` error under ``--- rank N ---``; ranks whose errors read the
    same are one block, ``--- ranks 0-62, 63 ---`` (64 ranks that ran out of disk alike repeated it 64 times); each
    block cut to its share of ``BUDGET`` (a rank's 100 KB message made a text of 100 KB per rank, 6.4 MB for 64)."""
    groups: dict[str, list[int]] = {}
    for r, text in sorted(failures.items()):
        groups.setdefault(readable(text), []).append(r)
    room = max(SHORTEST, BUDGET // max(1, len(groups)))
    return "\n".join(f"--- rank{'s' if len(rs) > 1 else ''} {_spans(rs)} ---\n{_cut(t, room, rs[0])}" for t, rs in groups.items())


def _spans(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def _cut(text: str, room: int, rank: int) -> str:
    """``text`` at most about ``room`` characters: its first two thirds and its last third kept."""
    if len(text) <= room:
        return text
    head, tail = room * 2 // 3, room // 3
    return (f"{text[:head]}\n[... {len(text) - head - tail} characters left out: the whole error is in "
            f"RankFailureError.failures[{rank}] ...]\n{text[-tail:]}")
