"""hunt47 reshard: the resharding matrix, save on W gloo ranks and load on W' (tests/reshard_sweep.py).

The CI tests run the cells that hold the most at once: 3 ranks -> 2 and 4 (uneven shards,
zero-size shards, a 2-D mesh, rank-local entries of ranks that no longer exist and of ranks that
did not exist, the samplers' tails), a refused load on 2 -> 3 ranks, and the samplers' rule over
random sequences of world sizes in one process. The whole matrix (W 1-4, W' 1-4, eight ways of
saving) is the slow test.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import reshard_sweep as sw
import trainguard as tg

from dist_helper import run_ranks


def test_saved_on_3_ranks_loads_on_2_and_4_element_for_element(tmp_path: Path) -> None:
    """Params, exp_avg, exp_avg_sq and step of AdamW (DDP), Adam (FSDP2, FSDP2 + TP) and every
    DTensor gather equal to the copy taken at save; differed before the load; the samplers' epoch is
    whole; rank 3 of 4 takes saved rank 0's rank-local state."""
    root = str(tmp_path)
    saved = [r.value for r in run_ranks(sw.save_group, 3, root, ("sync",), timeout=120, env=sw.ENV)]
    assert all(len(s["seen"]) == 8 for s in saved)
    for w2 in (2, 4):
        loaded = [r.value for r in run_ranks(sw.load_group, w2, root, 3, "sync", timeout=120, env=sw.ENV)]
        assert all(v["error"] is None for v in loaded), loaded[0]["error"]
        assert len([k for k in torch.load(f"{root}/truth-w3.pt") if "/o/" in k]) == 3 * (4 + 6 + 4)  # step, exp_avg, exp_avg_sq
        assert sw.cell_problems(saved, loaded, 3, w2) == []
        assert [v["local"] for v in loaded] == [100, 101, 102, 100][:w2]


def test_cell_problems_sees_a_wrong_value_a_lost_sample_and_a_wrong_rank_local(tmp_path: Path) -> None:
    """The checker itself: a loaded tensor that differs, a sample never read, a rank-local value of
    the wrong saved rank are each reported (so an empty list above means something)."""
    seen = {f"s{int(s)}{int(d)}{k}": [] for s, d, k in sw.SAMPLERS}
    order = list(range(sw.N))
    saved = [{"seen": dict(seen), "positions": dict.fromkeys(seen, 0)}]
    good = {"error": None, "mismatch": [], "equal_before": [], "step": 2, "local": 100,
            "after": {k: order for k in seen}}
    assert sw.cell_problems(saved, [good], 1, 1) == []
    assert sw.cell_problems(saved, [{**good, "mismatch": ["fs/p/0.weight: differs"]}], 1, 1) != []
    assert sw.cell_problems(saved, [{**good, "after": {k: order[1:] for k in seen}}], 1, 1) != []
    assert sw.cell_problems(saved, [{**good, "local": 101}], 1, 1) != []
    assert sw.cell_problems(saved, [{**good, "after": {k: order + [5] for k in seen}}], 1, 1) != []


def _refused(rank: int, world: int, root: str, w: int) -> dict[str, Any]:
    """Load the checkpoint of ``w`` ranks into an FSDP2 model whose first layer has 8 rows, not 7."""
    from torch.distributed.fsdp import fully_shard

    state, mods = sw.build(rank, world, 7)
    fs = nn.Sequential(nn.Linear(13, 8), nn.Linear(8, 2), nn.Linear(2, 1))
    for layer in fs:
        fully_shard(layer, mesh=sw.cpu_mesh())
    fully_shard(fs, mesh=sw.cpu_mesh())
    state["fs"] = mods["fs"] = fs
    state["fopt"] = mods["fopt"] = torch.optim.Adam(fs.parameters(), lr=1e-2)
    before = sw.truth(state, mods)
    positions = {k: v.position for k, v in state.items() if isinstance(v, tg.ResumableSampler)}
    try:
        tg.load(f"{root}/w{w}-sync", state)
        err = None
    except tg.CheckpointError as e:
        err = str(e)
    after = sw.truth(state, mods)
    changed = [k for k in before if not torch.equal(before[k], after[k])] + [k for k in after if k not in before]
    changed += [k for k, p in positions.items() if state[k].position != p]
    return {"err": err, "changed": changed, "local": state["local"].v, "step": state["progress"]["step"]}


