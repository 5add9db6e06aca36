"""A realistic DDP loop resumed on 2 gloo ranks (127.0.0.1), and what it found.

The kitchen-sink loop (tests/kitchen18_sink.py: BatchNorm, Dropout, LayerNorm, default DDP, AdamW
with two groups, clipping, accumulation with no_sync, bfloat16 autocast + GradScaler, warm-up then
cosine, an EMA, SeededDataset + ResumableSampler with 2 workers, validation passes) is stopped after
a save and resumed; every rank's losses, data order and final state must equal an uninterrupted
run's, bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import run_ranks


def _ema_rank(rank: int, world: int, root: str, ema_first: bool) -> dict:
    """DDP(BatchNorm model) with default buffer sync + an EMA that averages the buffers too
    (``AveragedModel(use_buffers=True)``), one step on each rank's own data, a save: every rank's
    EMA statistics differ (each rank's BatchNorm moved with its own batch). Rank 0 then reads the
    checkpoint's EMA back and says which tensors are not its own copy."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(net)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    ddp(x).square().mean().backward()
    opt.step()
    ema.update_parameters(net)
    state = {"ema": ema, "model": ddp} if ema_first else {"model": ddp, "ema": ema}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tg.save(f"{root}/step-000000001", state)
    mine = {k: v.clone() for k, v in ema.state_dict().items()}
    back = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True)
    for t in back.state_dict().values():
        t.data.zero_()
    tg.load(f"{root}/step-000000001", {"ema": back}, only=["ema"])
    other = [k for k, v in back.state_dict().items() if not torch.equal(v, mine[k])]
    return {"not_mine": other, "warned": [str(w.message) for w in caught if "differ between ranks" in str(w.message)]}


@pytest.mark.parametrize("ema_first", [False, True])
def test_ema_of_ddp_buffers_is_saved_from_the_sync_source_rank(tmp_path, ema_first):
    # Before: the EMA's running_mean was saved from rank 1 and its running_var from rank 0 (the
    # replicated writes balanced over the ranks), so even rank 0 resumed with an EMA no rank had.
    res = run_ranks(_ema_rank, 2, str(tmp_path), ema_first, timeout=60)
    assert res[0].value["not_mine"] == []
    assert res[0].value["warned"] == []  # expected to differ, like DDP's own buffers: not a mistake


def _same(a, b, path: str, out: list[str]) -> None:
    """Append to ``out`` the paths where ``a`` and ``b`` differ (tensors bit for bit)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))):
            out.append(path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k} missing")
            else:
                _same(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {a!r} != {b!r}")


@pytest.mark.slow
@pytest.mark.parametrize("opts", [
    {"async": True},                                   # EMA shared: rank 0's resumes, rank 1's drifts
    {"async": False, "ema_local": True, "val_every": 5},  # the save right after a validation pass
    {"async": True, "no_train_after_val": True, "val_every": 5, "ema": False},  # the save in eval mode
    {"async": True, "compile": True, "ema_local": True},  # torch.compile(DDP(net)): ~15 s to compile a rank
    {"async": True, "dtype": "float16", "ema_local": True},  # float16 autocast: the GradScaler scales for real
], ids=["async", "sync-ema-local-val-at-save", "save-in-eval-mode", "compile", "float16"])
def test_kitchen_sink_ddp_loop_resumes_bit_identically(tmp_path, opts):
    import kitchen18_sink as ks

    straight = run_ranks(ks.train, 2, str(tmp_path / "a"), 14, None, opts, timeout=150)
    first = run_ranks(ks.train, 2, str(tmp_path / "b"), 14, 8, opts, timeout=150)  # stops after step 8
    second = run_ranks(ks.train, 2, str(tmp_path / "b"), 14, None, opts, timeout=150)
    assert first[0].value["log"]["saved"] == [5] and second[0].value["log"]["start"] == 5
    diffs: list[str] = []
    for r in range(2):
        a, b = straight[r].value, second[r].value
        for key in ("loss", "idx", "val", "lr"):
            assert sorted(b["log"][key]) == [s for s in sorted(a["log"][key]) if s > 5]
            _same({s: a["log"][key][s] for s in b["log"][key]}, b["log"][key], f"r{r}/{key}", diffs)
        _same(a["final"], b["final"], f"r{r}/final", diffs)
    if opts.get("ema", True) and not opts.get("ema_local"):
        # The EMA's BatchNorm statistics are saved from rank 0 (docs/distributed.md, "Replicas that
        # differ"): rank 1 resumes with rank 0's, so its own EMA statistics differ; nothing else does.
        assert diffs == ["r1/final/ema/module.1.running_mean", "r1/final/ema/module.1.running_var"]
    else:
        assert diffs == []


@pytest.mark.slow
def test_kitchen_sink_resumed_at_world_size_1_continues_the_data_order(tmp_path):
    import kitchen18_sink as ks

    opts = {"val_every": 3}
    first = run_ranks(ks.train, 2, str(tmp_path), 20, 8, opts, timeout=150)
    second = run_ranks(ks.train, 1, str(tmp_path), 20, None, opts, timeout=150)
    start = second[0].value["log"]["start"]
    assert start == 5 and second[0].value["log"]["saved"] == [10, 15]
    logs = [r.value["log"] for r in first]
    seen = [i for s in range(start + 1) for lg in logs for i in lg["idx"][s]]
    seen += [i for s in sorted(second[0].value["log"]["idx"]) for i in second[0].value["log"]["idx"][s]]
    sampler = tg.ResumableSampler(ks.N_SAMPLES, seed=7, shuffle=True, rank=0, world_size=1)
    final = second[0].value["final"]["sampler"]
    want: list[int] = []
    for e in range(final["epoch"] + 1):
        order = sampler.order(e)
        want += order if e < final["epoch"] else order[:final["position"]]
    assert sorted(seen) == sorted(want)  # every sample once per epoch, over both world sizes
    assert all(v == v for v in second[0].value["log"]["loss"].values())  # trains: finite losses
