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
    from trainguard.dist import DistContext

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
        DistContext.current().store.drain()  # rank 0's deletes run in the background: wait for them
        dist.barrier()  # every rank's close() is over
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


def test_ram_tier_copy_survives_a_view_of_its_mapping_held_elsewhere(tmp_path, monkeypatch):
    # Seen in a 300-save run with ram_tier=True: the training thread walked gc.get_objects() (a memory
    # profiler does) while the RAM tier copied step 100 to the run directory; the list held a slice of the
    # mapping's view, mmap.close() raised "cannot close exported pointers exist" after every byte was
    # written, and the step never reached the run directory. The writer below keeps such a slice.
    from trainguard import tiers
    from trainguard.storage import for_path

    monkeypatch.setattr(tiers, "PIECE", 1 << 16)  # several pieces of a small file
    src = tmp_path / "data-00000.bin"
    payload = os.urandom(3 * tiers.PIECE + 123)
    src.write_bytes(payload)
    storage, root = for_path(str(tmp_path / "out"))
    storage.makedirs(root)
    held = []
    real_open = storage.open_write

    def open_write(path, **kw):
        w = real_open(path, **kw)
        pwrite = w.pwrite

        def keeping(data, offset):
            held.append(data[:1])  # someone else's reference to part of the view
            return pwrite(data, offset)

        w.pwrite = keeping
        return w

    storage.open_write = open_write
    dst = storage.join(root, "data-00000.bin")
    tiers._copy(str(src), storage, dst, len(payload))
    with open(dst, "rb") as f:
        assert f.read() == payload
    assert held


def _rare_saves(rank: int, world: int, root: str, steps: int) -> list[int]:
    """A distributed manager whose policy does not save in ``steps`` steps (saving on preemption only);
    the job's store key count every 10 steps."""
    import torch
    import torch.distributed as dist

    import trainguard as tg
    from trainguard import distwait
    from trainguard.dist import DistContext

    distwait.TRIM_EVERY = 16  # looks sooner; the same code path
    store = dist.distributed_c10d._get_default_store()
    state = {"model": torch.nn.Linear(4, 2), "progress": tg.StateDict(step=0)}
    counts = []
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10**9), timeout=60) as mgr:
        for step in range(1, steps + 1):
            assert mgr.save(step, state) is None
            if step % 10 == 0:
                DistContext.current().store.drain()  # rank 0's deletes run in the background: wait for them
                dist.barrier()
                counts.append(store.num_keys())
                dist.barrier()
    return counts


def test_a_run_that_rarely_saves_keeps_no_store_key_per_step(tmp_path):
    # Before: each step's "decide" broadcast left its key in the job's c10d store until the next
    # committed save (507 keys after 499 steps of EveryNSteps(500); for good when no save came).
    res = run_ranks(_rare_saves, 2, str(tmp_path), 200, timeout=120)
    counts = res[0].value
    assert max(counts[5:]) <= counts[1] + 16, counts
