"""Session 34: optimizer state of FSDP2 parameters that is not shaped like its parameter (a
factored second moment, one value per row), loaded into a fresh optimizer.

Multi-rank cases run real gloo process groups on 127.0.0.1 (``dist_helper.run_ranks``)."""

from __future__ import annotations

import torch
from torch import nn

import trainguard as tg

from dist_helper import cpu_mesh, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "5"}


class RowAdam(torch.optim.Optimizer):
    """Adafactor-like: the second moment of a matrix is one value per row (``[rows]``, sharded
    like the weight's rows under FSDP2); of a vector, one per element. A matrix also keeps its
    columns' mean gradient, replicated (``[cols]``, ``Replicate()``)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                sq = p.grad.square()
                sq = sq.mean(dim=-1) if p.dim() == 2 else sq
                if not st:
                    st["row"] = torch.zeros_like(sq)
                    if p.dim() == 2:
                        st["col"] = torch.zeros_like(_replicated(p.grad).mean(dim=0))
                st["row"].mul_(0.9).add_(sq, alpha=0.1)
                if p.dim() == 2:
                    st["col"].mul_(0.5).add_(_replicated(p.grad).mean(dim=0))
                den = (st["row"].unsqueeze(-1) if p.dim() == 2 else st["row"]).sqrt().add(1e-8)
                p.add_(p.grad / den, alpha=-g["lr"])


def _replicated(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import Replicate

    return t.redistribute(placements=[Replicate()])


def _fsdp(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    mesh = cpu_mesh()
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _step(m: nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    m(torch.ones(3, 6)).sum().backward()
    o.step()


def _save(rank: int, world: int, root: str) -> dict:
    m = _fsdp(0)
    o = RowAdam(m.parameters())
    _step(m, o)
    _step(m, o)
    tg.save(f"{root}/ck-{world}", {"model": m, "optim": o})
    saved = {(i, k): v.full_tensor().clone() for i, p in enumerate(m.parameters()) for k, v in o.state[p].items()}
    _step(m, o)
    return {"row": saved, "after": [p.full_tensor().clone() for p in m.parameters()]}


def _load(rank: int, world: int, root: str, saved_world: int, ref: dict) -> list:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    m = _fsdp(1)
    o = RowAdam(m.parameters())
    tg.load(f"{root}/ck-{saved_world}", {"model": m, "optim": o})
    state = {(i, k): v for i, p in enumerate(m.parameters()) for k, v in o.state[p].items()}
    assert set(state) == set(ref["row"])
    for (i, k), t in state.items():
        want = (Shard(0),) if k == "row" else (Replicate(),)
        assert isinstance(t, DTensor) and t.placements == want, (i, k, type(t), getattr(t, "placements", None))
        assert torch.equal(t.full_tensor(), ref["row"][i, k]), (i, k)
    _step(m, o)  # failed before: "got mixed torch.Tensor and DTensor"
    return [torch.equal(p.full_tensor(), a) for p, a in zip(m.parameters(), ref["after"], strict=True)]


def test_fsdp2_factored_optimizer_state_loads_sharded_and_resumes(tmp_path):
    ref = run_ranks(_save, 2, str(tmp_path), timeout=120, env=ENV)[0].value
    same = [r.value for r in run_ranks(_load, 2, str(tmp_path), 2, ref, timeout=120, env=ENV)]
    assert same == [[True] * 4] * 2  # the resume is bit-identical to the run that went on
    run_ranks(_load, 3, str(tmp_path), 2, ref, timeout=120, env=ENV)  # resharded: loads, and steps


def test_fsdp2_factored_state_saved_on_one_rank_loads_sharded_on_two(tmp_path):
    ref = run_ranks(_save, 1, str(tmp_path), timeout=120, env=ENV)[0].value
    run_ranks(_load, 2, str(tmp_path), 1, ref, timeout=120, env=ENV)


def _only_forms(rank: int, world: int, root: str) -> list:
    """Rank 0 passes no only=, rank 1 the list of every entry of its state: the same load."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    tg.save(f"{root}/ck", {"model": m, "optim": o})
    saved = [t.clone() for t in m.state_dict().values()]
    with torch.no_grad():
        m.weight.add_(1.0)
    tg.load(f"{root}/ck", {"model": m, "optim": o}, only=None if rank == 0 else ["optim", "model"])
    return [torch.equal(a, b) for a, b in zip(saved, m.state_dict().values(), strict=True)]


def test_only_none_and_the_list_of_every_entry_are_the_same_load(tmp_path):
    # refused as different only= before
    assert [r.value for r in run_ranks(_only_forms, 2, str(tmp_path), timeout=120, env=ENV)] == [[True, True]] * 2


def test_verify_and_ls_of_a_checkpoint_moved_aside_by_a_cut_short_overwrite_name_it(tmp_path):
    """An overwrite killed between its two renames leaves ``<name>.old-<id>`` and no ``<name>``;
    tg.load named it, but ``trainguard verify``/``ls`` said only "no such directory"."""
    from click.testing import CliRunner

    from trainguard.cli import main

    tg.save(tmp_path / "final", {"model": {"w": torch.arange(10.0)}})
    (tmp_path / "final").rename(tmp_path / "final.old-1a2b")
    for cmd in ("verify", "ls"):
        got = CliRunner().invoke(main, [cmd, str(tmp_path / "final")])
        assert got.exit_code == 2, got.output
        assert f"its previous checkpoint is {tmp_path / 'final.old-1a2b'}" in got.output, got.output
    assert tg.verify(tmp_path / "final.old-1a2b").ok
