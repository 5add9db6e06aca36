"""Review of session 19's new code (scheduler class record, deques, comm hooks, replica window):
what broke, and what held."""

from __future__ import annotations

from collections import Counter, deque
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR

import trainguard as tg
from trainguard.commit import read_manifest
from trainguard.errors import CheckpointError
from trainguard.storage import for_path

from dist_helper import run_ranks


class _Window:
    """A Stateful whose state holds deques inside a deque, a Counter and a numpy float in a deque."""

    def __init__(self) -> None:
        self.rows: deque = deque([deque([], maxlen=3), deque([], maxlen=3)], maxlen=4)
        self.counts: deque = deque([Counter()], maxlen=2)
        self.vals: deque = deque([np.float64(0.0)], maxlen=2)

    def state_dict(self) -> dict:
        return {"rows": self.rows, "counts": self.counts, "vals": self.vals}

    def load_state_dict(self, sd: dict) -> None:
        self.rows, self.counts, self.vals = sd["rows"], sd["counts"], sd["vals"]


def test_deque_elements_keep_their_types(tmp_path: Path) -> None:
    w = _Window()
    w.rows[0].extend([1, 2])
    w.rows[1].append(3)
    w.counts[0]["a"] += 2
    w.vals[0] = np.float64(1.5)
    tg.save(tmp_path / "c", {"w": w})
    fresh = _Window()
    tg.load(tmp_path / "c", {"w": fresh})
    assert [type(r) for r in fresh.rows] == [deque, deque]
    assert [list(r) for r in fresh.rows] == [[1, 2], [3]] and fresh.rows[0].maxlen == 3
    assert type(fresh.counts[0]) is Counter and fresh.counts[0]["b"] == 0 and fresh.counts[0]["a"] == 2
    assert type(fresh.vals[0]) is np.float64 and fresh.vals[0] == 1.5


def _split_sched_rank(rank: int, world: int, root: str, cls_on_load: str) -> str:
    """Two pipeline stages (split_state=True): each rank its own stage's model and optimizer, and a
    scheduler entry on both; saved with OneCycleLR, loaded with ``cls_on_load`` on every rank."""
    import warnings

    from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR, StepLR

    torch.manual_seed(rank)
    stage = nn.Linear(4, 4)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    sched = OneCycleLR(opt, max_lr=1.0, total_steps=10)
    if cls_on_load == "mixed":  # each stage its own kind of scheduler under one name
        sched = StepLR(opt, 3) if rank else sched
        cls_on_load = type(sched).__name__
    tg.save(f"{root}/c", {f"stage{rank}": stage, f"opt{rank}": opt, "sched": sched}, split_state=True)
    opt2 = torch.optim.SGD(stage.parameters(), lr=0.1)
    sched2 = {"OneCycleLR": lambda: OneCycleLR(opt2, max_lr=1.0, total_steps=10), "StepLR": lambda: StepLR(opt2, 3),
              "CosineAnnealingLR": lambda: CosineAnnealingLR(opt2, T_max=10)}[cls_on_load]()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tg.load(f"{root}/c", {f"stage{rank}": stage, f"opt{rank}": opt2, "sched": sched2}, split_state=True)
    except CheckpointError as e:
        return "refused: " + str(e)[:60]
    return f"loaded base_lrs={sched2.base_lrs}"


def test_split_state_keeps_scheduler_class(tmp_path: Path) -> None:
    """Under split_state a scheduler entry held by every stage lost its "class" record (the other
    stage's report replaced the manifest's entry): a CosineAnnealingLR took a OneCycleLR's
    base_lrs silently there, while refused without split_state. Fails before the fix."""
    res = run_ranks(_split_sched_rank, 2, str(tmp_path), "CosineAnnealingLR", timeout=90)
    assert all(r.value.startswith("refused: entry 'sched'") for r in res), [r.value for r in res]
    m = read_manifest(*for_path(str(tmp_path / "c")))
    assert m.objects["sched"].get("class") == "OneCycleLR"
    res = run_ranks(_split_sched_rank, 2, str(tmp_path / "same"), "OneCycleLR", timeout=90)
    assert all(r.value.startswith("loaded") for r in res), [r.value for r in res]
    # Stages with schedulers of other kinds under one name: one skeleton (rank 0's values) is saved, so
    # the stage whose scheduler is of another kind is refused, not given the other's attributes.
    res = run_ranks(_split_sched_rank, 2, str(tmp_path / "mixed"), "mixed", timeout=90)
    assert all(r.value.startswith("refused: ") for r in res), [r.value for r in res]
    assert res[1].value.startswith("refused: entry 'sched'")


