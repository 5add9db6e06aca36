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
    """``text`` (a rank's error) without its traceback; a bare traceback (``api``'s begin round): its last line."""
    head, tb, _ = text.partition(TRACEBACK)
    if not tb:
        return text
    return head.strip() if head.strip() else text.strip().splitlines()[-1]
