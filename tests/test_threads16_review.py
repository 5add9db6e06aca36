"""Review of ranks, threads and async failures (threads16): what the per-operation rounds
(``dist.StoreDistContext.operation``, ``distwait.py``) left open.

Every scenario runs real gloo ranks on 127.0.0.1 (``dist_helper.run_ranks``), bounded in time.
"""

from __future__ import annotations

import trainguard as tg
from test_rejoin import ENV, _state

from dist_helper import run_ranks


def _outcome(fn) -> dict:  # noqa: ANN001
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared by the test
        return {"type": type(e).__name__, "permanent": tg.exit_code_for(e) == 78, "msg": str(e)}
    return {"type": None}


def _bad_step_on_rank_1(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    mgr = tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False, timeout=20).open()
    out = _outcome(lambda: mgr.save(-1 if rank == 1 else 1, _state(1)))
    dist.barrier()  # rank 1 stays alive (its heartbeat beats): only its mark can tell the others
    return out


def test_a_permanent_error_on_one_rank_fails_the_others_at_once_with_a_permanent_error(tmp_path):
    # Before: rank 1's ValueError (exit 78) was never exchanged; ranks 0 and 2 waited in "begin"
    # for the whole timeout (20 s here, TRAINGUARD_TIMEOUT) and then failed with a transient
    # "did not arrive" error: under `trainguard run` a restart or exit 78 depending on which
    # worker's exit the agent saw first.
    res = run_ranks(_bad_step_on_rank_1, 3, str(tmp_path), timeout=60, env=ENV)
    vals = [r.value for r in res]
    assert vals[1]["type"] == "ValueError" and vals[1]["permanent"], vals
    for v in (vals[0], vals[2]):  # rank 2 gets rank 0's verdict through the store: permanent too
        assert v["type"] == "RankFailureError" and v["permanent"], vals
        assert "rank(s) [1] failed with an error that no restart fixes" in v["msg"] and "step=-1" in v["msg"], vals
    assert vals[0]["msg"] == vals[2]["msg"], vals

