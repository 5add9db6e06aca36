"""Flakes of the suite under load (session 50, helper flakes50).

``trainguard run``'s workers' ``MASTER_PORT`` (elastic/masterport.py): torch's agent picked it with
``get_free_port()`` (bind port 0, close) and rank 0's worker bound it seconds later; in between any
socket of the machine bound to port 0, or any outgoing connection, could be given that port, and
rank 0's ``init_process_group`` failed with "address already in use" (a restart for nothing, or a
failed test under pytest-xdist, where other workers' ranks make such sockets all the time).
"""

from __future__ import annotations

import re
import subprocess
import sys

from trainguard.events import read_events

from conftest import free_ports

CLI = [sys.executable, "-c", "from trainguard.cli import main; main()", "run"]

# Rank 0 first does what another socket of the machine would do between the agent's choice of the port
# and rank 0's bind (takes it), then the group forms. Attempt 0: rank 1 fails after the group formed
# (a restart, so a second rendezvous picks a second port); attempt 1 ends well.
THIEF = r'''
import errno, os, socket, sys
import torch.distributed as dist

port, attempt = int(os.environ["MASTER_PORT"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
if os.environ["RANK"] == "0":
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        got = "taken"
    except OSError as e:
        got = errno.errorcode.get(e.errno, str(e.errno))
    s.close()
    print(f"attempt {attempt} port {port} bind by another socket: {got}", flush=True)
dist.init_process_group("gloo")
dist.barrier()
print(f"attempt {attempt} rank {os.environ['RANK']} joined", flush=True)
dist.destroy_process_group()
if attempt == "0" and os.environ["RANK"] == "1":
    sys.exit(1)
'''


def test_the_workers_master_port_is_theirs_until_rank_0_binds_it(tmp_path):
    """Before: rank 0's socket bound ``MASTER_PORT`` (the port was anyone's) and the group formed
    only because nothing else had taken it yet. Now the agent holds the port from its choice on
    (a socket bound with SO_REUSEADDR, not listening): another socket's bind fails with EADDRINUSE,
    rank 0's store still binds it, and the restart's rendezvous holds its own new port."""
    script = tmp_path / "thief.py"
    script.write_text(THIEF)
    run_dir = tmp_path / "run"
    cmd = [*CLI, "--nproc-per-node", "2", "--start-method", "fork", "--run-path", "--max-restarts", "1",
           "--run-dir", str(run_dir), str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    # Found anywhere in the output: two workers' lines can interleave in the agent's stdout
    # ("attempt 0 rank 0 joinedattempt 0 rank 1 joined", seen once in 5 runs).
    tries = re.findall(r"attempt (\d) port (\d+) bind by another socket: (\w+)", out)
    assert [(a, got) for a, _, got in tries] == [("0", "EADDRINUSE"), ("1", "EADDRINUSE")], out  # before: "taken"
    assert tries[0][1] != tries[1][1], out  # each rendezvous its own port
    assert sorted(re.findall(r"attempt (\d) rank (\d) joined", out)) == [
        (str(a), str(r)) for a in (0, 1) for r in (0, 1)], out
    assert [e["failures"] for e in read_events(run_dir) if e["event"] == "failure"] == [{"1": "exit code 1"}]


def test_free_ports_are_below_the_ephemeral_range_and_free():
    """conftest.free_ports (the tests' ports for torchrun, MASTER_PORT, servers): never one the kernel
    hands out to a socket bound to port 0 or an outgoing connection, so another xdist worker's ranks
    cannot take it between the draw and the child's bind; distinct, and bindable now."""
    import socket

    from conftest import _ephemeral_range

    ports = free_ports(8)
    assert len(set(ports)) == 8
    lo, _ = _ephemeral_range()
    assert all(10000 <= p < lo for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
