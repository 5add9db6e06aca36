"""Week-scale use of the library in one process (session longrun19): what stays bounded."""

from __future__ import annotations

import os

import pytest

from dist_helper import run_ranks


def _trials(rank: int, world: int, root: str, async_save: bool, n: int) -> list[int]:
    """One manager after another on every rank (a loop of trials, each in its own directory);
    the job's store key count after each."""
    import torch
    import torch.distributed as dist

    import trainguard as tg

    store = dist.distributed_c10d._get_default_store()
    model = torch.nn.Linear(8, 2)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "progress": tg.StateDict(step=0)}
    counts = []
    for i in range(n):
        with tg.CheckpointManager(os.path.join(root, f"trial-{i}"), save=tg.EveryNSteps(1), keep=tg.KeepLatest(2),
                                  async_save=async_save, timeout=60) as mgr:
            mgr.restore(state)
            for step in range(1, 4):
                mgr.save(step, state)
        dist.barrier()  # every rank's close() is over (and its deletes: each rank's store calls run in order)
        counts.append(store.num_keys())
        dist.barrier()
    return counts


@pytest.mark.parametrize("async_save", [False, True])
def test_managers_made_one_after_another_leave_no_store_keys(tmp_path, async_save):
    # Before: every closed manager left its last rounds' keys and each rank's "at" key in the job's
    # c10d store (4 per manager, 13 with async saves): 805 keys after 200 trials.
    res = run_ranks(_trials, 2, str(tmp_path), async_save, 6, timeout=120)
    counts = res[0].value
    assert counts[-1] <= counts[1], counts
