"""Feature combinations (review): promises that hold for each feature alone, checked where two
features meet. Two managers in one process (the model's and an EMA copy's) closed in the order
they were opened, and a mid-run rollback (``restore(state, step=N)``) under ``DalyInterval``."""

from __future__ import annotations

import signal
import warnings
from pathlib import Path

import torch

import trainguard as tg

from dist_helper import cpu_mesh, run_ranks


def test_two_managers_closed_in_open_order_keep_signals_working(tmp_path: Path) -> None:
    # model manager opened first, EMA manager second, closed model-first (not LIFO): the open EMA
    # manager must still hear SIGTERM, and once both are closed the process's own handlers are back.
    calls: list[int] = []

    def orig(signum: int, frame: object) -> None:  # the process's handler before any manager
        calls.append(signum)

    before_term, before_int = signal.signal(signal.SIGTERM, orig), signal.getsignal(signal.SIGINT)
    try:
        state = {"model": torch.nn.Linear(2, 2)}
        model_mgr = tg.CheckpointManager(tmp_path / "model", save=tg.EveryNSteps(100)).open()
        ema_mgr = tg.CheckpointManager(tmp_path / "ema", save=tg.EveryNSteps(100)).open()
        model_mgr.close()
        assert signal.getsignal(signal.SIGTERM) == ema_mgr._on_signal  # still the open manager's
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what a SIGTERM runs now
        assert ema_mgr.save(1, state) is not None and ema_mgr.should_stop  # a preemption save
        ema_mgr.close()
        assert signal.getsignal(signal.SIGTERM) == orig  # not the closed model manager's handler
        assert signal.getsignal(signal.SIGINT) == before_int  # Ctrl-C interrupts again
        assert (tmp_path / "ema" / "step-000000001" / "manifest.json").exists()
    finally:
        signal.signal(signal.SIGTERM, before_term)
        signal.signal(signal.SIGINT, before_int)


class _PinnedDaly(tg.DalyInterval):
    """DalyInterval with fixed measurements (this machine's timing out of the test): Daly's
    interval for a 0.01 s stall and a 1 h MTBF is 8 steps of 1 s, clamped to max_steps=5."""

    def measurements(self) -> dict[str, float | None]:
        return {"stall_s": 0.01, "duration_s": 0.01, "step_time_s": 1.0}


