"""The workers' ``MASTER_PORT``, kept from other sockets of the machine until rank 0's worker binds it.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``trainguard run``'s default, ``launcher.prepare``),
torch's agent of node rank 0 picks the workers' ``MASTER_PORT`` at each rendezvous with
``get_free_port()``: it binds port 0, closes the socket and publishes the port. Rank 0's worker binds
it only after it started and imported the script (seconds); in between, the kernel may hand that
port to any other socket of the machine bound to port 0 or connecting out (another job's store, a
gloo connection), and that worker's ``init_process_group`` fails with "address already in use": a
failed attempt and a restart for nothing (probed ports were taken 9 times in 2000 with 60 such
sockets made in between).

:func:`hold` (the agent, from ``launcher.install_agent_hooks``, once per process) makes torch pick
the port with :func:`held_free_port` instead: its socket stays bound with ``SO_REUSEADDR``, not
listening, until the next rendezvous picks another port. The kernel gives a port bound so to no
socket bound to port 0 and to no outgoing connection, while rank 0's store (``TCPStore``, which
sets ``SO_REUSEADDR`` too) still binds and listens on it.
"""

from __future__ import annotations

import socket

_HELD: list[socket.socket] = []  # the socket holding the port of the last rendezvous (agent process)


def held_free_port() -> int:
    """A free TCP port, held by a bound socket until the next call (which closes it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
    except OSError:
        s.close()
        from torch.distributed.elastic.utils.distributed import get_free_port

        return get_free_port()  # no IPv4 here: torch's own choice
    while _HELD:
        _HELD.pop().close()
    _HELD.append(s)
    return s.getsockname()[1]


def hold() -> None:
    """Agent: torch's rendezvous picks ``MASTER_PORT`` with :func:`held_free_port` (in this process)."""
    from torch.distributed.elastic.rendezvous import api

    api.get_free_port = held_free_port
