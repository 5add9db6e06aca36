"""Run a training script with a preemption signal at a chosen optimizer step, by the signal
itself (no timing): ``python stop_at_step.py K script.py args...`` runs ``script.py`` as
``__main__`` and sends this process SIGTERM inside its K-th ``optimizer.step()`` (0-based, counted
in this process), on the rank ``STOP_RANK`` names (every rank when unset). Used by
tests/test_examples.py."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook


def main() -> None:
    at, script = int(sys.argv[1]), sys.argv[2]
    sys.argv = sys.argv[2:]
    want = os.environ.get("STOP_RANK")
    steps = [0]

    def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        if steps[0] == at and want in (None, "", os.environ.get("RANK", "0")):
            os.kill(os.getpid(), signal.SIGTERM)  # the manager's handler sets a flag; save() acts on it
        steps[0] += 1

    register_optimizer_step_post_hook(hook)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
