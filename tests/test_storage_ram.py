"""The RAM tier: saves land in shared memory first, rank 0 copies them to the durable tier in
the background; restore prefers the RAM copy; bounded to the newest; removed by a clean close;
survives a process crash."""

from __future__ import annotations

import os
import textwrap

import torch

import trainguard as tg
from trainguard.commit import list_steps
from trainguard.storage import LocalStorage
from trainguard.tiers import ram_dir


def _model(fill: float) -> torch.nn.Module:
    m = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    return m


def _steps(d: str) -> list[int]:
    return [s.step for s in list_steps(LocalStorage(), d) if s.status == "committed"]


def test_ram_tier_bounded_preferred_falls_back_and_is_cleaned(tmp_path):
    root = str(tmp_path / "run")
    ram = ram_dir(root)  # default base: /dev/shm
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), ram_tier=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": _model(float(step))})
            assert _steps(ram) == [step]  # only the newest stays in RAM
        mgr.ram.wait()  # the background copy of step 3
        assert _steps(root) == [2, 3]  # durable tier, retention applied after each copy
        dest = _model(0.0)
        assert mgr.restore({"model": dest}) == 3
        assert torch.equal(dest.weight, _model(3.0).weight)
        # A corrupt RAM copy: restore falls back to the durable copy of the same step.
        with open(os.path.join(ram, "step-000000003", "data-00000.bin"), "r+b") as f:
            f.write(b"\xff" * 16)
        dest = _model(0.0)
        assert mgr.restore({"model": dest}) == 3
        assert torch.equal(dest.weight, _model(3.0).weight)
    assert not os.path.exists(ram)  # a clean close removes the RAM tier


CHILD = textwrap.dedent(
    """
    import sys, torch
    import trainguard as tg
    root, base = sys.argv[1], sys.argv[2]
    m = torch.nn.Linear(64, 32)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                m.weight.fill_(step)
            mgr.save(step, {"model": m})
    """
)


def test_ram_copy_survives_a_crash_before_it_reached_disk(tmp_path, run_child):
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    # The process dies (os._exit) when it starts copying step 2 to disk: step 1 is durable,
    # step 2 only exists in the RAM tier.
    env = {"TRAINGUARD_CRASH_AT": "before_persist", "TRAINGUARD_CRASH_SKIP": "1"}
    r = run_child(["-c", CHILD, root, base], env=env, timeout=120)
    assert r.returncode == 17, r.stderr[-3000:]
    ram = ram_dir(root, base)
    assert _steps(root) == [1] and _steps(ram) == [2]
    m = torch.nn.Linear(64, 32)
    with tg.CheckpointManager(root, ram_tier=base) as mgr:
        assert mgr.restore({"model": m}) == 2  # the newest, from RAM
        assert torch.all(m.weight == 2)
    assert _steps(root) == [1, 2]  # restore made sure step 2 reached the durable tier
    assert not os.path.exists(ram)


def _ranks_with_ram_tier(rank: int, world: int, root: str, base: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 32))
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, async_save=True) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.module.weight.fill_(step)
            mgr.save(step, {"model": model})
        mgr.wait()
        ram_after_save = _steps(mgr.ram.dir) if rank == 0 else None  # rank 0 prunes the RAM tier
        fresh = DDP(torch.nn.Linear(64, 32))
        restored = mgr.restore({"model": fresh})
        ok = bool(torch.all(fresh.module.weight == 2))
    return {"ram": ram_after_save, "restored": restored, "ok": ok}


def test_two_ranks_async_save_through_the_ram_tier(tmp_path):
    from dist_helper import run_ranks

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    res = run_ranks(_ranks_with_ram_tier, 2, root, base, timeout=90, env={"TRAINGUARD_DEAD_AFTER": "5"})
    assert res[0].value["ram"] == [2]  # only the newest stays in RAM
    assert all(r.value["restored"] == 2 and r.value["ok"] for r in res)
    assert _steps(root) == [1, 2]  # both copied to disk, manifest last
    assert not os.path.exists(ram_dir(root, base))  # clean close on every rank


def test_async_save_reaches_disk_without_waiting_for_the_next_save(tmp_path):
    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, async_save=True,
                              handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(1.0)}).result(timeout=60)
        mgr.ram.wait()  # the copy the commit started (before: none until the next save call)
        assert _steps(root) == [1]


def test_ram_copy_of_a_deleted_run_directory_is_not_restored(tmp_path):
    import shutil

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    try:
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
            mgr.save(5, {"model": _model(5.0)})
            raise KeyboardInterrupt  # the job dies: its RAM copy is kept for the restart
    except KeyboardInterrupt:
        pass
    assert _steps(ram_dir(root, base)) == [5]
    shutil.rmtree(root)  # the user starts over
    m = _model(0.0)
    with tg.CheckpointManager(root, ram_tier=base, handle_signals=False) as mgr:
        assert mgr.restore({"model": m}) is None  # before: 5, from the RAM copy of the deleted run
        assert _steps(ram_dir(root, base)) == []
    assert torch.all(m.weight == 0) and _steps(root) == []


def test_ram_tier_short_of_room_drops_the_copy_already_on_disk_before_the_next_save(tmp_path, monkeypatch):
    import shutil

    from trainguard import streams, tiers

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    seen: list[list[int]] = []  # committed RAM steps when each save starts writing its data
    monkeypatch.setattr(streams, "fault", lambda point, rank: seen.append(_steps(ram_dir(root, base)))
                        if point == "write_begin" else None)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=base, handle_signals=False) as mgr:
        mgr.save(1, {"model": _model(1.0)})
        mgr.save(2, {"model": _model(2.0)})
        assert seen == [[], [1]]  # room enough: the RAM copy of step 1 stays while step 2 is written
        free = shutil.disk_usage(base)
        # no room beside a copy: 4096 bytes free while the RAM tier holds one, else its real free space
        monkeypatch.setattr(tiers.shutil, "disk_usage",
                            lambda p: free._replace(free=4096 if _steps(ram_dir(root, base)) else free.free))
        mgr.save(3, {"model": _model(3.0)})
        assert seen[-1] == []  # step 2 was on disk already: dropped from RAM first
        assert _steps(ram_dir(root, base)) == [3]
        mgr.ram.wait()
        assert _steps(root)[-1] == 3


def _ram_open_with_a_dead_peer(rank: int, world: int, root: str, base: str) -> str:
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before it builds its manager (no heartbeat yet)
    try:
        with tg.CheckpointManager(root, ram_tier=base, timeout=3, handle_signals=False):
            return "opened"
    except tg.RankFailureError as e:
        return f"RankFailureError: {e}"


def test_ram_tier_open_keeps_the_managers_timeout(tmp_path):
    from dist_helper import run_ranks

    root, base = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(base)
    res = run_ranks(_ram_open_with_a_dead_peer, 2, root, base, timeout=60, check=False,
                    env={"TRAINGUARD_TIMEOUT": "600"})
    # before: the RAM tier's host check waited TRAINGUARD_TIMEOUT (600 s), not timeout=3
    assert not res[0].timed_out and str(res[0].value).startswith("RankFailureError"), res[0]
