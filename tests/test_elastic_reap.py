"""``trainguard run``'s agent sees a dead worker at once even when the worker's children (its
DataLoader processes) still hold its sentinel (elastic/reap.py). Before, torch's ``join`` learned
of the death only when those children ended: torch's loader watchdog ends them within 5 s
(5.1-5.2 s measured by the chaos review), so every restart of a real training run (loader
workers) started ~5 s late."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r'''
import os, signal, sys, time
import torch.multiprocessing as tmp
from torch.multiprocessing import ProcessExitedException
from trainguard.elastic.launcher import install_agent_hooks
from trainguard.events import EventLog

def worker(i, w):
    pid = os.fork()
    if pid == 0:  # a DataLoader-like child: inherits the write end of the worker's sentinel
        os.close(w[0])
        time.sleep(60)
        os._exit(0)
    os.write(w[1], str(pid).encode() + b"\n")
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    install_agent_hooks(EventLog(None, rank=-1), 5.0)
    r, w = os.pipe()
    pc = tmp.start_processes(worker, args=((r, w),), nprocs=1, start_method="fork", join=False)
    os.close(w)
    child = int(os.read(r, 64).split()[0])
    outcome = "not seen"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if pc.join(timeout=0.1):
                outcome = "joined"
                break
        except ProcessExitedException as e:
            alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split()[2] != "Z"
            outcome = f"seen dead ({e.exit_code}) child alive={alive}"
            break
    os.kill(child, signal.SIGKILL)
    print(outcome)
'''


def test_a_killed_worker_whose_child_holds_its_sentinel_is_seen_dead_at_once(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr[-3000:]
    # Seen while the child (which sleeps 60 s) still lives; before: "not seen" within 20 s.
    assert res.stdout.strip() == "seen dead (-9) child alive=True", (res.stdout, res.stderr[-3000:])


EARLY = r'''
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from trainguard.elastic import heartbeat
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 4))
for step in range(20):
    if rank == 0 and step == 3:
        print("rank0 returned", flush=True)
        break  # rank 1 goes on into step 3's all-reduce, whose peer is gone
    model(torch.randn(2, 4)).sum().backward()
    heartbeat(step)
'''


def test_a_run_path_rank_whose_script_returned_early_exits_so_its_peer_fails_in_seconds(tmp_path):
    """Before: torch kept a ``--run-path`` worker whose script returned waiting for all workers to be
    done, its gloo connections open: rank 1 waited in DDP's all-reduce until the hang watchdog (60 s
    floor), which then named one of the ranks hung (exit 75; rank 0 or 1, seen both). Now rank 0's process exits as a script worker's
    does: rank 1 fails on gloo's closed connection within seconds, and the failure is rank 1's."""
    from trainguard.events import read_events

    script = tmp_path / "early.py"
    script.write_text(EARLY)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "run", "--nproc-per-node", "2",
           "--start-method", "fork", "--run-path", "--max-restarts", "0", "--run-dir", str(run_dir), str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "rank0 returned" in p.stdout
    failures = [e for e in read_events(run_dir) if e["event"] == "failure"]
    # Rank 1's collective failed on the closed connection; before: {"0" or "1": "hang (watchdog)"}
    assert len(failures) == 1 and failures[0]["failures"] == {"1": "exit code 1"}, failures
