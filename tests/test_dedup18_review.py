"""``split_state=True``: a tensor that several groups hold is written once (``splitplan.py``).

Every group wrote it and rank 0 kept one copy: with 4 expert-parallel ranks sharing a block,
12.6 MB of data files for 3.15 MB referenced. Now one group writes each such tensor (chosen to
balance the groups' bytes) and the others hash the same chunks without writing them; the
checksums are still compared (``split.dedupe``), sync and async, under in-place mutation
right after an async save returns."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import attempt, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}
N = 128  # the shared block is N x N float32 (64 KiB a tensor)
WORLD = 3


def ep_model(experts: list[int]) -> nn.Module:
    """Expert parallelism on plain tensors: a ``shared`` block and a ``table`` buffer that every
    rank holds, and this rank's experts."""
    torch.manual_seed(0)
    m = nn.Module()
    m.shared = nn.Linear(N, N)
    m.register_buffer("table", torch.randn(N, N))
    m.experts = nn.ModuleDict({str(e): nn.Linear(4, 4) for e in range(WORLD)})
    for e in range(WORLD):
        if e not in experts:
            del m.experts[str(e)]
    return m


def ep_step(m: nn.Module, opt: torch.optim.Optimizer, seed: float) -> None:
    """Gradients the same on every rank for the shared block (as after its all-reduce)."""
    for n, p in m.named_parameters():
        p.grad = torch.full_like(p, seed + (0.25 * int(n.split(".")[1]) if n.startswith("experts") else 0.5))
    opt.step()


