"""A warning for plain ``torchrun`` with restarts and torch's shared rendezvous store.

``CheckpointManager.open`` calls :func:`warn_shared_store` on rank 0. torch's agent shares its
rendezvous TCP store with its workers (``TORCHELASTIC_USE_AGENT_STORE=True`` in their environment)
unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. With it, the workers of a restart (``--max-restarts``)
hung in ``init_process_group`` (gloo connecting to the dead attempt's peers) until torch's 30-minute
timeout: seen in 2 of 2 runs on one node after a worker was SIGKILLed mid-save, and 3 of 6 restarts
failed in the measurements of docs/elastic.md. ``trainguard run`` sets the variable; under plain
``torchrun`` nothing said so before the first restart hung.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("trainguard")


def warn_shared_store() -> bool:
    """Rank 0, at a manager's open: log a warning when this worker runs under torch's elastic agent
    with restarts allowed and the agent's store shared. Returns whether it warned."""
    env = os.environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    if restarts <= 0 or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return False
    log.warning(
        "trainguard: this job runs under torchrun with --max-restarts %d and torch's shared rendezvous store: "
        "restarted workers have hung in init_process_group (gloo connecting to the failed attempt's peers) "
        "until torch's 30-minute timeout. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun, or launch "
        "with `trainguard run`, which sets it (docs/elastic.md)", restarts)
    return True