def test_daly_interval_saves_again_after_a_mid_run_rollback(tmp_path: Path) -> None:
    policy = _PinnedDaly(node_mtbf_s=3600.0, initial_steps=5, min_steps=5, max_steps=5)
    state = {"model": torch.nn.Linear(2, 2), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(tmp_path / "run", save=policy, keep=tg.KeepAll(), handle_signals=False) as mgr:
        first = [s for s in range(1, 31) if mgr.save(s, state) is not None]
        assert first == [6, 11, 16, 21, 26]
        assert mgr.restore(state, step=14) == 11  # roll back past a loss spike, mid-run
        again = [s for s in range(12, 31) if mgr.save(s, state) is not None]
    # every 5 steps from the rollback on, as after a restart; it was [] (next save at step 31)
    assert again == [17, 22, 27]


class _TiedLM(torch.nn.Module):
    """A tiny LM whose output head IS its embedding (GPT-2, small Llamas), as FSDP2 keeps it."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(96, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 96, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.wte(x))))


def _fsdp_lm(tied: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _TiedLM(tied)
    fully_shard(model.mid, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _fsdp_tie_ranks(rank: int, world: int, root: str) -> dict:
    model, opt = _fsdp_lm(tied=True)
    state = {"model": model, "optim": opt}
    with tg.CheckpointManager(f"{root}/tied", save=tg.EveryNSteps(1), async_save=True, stage_in_background=True,
                              max_staging_bytes=8192, handle_signals=False, timeout=30) as mgr:
        for step in (1, 2):
            opt.zero_grad()
            model(torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            mgr.save(step, state).wait_staged()
    want = model.wte.weight.full_tensor()
    untied, _ = _fsdp_lm(tied=False)
    with torch.no_grad():
        untied.head.weight.add_(1.0)  # other values under head.weight than under wte.weight
    tg.save(f"{root}/untied", {"model": untied}, timeout=30)
    fresh, fresh_opt = _fsdp_lm(tied=True)
    out: dict = {}
    for name, where in (("tied", None), ("untied", f"{root}/untied")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if where is None:
                with tg.CheckpointManager(f"{root}/tied", handle_signals=False, timeout=30) as mgr:
                    out["restored"] = mgr.restore({"model": fresh, "optim": fresh_opt})
                out["exact"] = bool(torch.equal(fresh.wte.weight.full_tensor(), want)) and fresh.head.weight is fresh.wte.weight
            else:
                tg.load(where, {"model": fresh}, timeout=30)
        out[name] = [str(w.message) for w in caught if "holds different values" in str(w.message)]
    return out


def test_fsdp2_tie_saved_async_restores_without_a_false_different_values_warning(tmp_path: Path) -> None:
    # FSDP2 (regular, format 2 entries) + a tie + async + stage_in_background + max_staging_bytes: the
    # checkpoint holds the same bytes under both names; restore warned on every rank that it
    # "holds different values under these names" (its check only read the chunks of format 1 entries).
    results = run_ranks(_fsdp_tie_ranks, 2, str(tmp_path), timeout=90, env={"TRAINGUARD_DEAD_AFTER": "3"})
    for r in results:
        assert r.value["restored"] == 2 and r.value["exact"]
        assert r.value["tied"] == [], r.value["tied"]
        assert len(r.value["untied"]) == 1  # a checkpoint really saved untied still says so
    plain = _TiedLM(tied=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process, a plain tied model: no warning either
        tg.load(tmp_path / "tied" / "step-000000002", {"model": plain}, only=["model"])
    assert plain.head.weight is plain.wte.weight


def test_manager_save_is_not_skipped_by_a_failed_direct_async_tg_save(tmp_path: Path, monkeypatch) -> None:
    # An async manager for the model and a one-off tg.save(async_=True) of an EMA copy in the same
    # process. The tg.save fails and nobody collects it: the manager's next save raised that error
    # as its own failure (on_error="raise": the loop died; "warn": the step went unsaved).
    model, ema = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        mgr.save(1, {"model": model})
        mgr.wait()
        monkeypatch.setenv("TRAINGUARD_CRASH_AT", "write_begin")
        monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
        failed = tg.save(tmp_path / "ema" / "step-1", {"ema": ema}, async_=True)
        failed.join()  # the save thread has ended (failed), not collected
        monkeypatch.delenv("TRAINGUARD_CRASH_AT")
        assert mgr.save(2, {"model": model}) is not None
        mgr.wait()
        assert mgr.latest_step() == 2
    # the documented contract stays: the next direct async tg.save raises the uncollected error
    try:
        tg.save(tmp_path / "ema" / "step-2", {"ema": ema}, async_=True).result()
        raise AssertionError("the failed tg.save's error was lost")
    except tg.CheckpointError as e:
        assert "ema/step-1" in str(e) and "injected failure" in str(e)
    tg.save(tmp_path / "ema" / "step-3", {"ema": ema}, async_=True).result()  # reported once


def _preempt_one_rank(rank: int, world: int, root: str, shm: str) -> dict:
    import os

    model = torch.nn.Linear(4, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(2), async_save=True, ram_tier=shm, timeout=20) as mgr:
        for step in range(1, 50):
            state["progress"]["step"] = step
            mgr.save(step, state)
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler told rank 1's process only
            if mgr.should_stop:
                break
    torch.distributed.barrier()  # rank 0's close() is over on every rank from here
    return {"stopped": step, "ram": sorted(os.listdir(mgr.ram.dir)) if os.path.isdir(mgr.ram.dir) else []}


def test_preemption_signal_on_another_rank_keeps_the_ram_tier(tmp_path: Path) -> None:
    # RAM tier + async + a SIGTERM that reached rank 1 only: every rank saves and stops at one step
    # (documented: a signal on any rank counts), and the RAM copy must stay for the fast restart.
    # Rank 0, which owns the RAM tier, saw no signal of its own and removed it as on a clean end.
    shm = tmp_path / "shm"
    shm.mkdir()
    results = run_ranks(_preempt_one_rank, 2, str(tmp_path / "run"), str(shm), timeout=90)
    stopped = {r.value["stopped"] for r in results}
    assert len(stopped) == 1
    step = stopped.pop()
    assert f"step-{step:09d}" in results[0].value["ram"], results[0].value
    assert (tmp_path / "run" / f"step-{step:09d}" / "manifest.json").exists()


def test_rollback_while_the_ram_tier_copies_to_disk_does_not_race_its_retention(tmp_path: Path, monkeypatch) -> None:
    # RAM tier + async + KeepLatest|KeepEvery + a rollback right after a save, while the RAM tier's
    # background copy of the newest step to disk (and the retention that follows it) still runs.
    # restore() listed the disk, then that retention deleted step 5 under the load: step 5 was
    # reported "not usable" (a restore_skip, half-read into the state) and restore fell back to 4.
    import threading

    from trainguard import manager as manager_mod
    from trainguard import tiers

    release = threading.Event()  # the copy of step 8 to disk runs until someone waits for it or a load starts
    real_persist, real_wait, real_load = tiers.RamTier.persist, tiers.RamTier.wait, manager_mod.load

    def persist(self: tiers.RamTier, step: int) -> bool:
        if step == 8:
            assert release.wait(30)
        return real_persist(self, step)

    def wait(self: tiers.RamTier) -> None:
        release.set()
        real_wait(self)

    def load(path, state, **kw):  # the copy and its retention end while restore reads
        release.set()
        if (t := mgr.ram._thread) is not None:
            t.join(30)
        return real_load(path, state, **kw)

    monkeypatch.setattr(tiers.RamTier, "persist", persist)
    monkeypatch.setattr(tiers.RamTier, "wait", wait)
    monkeypatch.setattr(manager_mod, "load", load)
    weight = torch.nn.Linear(4, 4)
    state = {"model": weight, "progress": tg.StateDict(step=0)}
    snaps = {}
    shm = tmp_path / "shm"
    shm.mkdir()
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(3) | tg.KeepEvery(4),
                              async_save=True, ram_tier=str(shm), handle_signals=False) as mgr:
        for step in range(1, 9):
            with torch.no_grad():
                weight.weight.add_(1.0)
            mgr.save(step, state)
            snaps[step] = weight.weight.clone()
        mgr.wait()  # committed in RAM; its copy to disk is still running
        restored = mgr.restore(state, step=5)  # a loss spike: back to step 5 or the newest before it
        assert restored == 4 and torch.equal(weight.weight, snaps[4])  # step 5 went with step 8's retention
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert "restore_skip" not in events  # no checkpoint reported unusable, nothing half-read
