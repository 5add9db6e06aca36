"""End-to-end review of the resume promise with real training components (DataLoader workers,
augmentation, accumulation, bf16 autocast + GradScaler, EMA, schedulers) in new processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import trainguard as tg

SRC = str(Path(tg.__file__).resolve().parent.parent)

# A loop with DataLoader workers and a manager that saves only on a stop signal; it prints each
# step, and "stopped N" when the manager stopped it. WIF: the loader's worker_init_fn.
PREEMPT_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import trainguard as tg

    root = sys.argv[1]
    wif = getattr(tg, "ignore_stop_signals", None)  # absent before the fix: torch's worker handler
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = tg.ResumableSampler(64, seed=0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                                         persistent_workers=True, worker_init_fn=wif,
                                         generator=torch.Generator())
    state = {"model": model, "optim": opt, "data": sampler, "progress": tg.StateDict(step=0)}
    step = 0
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10**6)) as mgr:
        while step < 10**6:
            for (x,) in loader:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                sampler.advance(len(x))
                step += 1
                state["progress"]["step"] = step
                mgr.save(step, state)
                print("step", step, flush=True)
                if mgr.should_stop:
                    print("stopped", step, flush=True)
                    sys.exit(0)
            sampler.next_epoch()
    """
)


def test_sigterm_to_the_process_group_kills_no_dataloader_worker_and_saves(tmp_path: Path) -> None:
    """Slurm signals every process of a job step: before, the DataLoader workers died of the
    SIGTERM and the training process raised 'DataLoader worker ... is killed by signal' before its
    next save, so no preemption checkpoint was written (the steps since the last save were lost).
    With ``worker_init_fn=tg.ignore_stop_signals`` the manager saves at the next step and stops."""
    script = tmp_path / "train.py"
    script.write_text(PREEMPT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck")], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    guard = threading.Timer(60, os.killpg, (proc.pid, signal.SIGKILL))  # bounds the reads below (a hang)
    guard.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "step 3":
                os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: script and its workers
        proc.wait(timeout=60)
    finally:
        guard.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, out
    stopped = [int(x.split()[1]) for x in lines if x.startswith("stopped")]
    assert stopped and stopped[0] >= 3, out
    assert tg.CheckpointManager(tmp_path / "ck").latest_step() == stopped[0]
