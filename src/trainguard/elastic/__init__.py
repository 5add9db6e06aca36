"""Elastic fault tolerance: ``trainguard run`` over torch's elastic agent, fault drills, the hang
watchdog and the per-step heartbeat. See ``docs/elastic.md``.

Importing this package is cheap (no torch.distributed.run); the launcher is imported lazily
by ``trainguard run``.
"""

from __future__ import annotations

from .faults import Fault, FaultSpecError, InjectedFault, parse_fault, run_dir
from .watchdog import Watchdog, heartbeat

__all__ = ["Fault", "FaultSpecError", "InjectedFault", "Watchdog", "heartbeat", "parse_fault", "run_dir"]
