"""``trainguard run`` on a torch whose agent API differs from the pinned one. Seen on a GPU
machine with torch 2.11: its ``LocalElasticAgent._shutdown(death_sig, is_restart)`` takes no
``timeout``, and every restart (and the stop after a failure) ended the agent with ``TypeError``.
The old signature is put back here on torch's class, in a child interpreter (bounded in time)."""

from __future__ import annotations

import json
import textwrap

from conftest import run_py

AGENT = """\
    import json, signal, sys
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    calls, closes = [], []

    # Without timeout, as torch 2.11's. **later: torch 2.13's own run() (kept here) calls
    # _shutdown(timeout=...) once at the end; 2.11's run() did not.
    def _shutdown(self, death_sig=signal.SIGTERM, is_restart=False, **later):
        caller = sys._getframe(1)
        while caller.f_code.co_name == "shutdown":  # trainguard's wrapper (install_signal_once)
            caller = caller.f_back
        if later and caller.f_code.co_name != "run":
            raise TypeError(f"_shutdown() got an unexpected keyword argument {next(iter(later))!r}")
        calls.append(is_restart)
        if self._worker_watchdog is not None:
            self._worker_watchdog.stop()
            self._worker_watchdog = None
        if self._health_check_server is not None:
            self._health_check_server.stop()
            self._health_check_server = None
        if self._pcontext:
            self._pcontext.close(death_sig)

    def _stop_workers(self, worker_group, is_restart=False):
        self._shutdown(is_restart=is_restart)

    real_close = api.PContext.close

    def close(self, death_sig=None, timeout=30):
        closes.append(timeout)
        return real_close(self, death_sig, timeout)

    LocalElasticAgent._shutdown = _shutdown
    LocalElasticAgent._stop_workers = _stop_workers
    api.PContext.close = close
    from trainguard.elastic.launcher import main
    rc = main(sys.argv[2:])
    json.dump({"rc": rc, "shutdown_is_restart": calls, "close_timeouts": closes}, open(sys.argv[1], "w"))
"""

WORKER = """\
    import os, sys
    marker = sys.argv[1]
    if not os.path.exists(marker):  # the first attempt fails: the agent restarts the worker
        open(marker, "w").close()
        sys.exit(3)
"""


def test_a_restart_works_with_an_agent_shutdown_that_takes_no_timeout(tmp_path):
    (tmp_path / "agent.py").write_text(textwrap.dedent(AGENT))
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    out = tmp_path / "out.json"
    r = run_py([str(tmp_path / "agent.py"), str(out), "--nproc-per-node", "1", "--max-restarts", "1",
                "--stop-timeout", "7", "--run-dir", str(tmp_path / "run"),
                str(tmp_path / "worker.py"), str(tmp_path / "marker")], timeout=120)
    assert r.returncode == 0 and out.exists(), r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["rc"] == 0  # restarted once, the second attempt succeeded
    assert got["shutdown_is_restart"]  # torch's _shutdown ran (it also stops the watchdog)
    assert 7 in got["close_timeouts"]  # the workers were closed with --stop-timeout, not torch's 30 s
    events = [json.loads(x)["event"] for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert "restart" in events and "failure" in events


def test_one_node_without_an_endpoint_gets_c10d_on_a_free_port_whatever_the_torch(tmp_path, monkeypatch):
    """``trainguard run --nproc-per-node 2 train.py`` on one node: a c10d store on a free port
    (docs/elastic.md's table). torch 2.13's ``run()`` switches such a static rendezvous itself;
    torch 2.11 kept it static on port 29500 (``EADDRINUSE`` was seen on the GPU machine when two
    such agents ran at once). ``prepare`` now switches it, whatever the torch."""
    import os

    from trainguard.elastic.launcher import build_parser, prepare

    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare() writes the agent's environment
    args = build_parser().parse_args(["--nproc-per-node", "2", "--run-dir", str(tmp_path), "x.py"])
    prepare(args)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:0") and args.rdzv_id != "none"
    assert "keep_alive_interval=1" in args.rdzv_conf  # trainguard's c10d defaults came with it
    for given in (["--master-port", "29555"], ["--nnodes", "2"], ["--rdzv-endpoint", "10.0.0.1:29400"]):
        a = build_parser().parse_args([*given, "--run-dir", str(tmp_path), "x.py"])
        prepare(a)
        assert a.rdzv_backend == "static", given  # a port, several nodes or an endpoint: as given