def _state_of(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for n, p in m.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim/{n}/{k}"] = v.detach().clone()
    return out


def _save(rank: int, world: int, root: str, mode: str) -> dict[str, torch.Tensor]:
    """Each rank its own group; ``mode``: sync, async (staged copies), pieces (async with a 16 KiB
    staging buffer and block: every shared chunk staged and hashed in 4 pieces), zero-copy
    (async, written and hashed from the live tensors), host-batches (sync, every chunk through the
    bounded host buffer, as a GPU state's: ``streams.host_batches``)."""
    from trainguard import api, asyncjob, streams

    if mode == "pieces":
        api.DEFAULT_BLOCK = asyncjob.DEFAULT_BLOCK = 16 << 10  # asyncjob._stage_background reads it
    if mode == "zero-copy":
        os.environ["TRAINGUARD_ASYNC_ZERO_COPY"] = "1"
    if mode == "host-batches":
        streams.needs_host_copy = lambda t: True  # the seam: CPU tensors taken as a device's
    m = ep_model([rank])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    ep_step(m, opt, 1.0)
    saved = _state_of(m, opt)
    state = {"model": m, "optim": opt}
    if mode in ("sync", "host-batches"):
        tg.save(f"{root}/step-1", state, split_state=True)
        return saved
    h = tg.save(f"{root}/step-1", state, split_state=True, async_=True, max_staging_bytes=(16 << 10) if mode == "pieces" else None)
    # Training goes on at once, differently on each rank: a group that hashed the live tensors
    # after this (instead of what the save took) would differ from the writing group's bytes.
    with torch.no_grad():
        m.table.add_(rank + 1)  # a buffer: copied in the call
    ep_step(m, opt, 10.0 + rank)  # step() waits until the parameters and moments are staged
    h.result()
    return saved


def _data_bytes(ck) -> int:
    return sum(f.stat().st_size for f in ck.iterdir() if f.name.startswith("data-"))


def _load_whole(ck) -> dict[str, torch.Tensor]:
    m = ep_model(list(range(WORLD)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    ep_step(m, opt, 0.0)  # state to overwrite
    tg.load(ck, {"model": m, "optim": opt})
    return _state_of(m, opt)


def _union(results) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r.value)
    return out


@pytest.mark.parametrize("mode", ["sync", "async", *(pytest.param(m, marks=pytest.mark.slow)  # suite time: 3 modes in the slow run
                                                     for m in ("host-batches", "pieces", "zero-copy"))])
def test_a_block_every_group_holds_is_written_once_and_loads_bit_identical(tmp_path, mode):
    from trainguard.manifest import Manifest

    expected = _union(run_ranks(_save, WORLD, str(tmp_path), mode, timeout=120, env=ENV))
    ck = tmp_path / "step-1"
    man = Manifest.from_bytes((ck / "manifest.json").read_bytes())
    one_copy = sum(c.length for e in man.tensors.values() for c in e.chunks)
    shared = [p for p in man.tensors if "experts" not in p]
    per_rank = sum(man.tensors[p].nbytes for p in shared)
    assert per_rank >= 4 * N * N * 4  # weight, table and two moments, at least
    # One copy of the shared block (it was WORLD copies: 3 x 0.26 MB), plus alignment.
    assert one_copy <= per_rank + 10_000
    assert _data_bytes(ck) <= one_copy + 4096 * sum(len(e.chunks) for e in man.tensors.values()), (_data_bytes(ck), one_copy)
    assert _data_bytes(ck) < 1.2 * per_rank
    # Balanced: the four large shared tensors are spread over the three groups' files.
    big = [p for p in shared if man.tensors[p].nbytes >= N * N * 4]
    assert len({c.file for p in big for c in man.tensors[p].chunks}) == WORLD, {p: man.tensors[p].chunks[0].file for p in big}
    got = _load_whole(ck)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items()), [k for k, v in expected.items() if not torch.equal(got[k], v)]


def _load_split(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    m = ep_model([rank])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    ep_step(m, opt, 0.0)
    tg.load(f"{root}/step-1", {"model": m, "optim": opt}, split_state=True)
    return _state_of(m, opt)


def test_a_split_load_of_the_written_once_block_is_bit_identical(tmp_path):
    saved = run_ranks(_save, WORLD, str(tmp_path), "sync", timeout=120, env=ENV)
    loaded = run_ranks(_load_split, WORLD, str(tmp_path), timeout=120, env=ENV)
    for s, g in zip(saved, loaded):
        assert s.value.keys() == g.value.keys() and all(torch.equal(g.value[k], v) for k, v in s.value.items())


def _differs(rank: int, world: int, root: str, async_: bool) -> dict:
    m = ep_model([rank])
    if rank == 2:
        with torch.no_grad():
            m.shared.weight[N - 1, N - 1] += 1.0  # the last element: the end of the last block
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)

    def save() -> None:
        h = tg.save(f"{root}/step-1", {"model": m, "optim": opt}, split_state=True, async_=async_)
        if async_:
            h.result()

    return attempt(save)


def test_a_shared_tensor_that_differs_is_still_refused_naming_it_and_the_ranks(tmp_path):
    """Async (sync: test_split_state's test_a_shared_tensor_that_differs_between_stages_is_refused)."""
    out = run_ranks(_differs, WORLD, str(tmp_path), True, timeout=120, env=ENV)
    for r in out:
        msg = r.value["msg"]
        assert "model/shared.weight" in msg and "different values" in msg and "rank 2" in msg, r.value
    assert not (tmp_path / "step-1").exists()


def _dies_in_the_round(rank: int, world: int, root: str, how: str, who: int) -> dict:
    from trainguard import splitplan

    real = splitplan.proposal

    def proposal(snap):
        if rank == who and how == "exit":
            os._exit(17)  # dead in the new round: no report, no heartbeat
        if rank == who:
            raise ValueError(f"no proposal on rank {who}")
        return real(snap)

    splitplan.proposal = proposal
    m = ep_model([rank])
    return attempt(lambda: tg.save(f"{root}/step-1", {"model": m}, split_state=True, timeout=30))


@pytest.mark.parametrize("how,who", [pytest.param("exit", 1, marks=pytest.mark.slow), ("exit", 0), ("raise", 1)])  # suite time
def test_a_rank_that_dies_or_fails_in_the_owner_round_fails_the_save_on_every_rank(tmp_path, how, who):
    """Rank 1 dead: rank 0's gather names it and broadcasts the failure; rank 0 dead: the others,
    waiting for its answer, name it (its heartbeat stopped)."""
    out = run_ranks(_dies_in_the_round, WORLD, str(tmp_path), how, who, timeout=90, env=ENV, check=False)
    alive = [r for r in out if r.rank != who] if how == "exit" else out
    assert out[who].exitcode == (17 if how == "exit" else 0)
    for r in alive:
        assert r.ok and r.value["type"] == "RankFailureError" and r.value["ranks"] == [who], (r.value, r.error)
    if how == "raise":
        assert all(f"no proposal on rank {who}" in r.value["msg"] or f"rank(s) [{who}]" in r.value["msg"] for r in alive)
    assert not [p.name for p in tmp_path.iterdir()]  # no checkpoint, no temp directory: the round comes first


class _NoRounds:
    rank, world_size = 0, 2

    def gather(self, *a, **k):
        raise AssertionError("a round")

    broadcast = gather


def test_no_new_round_without_split_state_or_with_one_group():
    from trainguard import splitplan
    from trainguard.capture import Snapshot

    snap = Snapshot(objects={}, rank_local=[], leaves=[], split=False)
    assert splitplan.owners(_NoRounds(), snap, ["a", "b"], None) == set()  # type: ignore[arg-type]
    snap.split = True
    assert splitplan.owners(_NoRounds(), snap, ["a", "a"], None) == set()  # type: ignore[arg-type]


def test_owner_assignment_balances_bytes_per_rank_and_skips_what_cannot_be_compared():
    import base64

    from trainguard.splitplan import decide

    def rep(*items):
        return {"error": None, "items": [list(i) for i in items]}

    big, small = 1000, 10
    reports = [
        rep(("a", "float32", [1], big), ("b", "float32", [1], big), ("c", "float32", [1], small), ("d", "float32", [2], small), ("e", "float32", [1], -1)),
        {"error": None, "items": None},  # rank 1: in rank 0's group
        rep(("a", "float32", [1], big), ("b", "float32", [1], big), ("c", "float32", [1], small), ("d", "float32", [3], small), ("e", "float32", [1], -1)),
    ]
    sigs = ["x", "x", "y"]  # group 0 has two ranks, group 2 one
    out = decide(reports, sigs)

    def hashed(r):
        bits = int.from_bytes(base64.b64decode(out.get(str(r), "")), "little")
        return {reports[r]["items"][i][0] for i in range(5) if bits >> i & 1}

    # Bytes per rank so far (d: 10 each, 5 a rank in the group of two): a to group 0 (then 505 a
    # rank), b to rank 2's (10), c to group 0 (505 < 1010); d (shapes differ: refused by
    # split.dedupe) and e (-1) written by both.
    assert hashed(0) == {"b"} and hashed(2) == {"a", "c"}
    assert decide(reports, sigs) == out  # deterministic


def test_hashed_pieces_give_the_written_chunks_checksums(tmp_path):
    from trainguard.io import WriteChunk, write_file
    from trainguard.splitplan import Hashed
    from trainguard.storage import for_path

    block = 16 << 10
    data = memoryview(bytes(range(256)) * (5 * block // 256 + 3))
    storage, root = for_path(str(tmp_path))
    (written,) = write_file(storage, storage.join(root, "f"), [WriteChunk(data, 0)], len(data), block=block)
    h = Hashed([(type("L", (), {"path": "p", "regular": None})(), None)], {"p"}, block)
    for start in (0, 2 * block, 4 * block):  # pieces on blocks of the chunk, as staging splits it
        h.piece(0, start, data[start : start + 2 * block])
    assert h.fill([[]]) == [written] and len(written) == 6
    with pytest.raises(tg.CheckpointError):
        h.piece(0, block // 2, data[:block])
