"""Session 21 review (area "left"): the RAM tier's latest_step, shared JSON values that differ
between ranks, module-level state that grows with the number of saves."""

from __future__ import annotations

import threading

import torch

import trainguard as tg
from trainguard import tiers


def test_latest_step_counts_the_ram_tier_copy_still_on_its_way_to_disk(tmp_path, monkeypatch):
    """A save into the RAM tier is committed there (wait() returned, restore resumes from it) while
    rank 0 copies it to the run directory in the background: latest_step() gave the step before
    (None after the first save) until that copy ended. The copy is held here until checked."""
    go = threading.Event()
    real = tiers.fault

    def hold(point: str, rank: int = 0) -> None:
        if point == "before_persist":
            assert go.wait(30)
        real(point, rank)

    monkeypatch.setattr(tiers, "fault", hold)
    ram = tmp_path / "ram"
    ram.mkdir()
    root = str(tmp_path / "run")
    m = torch.nn.Linear(8, 4)
    with tg.CheckpointManager(root, ram_tier=str(ram)) as mgr:
        try:
            for step in (1, 2):
                mgr.save(step, {"m": m}, force=True)
                mgr.wait()
                assert mgr.latest_step() == step  # before: None, then 1 (the copy held)
                go.set()
                mgr.ram.wait()
                go.clear()
                assert mgr.latest_step() == step
        finally:
            go.set()  # close() waits for the copy
    with tg.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 2


def _plateau_ranks(rank: int, world: int, root: str) -> dict:
    import warnings

    from trainguard.sharedvalues import SharedValuesDifferWarning

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=5)
    state = {"model": model, "optim": opt, "sched": sched, "progress": tg.StateDict(step=0)}
    out = []
    for step, metric in ((1, 1.0 + rank), (2, 0.5)):  # each rank's own metric, then an all-reduced one
        sched.step(metric)
        state["progress"]["step"] = step
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            tg.save(f"{root}/step-{step}", state)
        out.append([str(x.message) for x in w if issubclass(x.category, SharedValuesDifferWarning)])
    return {"warned": out, "best": sched.best}


def test_shared_json_values_that_differ_between_ranks_warn_once_per_save_naming_entry_and_ranks(tmp_path):
    """ReduceLROnPlateau stepped with each rank's own metric: its best/num_bad_epochs differ between
    ranks, the checkpoint keeps rank 0's and every rank resumed with it, without a word (only
    replicated tensors were compared). Now rank 0 warns in that save, naming the entry and ranks."""
    from dist_helper import run_ranks

    res = run_ranks(_plateau_ranks, 2, str(tmp_path), timeout=60)
    assert all(r.error is None and r.exitcode == 0 for r in res), [r.error for r in res]
    first, second = res[0].value["warned"]
    assert len(first) == 1, first
    assert "'sched' (ranks 0 | 1 hold different values; the checkpoint keeps rank 0's)" in first[0]
    assert "'model'" not in first[0] and "'optim'" not in first[0] and "'progress'" not in first[0]
    assert second == []  # 0.5 everywhere: a new best on both, the values equal again
    assert res[1].value["warned"] == [[], []]  # rank 0 alone warns


def _growing_ranks(rank: int, world: int, root: str, n: int) -> dict:
    from trainguard import replicas

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    history: list[float] = []
    sizes = []
    for i in range(n):
        history.append(float(i))  # the state's signature (its tensors' shapes) changes at every save
        tg.save(f"{root}/r{i}", {"model": model, "history": torch.tensor(history)})
        sizes.append(len(replicas._SEEN))
    return {"sizes": sizes, "bound": getattr(replicas, "SIGS", 64)}


def test_replica_digest_counts_stay_bounded_when_the_signature_changes_at_every_save(tmp_path):
    """replicas._SEEN (entry signature -> saves of it) gained one entry per save when the state's
    signature changed at each save (a loss history saved as a growing tensor): 400 saves, 400
    entries, about 185 B each (1.85 MB per 10,000 saves). Now the most recent ``SIGS`` are kept."""
    from dist_helper import run_ranks

    res = run_ranks(_growing_ranks, 2, str(tmp_path), 80, timeout=120)
    assert all(r.error is None and r.exitcode == 0 for r in res), [r.error for r in res]
    for r in res:
        bound = r.value["bound"]
        assert max(r.value["sizes"]) <= bound < 80, r.value["sizes"][-5:]