def _whole_world_group_rank(rank: int, world: int, root: str) -> list:
    """DDP over dist.new_group(every rank): another group object for the whole world, not a subgroup."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(nn.Linear(4, 4), process_group=dist.new_group(list(range(world))))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(2, 4)).sum().backward()
    opt.step()
    tg.save(f"{root}/c", {"model": ddp, "optim": opt})
    fresh = nn.Linear(4, 4)
    tg.load(f"{root}/c", {"model": fresh}, only=["model"])
    return [torch.equal(a, b) for a, b in zip(fresh.parameters(), ddp.module.parameters())]


def test_ddp_over_a_new_group_of_every_rank_is_saved(tmp_path: Path) -> None:
    res = run_ranks(_whole_world_group_rank, 2, str(tmp_path), timeout=90)
    assert [r.value for r in res] == [[True, True], [True, True]]


def test_deques_in_plain_entries_and_scheduler_left_out(tmp_path: Path) -> None:
    """A deque of tensors in a dict entry and a deque entry come back as deques with their maxlen;
    a scheduler of another class left out of the state with strict=False loads the rest, as the
    refusal's message says."""
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = OneCycleLR(opt, max_lr=1.0, total_steps=10)
    opt.step()
    sched.step()
    tg.save(tmp_path / "c", {"m": m, "o": opt, "s": sched, "d": {"q": deque([torch.arange(3)], maxlen=7)},
                             "top": deque([1, 2], maxlen=3)})
    m2 = nn.Linear(2, 2)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    other = CosineAnnealingLR(opt2, T_max=10)
    state = {"m": m2, "o": opt2, "s": other, "d": {"q": deque(maxlen=7)}, "top": deque(maxlen=3)}
    with pytest.raises(CheckpointError, match="OneCycleLR scheduler"):
        tg.load(tmp_path / "c", state, strict=False)
    del state["s"]
    tg.load(tmp_path / "c", state, strict=False)
    assert type(state["d"]["q"]) is deque and state["d"]["q"].maxlen == 7 and torch.equal(state["d"]["q"][0], torch.arange(3))
    assert state["top"] == deque([1, 2]) and state["top"].maxlen == 3
    assert other.base_lrs == [0.1] and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _window_rank(rank: int, world: int, root: str, diverge: bool) -> bool:
    """40 Linear layers (80 replicated tensors, more than one window) under a CheckpointManager with
    on_error="warn"; the save of step 1 fails because rank 0's metrics are refused before its capture
    (rank 1 captured: the ranks' counts of saves are one apart from then on); from step 3 on rank 1's
    last weight differs. Returns whether the run's event log holds a replicas_differ event."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(40)))
    with tg.CheckpointManager(root, on_error="warn", save=tg.EveryNSteps(1)) as mgr:
        for step in range(8):
            if step == 3 and rank == 1 and diverge:
                with torch.no_grad():
                    model[39].weight.add_(1.0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr.save(step, {"model": model}, metrics={"loss": "nan?"} if step == 1 and rank == 0 else None)
    return "replicas_differ" in (Path(root) / "events.jsonl").read_text()


def test_replica_window_realigns_after_ranks_counted_saves_differently(tmp_path: Path) -> None:
    """The window's place came from each process's own count of saves: after a save that failed on one
    rank before its capture, the ranks hashed other windows at every save, compared nothing, and a
    tensor that diverged later was never reported. Fails before the fix."""
    res = run_ranks(_window_rank, 2, str(tmp_path / "a"), True, timeout=120)
    assert [r.value for r in res] == [True, True]
    res = run_ranks(_window_rank, 2, str(tmp_path / "b"), False, timeout=120)  # nothing differs: nothing found
    assert [r.value for r in res] == [False, False]


class _LoggedCosine(CosineAnnealingLR):
    """What a run may turn its scheduler into between a save and a resume (to log its lr)."""


def test_scheduler_subclass_of_the_saved_class_loads(tmp_path: Path) -> None:
    """A CosineAnnealingLR's state loads into a subclass of it (it did before the class record; the
    record refused it as another class); a OneCycleLR's is still refused by it."""
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = CosineAnnealingLR(opt, T_max=10)
    for _ in range(3):
        opt.step()
        sched.step()
    tg.save(tmp_path / "c", {"m": m, "o": opt, "s": sched})
    opt2 = torch.optim.SGD(m.parameters(), lr=0.1)
    sub = _LoggedCosine(opt2, T_max=10)
    tg.load(tmp_path / "c", {"m": m, "o": opt2, "s": sub})
    assert sub.last_epoch == 3 and sub.get_last_lr() == sched.get_last_lr()
    opt3 = torch.optim.SGD(m.parameters(), lr=0.1)
    tg.save(tmp_path / "one", {"m": m, "o": opt3, "s": OneCycleLR(opt3, max_lr=1.0, total_steps=10)})
    with pytest.raises(CheckpointError, match="OneCycleLR scheduler"):
        tg.load(tmp_path / "one", {"m": m, "o": opt3, "s": _LoggedCosine(opt3, T_max=10)})
