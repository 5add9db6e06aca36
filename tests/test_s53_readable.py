"""``RankFailureError`` shows each rank's readable error, not its traceback (store53b). A rank that sent a bare
traceback of an error whose message has two lines was shown only the message's last line: the save's
"the run directory's lock ... was removed" line was lost (test_lock21_review failed). Now the whole
exception text after the last frame is shown; the full text stays in ``failures``."""

from __future__ import annotations

import traceback

from trainguard.errlines import readable
from trainguard.errors import CheckpointError, RankFailureError


def _bare(e: BaseException) -> str:
    try:
        raise e
    except BaseException:
        return traceback.format_exc()


def test_a_bare_traceback_shows_its_whole_exception_text() -> None:
    text = _bare(CheckpointError("the run directory's lock /r/.lock was removed\nStop this job and find out why"))
    assert readable(text) == "trainguard.errors.CheckpointError: the run directory's lock /r/.lock was removed\nStop this job and find out why"
    err = RankFailureError("save failed on rank(s) [0]", {0: text})
    assert ".lock was removed" in str(err) and "Traceback" not in str(err) and "Traceback" in err.failures[0]


def test_a_chained_traceback_shows_the_last_exception() -> None:
    try:
        try:
            raise ValueError("first")
        except ValueError:
            raise KeyError("second") from None
    except KeyError:
        text = traceback.format_exc()
    assert readable(text) == "KeyError: 'second'"