def test_another_shape_at_another_world_size_is_refused_on_every_rank_before_anything_is_read(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(sw.save_group, 2, root, ("sync",), timeout=120, env=sw.ENV)
    out = [r.value for r in run_ranks(_refused, 3, root, 2, timeout=120, env=sw.ENV)]
    for rank, v in enumerate(out):
        assert v["err"] is not None and "fs/0.weight (checkpoint float32[7, 13], state float32[8, 13])" in v["err"]
        assert "strict=False" in v["err"]
        assert v["changed"] == [] and v["local"] == 100 + rank and v["step"] == 0


def _one_epoch(kind: str, n: int, worlds: list[int], cuts: list[int], b: int, shuffle: bool, drop_last: bool) -> str | None:
    """One epoch through world sizes ``worlds`` (a resume after ``cuts[i]`` batches of ``b`` at each)."""
    consumed: list[int] = []
    saved = None
    for i, w in enumerate(worlds):
        if kind == "sampler":
            ss: list[Any] = [tg.ResumableSampler(n, seed=3, shuffle=shuffle, drop_last=drop_last, rank=r, world_size=w) for r in range(w)]
        else:
            ss = [tg.ResumableIterable(lambda e: iter(range(n)), drop_last=drop_last, rank=r, world_size=w) for r in range(w)]
        for s in ss:
            if saved is not None:
                s.load_state_dict(dict(saved))
        its = [list(iter(s)) for s in ss]
        if len({len(x) for x in its}) != 1:
            return f"ranks read {[len(x) for x in its]}"
        j = batches = 0
        while j < len(its[0]) and (i == len(worlds) - 1 or batches < cuts[i]):
            for r in range(w):
                consumed += its[r][j:j + b]
            k = len(its[0][j:j + b])
            for s in ss:
                s.advance(k)
            j, batches = j + k, batches + 1
        saved = ss[0].state_dict()
    c = Counter(consumed)
    missing, dups = [x for x in range(n) if c[x] == 0], sum(v - 1 for v in c.values())
    if not drop_last and (missing or dups > sum(w - 1 for w in worlds)):
        return f"missing {missing}, {dups} repeated"
    if drop_last and dups:
        return f"{dups} repeated with drop_last"
    return None


def test_sampler_and_iterable_keep_the_epoch_through_random_world_size_changes() -> None:
    """docs/data.md: every sample once (plus at most W - 1 padding at each world size's end),
    every rank the same count, through 1-4 resumes at world sizes 1-5 with batches of 1-5."""
    rng, bad = random.Random(47), []
    for _ in range(1500):
        kind = rng.choice(["sampler", "iterable"])
        args = (rng.randint(1, 30), [rng.randint(1, 5) for _ in range(rng.randint(1, 4))])
        case = (kind, *args, [rng.randint(0, 5) for _ in args[1]], rng.randint(1, 5), kind == "sampler" and rng.random() < 0.5,
                rng.random() < 0.5)
        if (p := _one_epoch(*case)) is not None:
            bad.append((case, p))
    assert bad == []


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 4 minutes quiet; 293 s under load (session 57), the default bound is 300 s
def test_the_whole_matrix(tmp_path: Path) -> None:
    """W in 1-4 x W' in 1-4 x sync, async, full, split_state, a 256-byte staging cap, background
    staging, CheckpointManager, with a RAM tier (about 4 minutes on 2 cores)."""
    assert sw.sweep(str(tmp_path), save_worlds=(1, 2, 3, 4)) == []


class _PerRank(nn.Module):
    """A rank-local module whose buffer's size depends on the rank (a per-rank cache, an error feedback)."""

    trainguard_rank_local = True

    def __init__(self, rank: int, value: float) -> None:
        super().__init__()
        self.register_buffer("b", torch.full((rank + 1,), value))


class _Reseeds(_PerRank):
    def reseed_for_rank(self, rank: int, step: int) -> None:
        self.b.fill_(-1.0)


def _per_rank_group(rank: int, world: int, root: str, save: bool, cls_name: str) -> dict[str, Any]:
    cls = {"plain": _PerRank, "reseeds": _Reseeds}[cls_name]
    state = {"cache": cls(rank, 100.0 + rank if save else 0.0), "progress": tg.StateDict(step=3 if save else 0)}
    if save:
        tg.save(f"{root}/per-rank", state)
        return {}
    try:
        tg.load(f"{root}/per-rank", state)
        err = None
    except tg.CheckpointError as e:
        err = str(e)
    return {"err": err, "b": state["cache"].b.tolist(), "step": state["progress"]["step"]}


def test_a_rank_local_entry_the_grown_world_cannot_take_says_what_to_change(tmp_path: Path) -> None:
    """Saved on 2 ranks, loaded on 3: rank 2 takes saved rank 0's copy (docs/distributed.md), whose
    buffer has 1 element for its 3. Every rank refuses before anything is read, and the message says
    why (no saved state for rank 2, it took rank 0's) and what to change, not only "strict=False"
    (which leaves rank 2's entry as built). Then the same with a reseed_for_rank method: loads."""
    root = str(tmp_path)
    run_ranks(_per_rank_group, 2, root, True, "plain", timeout=120, env=sw.ENV)
    out = [r.value for r in run_ranks(_per_rank_group, 3, root, False, "plain", timeout=120, env=sw.ENV)]
    for rank, v in enumerate(out):
        assert v["b"] == [0.0] * (rank + 1) and v["step"] == 0  # nothing loaded on any rank
        assert "cache@0/b (checkpoint float32[1], state float32[3])" in v["err"]
        assert "Rank 2 has no saved state of the rank-local entry 'cache' (saved by 2 ranks) and took saved rank 0's" in v["err"]
        assert "resume on 2 ranks" in v["err"] and "reseed_for_rank(rank, step)" in v["err"]
    run_ranks(_per_rank_group, 2, str(tmp_path / "r"), True, "reseeds", timeout=120, env=sw.ENV)
    out = [r.value for r in run_ranks(_per_rank_group, 3, str(tmp_path / "r"), False, "reseeds", timeout=120, env=sw.ENV)]
    assert [v["err"] for v in out] == [None] * 3
    assert [v["b"] for v in out] == [[100.0], [101.0, 101.0], [-1.0] * 3] and {v["step"] for v in out} == {3}
