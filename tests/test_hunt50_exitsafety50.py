"""Exit safety (hunt50 exitsafety50): what is still running, or still held, when a trainguard
script's last line has run and the interpreter is about to finalize.

The script under test registers its own ``atexit`` hook before importing trainguard: hooks run in
reverse order, so it runs last, after trainguard's, just before finalization. It reports there
what a torchrun rank of ``trainguard bench`` had at that point (CI of 2026-12-07: rank 1 aborted
after the bench had finished, "terminate called without an active exception")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

_LAST_HOOK = textwrap.dedent(
    """
    import atexit, gc, json, os, sys, threading
    REPORT = {}

    def _last():  # registered before trainguard's hooks: runs after them, just before finalization
        gc.collect()
        ref = REPORT.pop("group_ref", None)
        REPORT["group_alive"] = ref is not None and ref() is not None
        tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
        names = []
        for t in tasks:
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass
        REPORT["gloo_threads"] = sorted(n for n in names if "gloo" in n)
        REPORT["py_threads"] = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        print("REPORT " + json.dumps(REPORT), flush=True)

    atexit.register(_last)
    """
)


def _run(body: str, tmp_path: Path, timeout: float = 60) -> dict:
    script = tmp_path / "script.py"
    script.write_text(_LAST_HOOK + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONFAULTHANDLER": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"no report from the last atexit hook\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.slow  # a subprocess importing torch._dynamo: 5-30 s, with the machine's load
def test_destroyed_group_is_not_left_for_finalization_after_an_optimizer_step(tmp_path: Path) -> None:
    """The first ``optimizer.step()`` after ``init_process_group`` imports torch._dynamo, which imports
    ``torch.distributed.nn.functional``, whose ``group=group.WORLD`` defaults then hold the group: after
    ``destroy_process_group`` gloo's threads still ran at the last atexit hook (old code: group alive,
    ``gloo_tcp_loop`` and 2 ``pt_gloo_runloop`` threads), so the group was torn down during finalization."""
    report = _run(
        """
        import socket, weakref
        import torch
        import torch.distributed as dist
        import trainguard as tg

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        net = torch.nn.Linear(8, 8)
        opt = torch.optim.Adam(net.parameters())
        net(torch.randn(4, 8)).sum().backward()
        opt.step()  # imports torch._dynamo (torch.distributed.nn.functional) while the group exists
        tg.save(sys.argv[1] + "/ckpt", {"model": net, "optim": opt}, async_=True)
        REPORT["group_ref"] = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        """,
        tmp_path,
    )
    assert report["gloo_threads"] == [], f"gloo's threads still run after the atexit hooks: {report}"
    assert not report["group_alive"], f"the destroyed group is still held at the end of the atexit hooks: {report}"
    assert not [t for t in report["py_threads"] if t.startswith("trainguard")], report
    assert (tmp_path / "ckpt" / "manifest.json").exists(), "the async save in flight at exit was not committed"


@pytest.mark.slow  # a subprocess importing torch: 3-17 s
def test_a_group_still_in_use_is_left_alone(tmp_path: Path) -> None:
    """The exit hook only lets go of destroyed groups: a script that never destroys its group keeps it
    (torch tears it down as before), and torch.distributed.nn.functional's defaults still name it."""
    report = _run(
        """
        import socket, weakref
        import torch
        import torch.distributed as dist
        import trainguard as tg
        from trainguard import staledefaults

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        import torch.distributed.nn.functional as F
        assert staledefaults.release_destroyed_groups() == 0
        REPORT["default_is_world"] = F.all_reduce.__defaults__[-1] is dist.group.WORLD
        """,
        tmp_path,
    )
    assert report["default_is_world"]
