"""A rank's error as the text ranks exchange (``errors.describe_error``) and as a ``RankFailureError`` shows it.

The text is the error's one readable line (``errors.error_text``), then its traceback. ``RankFailureError`` keeps
the whole text in ``failures`` and shows only the readable part: an object store's error (a save's upload timed
out, ``TimeoutError: ... did not answer ... within 10 s``) came after ~40 lines of asyncio and aiobotocore frames.
"""

from __future__ import annotations

import traceback

TRACEBACK = "Traceback (most recent call last):"


def with_traceback(line: str, e: BaseException) -> str:
    """``line`` (the readable cause), then ``e``'s traceback (``errors.describe_error``, on the failing rank)."""
    return f"{line}\n{''.join(traceback.format_exception(e))}"


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
