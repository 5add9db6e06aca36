"""Hunt 55 (store55): why store54's two-saves test failed after review54d's 2-rank test in one pytest process.

Found: the library saved correctly; the test read another server. Each test module that imports the ``weed`` fixture
(``from test_storage_s3 import weed``) got a session fixture of its own from pytest, so a second SeaweedFS server
started for ``test_hunt54_store54.py`` and AWS_ENDPOINT_URL moved to it. review54d's test had started
dist_helper's forkserver while the first server's endpoint was set; store54's saver processes, forked from it, kept
that endpoint: save A committed a checkpoint that verifies on the first server (B failed with ConcurrentSaveError,
A's objects untouched), and the test's ``tg.verify`` and fresh s3fs looked at the second ("no such checkpoint
directory"). Now one server per pytest process, and store54's savers get the test's AWS_* variables passed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import pytest

from test_storage_s3 import weed  # noqa: F401  (the session's server; skips without `weed`)

from conftest import TESTS, run_py
from dist_helper import _context


def _child_endpoint(q) -> None:
    q.put(os.environ.get("AWS_ENDPOINT_URL"))


def test_a_forkserver_child_talks_to_the_server_this_module_reads(weed):  # noqa: F811
    """A child of dist_helper's forkserver, started with no environment passed, has the endpoint the forkserver
    started with. Where that is an S3 endpoint (a ``weed`` fixture had set it: review54d's test before this one, as
    in the next test's run), it is this module's server. Before, after another module's S3 test it was that
    module's own server, still running."""
    ctx = _context()
    q = ctx.Queue()
    p = ctx.Process(target=_child_endpoint, args=(q,))
    p.start()
    try:
        got = q.get(timeout=60)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()  # by PID: the child started above
            p.join(10)
    assert os.environ["AWS_ENDPOINT_URL"] == weed.endpoint
    if got is not None:  # None: the forkserver started before any weed fixture (an earlier non-S3 test)
        assert got == weed.endpoint, f"a child saves to {got}, the test reads {weed.endpoint}"


@pytest.mark.slow  # an order-of-tests regression guard (two files' tests in one process): `make test-slow` (suite time)
def test_store54s_two_saves_pass_after_review54ds_two_rank_test_in_one_process():
    """The session-54 failure, in a pytest process of its own: review54d's another-prefix test, the test above and
    store54's two-saves test in one of the 2 plans (of 3) that failed. Before, the test above and that plan failed
    ("no such checkpoint directory": save A had returned, its checkpoint on review54d's server)."""
    ids = [
        f"{TESTS}/test_hunt54_review54d.py::test_a_rank_saving_to_another_prefix_is_not_told_as_another_jobs_removal",
        f"{TESTS}/test_hunt55_store55.py::test_a_forkserver_child_talks_to_the_server_this_module_reads",
        f"{TESTS}/test_hunt54_store54.py::test_two_saves_of_one_s3_step_at_once_never_both_return[manifest_last]",
    ]
    base = tempfile.mkdtemp(prefix="tg55-")  # short: the server's unix sockets go in it (tmp_path's is too long)
    try:
        r = run_py(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", f"--basetemp={base}", *ids],
                   timeout=420)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"\b3 passed\b", out), out[-6000:]
