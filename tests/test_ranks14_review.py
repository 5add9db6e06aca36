"""Session 14's fixes replayed on 2 gloo ranks (DDP-style replicated state and FSDP2
``fully_shard``): a failure on ONE rank is the same failure on every rank, within the timeout,
and the next save works."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from test_syscall_review import Inject

from dist_helper import attempt, full_state, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def _model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 7))  # 7 rows: uneven over 2
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    return m


def _state(kind: str, seed: int) -> dict:
    m = _model(kind, seed)
    return {"model": m, "progress": tg.StateDict(step=seed)}


def _weights(st: dict) -> dict:
    return full_state(st["model"], torch.optim.SGD(st["model"].parameters()))


def _restore_with_error_on_one_rank(rank: int, world: int, root: str, kind: str, err: int, call: str) -> dict:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False, timeout=20) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(kind, step))
    want = {s: _weights(_state(kind, s)) for s in (1, 2)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False, timeout=20) as mgr:
        st = _state(kind, 9)
        got: dict = {}

        def restore() -> None:
            if rank == 1:
                with Inject({call: 1}, err, match="step-000000002/data" if call == "open" else ""):
                    got["step"] = mgr.restore(st)
            else:
                got["step"] = mgr.restore(st)

        outcome = attempt(restore)
        w = _weights(st)
        same = [s for s in (1, 2) if all(torch.equal(w[k], want[s][k]) for k in w)]
        nxt = attempt(lambda: mgr.save(3, _state(kind, 3)))
    return {"outcome": outcome, "step": got.get("step"), "progress": st["progress"]["step"], "same": same, "next": nxt}


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("call", ["open", "preadv"])
def test_an_io_error_on_one_rank_falls_back_to_the_same_older_step_on_every_rank(tmp_path, kind, call):
    res = run_ranks(_restore_with_error_on_one_rank, 2, str(tmp_path), kind, errno.EIO, call, timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert [v["outcome"] for v in vals] == [{"type": None}] * 2, vals
    assert [v["step"] for v in vals] == [1, 1] and [v["progress"] for v in vals] == [1, 1]
    assert [v["same"] for v in vals] == [[1], [1]]
    assert [v["next"] for v in vals] == [{"type": None}] * 2


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_eacces_on_one_rank_is_raised_on_every_rank_without_fallback(tmp_path, kind):
    res = run_ranks(_restore_with_error_on_one_rank, 2, str(tmp_path), kind, errno.EACCES, "open", timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert [v["step"] for v in vals] == [None, None], vals
    assert vals[1]["outcome"]["type"] == "CheckpointError" and "step-000000002" in vals[1]["outcome"]["msg"]
    assert vals[0]["outcome"]["type"] == "RankFailureError" and vals[0]["outcome"]["ranks"] == [1]
    assert [v["next"] for v in vals] == [{"type": None}] * 2
    # One rank's index file (format 2: FSDP2's regular shards) that the process may not read was
    # read as 'index file is missing', a CorruptCheckpointError: restore fell back to step 1 and
    # set step 2 aside (deleted at the next commit). verify called it corruption too.
    step2 = Path(tmp_path) / "step-000000002"
    if kind == "fsdp":
        with Inject({"open": 1}, errno.EACCES, match="data-00001.idx"), pytest.raises(PermissionError):
            tg.verify(step2)
    with Inject({"open": 1}, errno.EIO, match="step-000000002/data-00001"):
        report = tg.verify(step2)
    assert not report.ok and "Input/output" in report.errors[0]
    assert tg.verify(step2).ok  # still there: no fallback, nothing set aside
