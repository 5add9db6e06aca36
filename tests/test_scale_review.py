"""Scale review: work that must grow linearly with the size of what it is given (events of a
long run, samples of a huge dataset). Counted, not timed: a quadratic version does far more
look-ups, whatever the machine's speed."""

from __future__ import annotations

from typing import Any

from trainguard.report import summarize


class _Counted(dict):
    """An event whose field reads are counted (``summarize`` reads ``event`` and ``t`` of each)."""

    reads = 0

    def __getitem__(self, k: Any) -> Any:
        _Counted.reads += 1
        return super().__getitem__(k)

    def get(self, k: Any, default: Any = None) -> Any:
        _Counted.reads += 1
        return super().get(k, default)


def _long_run(steps: int, every: int) -> list[dict[str, Any]]:
    """A week-long run's log in miniature: a step event per step, a failure every ``every`` steps."""
    ev = [_Counted(t=0.0, event="agent_start", rank=-1, pid=1)]
    t, pid = 0.0, 10
    for s in range(1, steps + 1):
        t += 1.0
        ev.append(_Counted(t=t, event="step", step=s, rank=0, pid=pid))
        if s % every == 0:
            ev.append(_Counted(t=t + 0.1, event="fault", step=s, rank=1, pid=pid + 1, kind="kill"))
            ev.append(_Counted(t=t + 0.2, event="failure", rank=1, pid=1, cause="killed"))
            ev.append(_Counted(t=t + 0.5, event="restore", step=s - 3, rank=0, pid=pid + 2, seconds=0.25))
            ev.append(_Counted(t=t + 0.7, event="first_step", step=s - 2, rank=0, pid=pid + 2, lost_steps=3))
            pid += 2
            t += 1.0
    return ev


def test_report_reads_each_event_a_bounded_number_of_times_whatever_the_failures():
    """``summarize`` looked for each failure's restore and first step from the start of the log:
    O(failures x events), 75 s for 400,000 events and 800 failures. Now a bisection per failure."""
    ev = _long_run(20_000, 100)  # 200 failures
    _Counted.reads = 0
    s = summarize(ev)
    assert s["failures"] == 200 and len(s["recoveries"]) == 200
    r = s["recoveries"][-1]
    assert (r["restored_step"], r["lost_steps"], r["fault_step"]) == (20_000 - 3, 3, 20_000)
    assert abs(r["detect_s"] - 0.1) < 1e-9 and abs(r["restore_s"] - 0.25) < 1e-9
    assert abs(r["first_step_s"] - 0.2) < 1e-9 and abs(r["recover_s"] - 0.6) < 1e-9
    assert s["lost_steps"] == 600
    # The quadratic search read ~4 fields x 200 failures x 21,000 events (17 M).
    assert _Counted.reads < 40 * len(ev), _Counted.reads


def _iter_peak(sampler: Any, take: int) -> tuple[list[Any], int]:
    """The first ``take`` items of ``iter(sampler)`` and the peak of Python memory it took."""
    import itertools
    import tracemalloc

    tracemalloc.start()
    try:
        got = list(itertools.islice(iter(sampler), take))
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_sampler_iter_holds_this_ranks_share_not_the_epochs_order_as_python_ints():
    """``iter(ResumableSampler)`` built the whole epoch's order as a Python list on every rank
    (``randperm(n).tolist()``, ``list(range(n))`` unshuffled): ~36 bytes a sample, 36 GB for a
    dataset of 10**9, per rank, at each epoch and each restore, to keep 1/W of it. Now the
    permutation stays a tensor (8 bytes a sample, outside Python's heap) and only this rank's
    share becomes ints; unshuffled, nothing of size n is built. Same indices as before."""
    from trainguard.sampler import ResumableSampler

    n, world = 400_000, 64
    for shuffle in (True, False):
        s = ResumableSampler(n, seed=3, shuffle=shuffle, rank=5, world_size=world)
        s.position = 1_000 * world + 17  # mid-epoch, not a multiple of the world size
        got, peak = _iter_peak(s, n)
        order = s.order()
        start = s.position + 5
        want = order[start::world]
        want += [order[(g - n) % n] for g in range(start + len(want) * world, s.position + len(s) * world, world)]
        assert got == want and len(got) == len(s)
        # The whole order as ints: >= 36 bytes x n = 14 MB; this rank's share: ~0.2 MB.
        assert peak < 8 * n // 4, (shuffle, peak)
    s = ResumableSampler(n, seed=3, rank=5, world_size=world, with_epoch=True)
    s.epoch = 2
    got, peak = _iter_peak(s, 3)
    assert got == [(i, 2) for i in s.order()[5 : 5 + 3 * world : world]] and peak < 8 * n // 4


class _Step(int):
    """A step number whose equality tests are counted (a list's ``in`` makes one per element)."""

    eqs = 0
    __hash__ = int.__hash__

    def __eq__(self, other: object) -> bool:
        _Step.eqs += 1
        return int(self) == other


def test_ram_tier_candidates_compare_steps_linearly(tmp_path):
    """``RamTier.candidates`` (rank 0, in every ``restore`` of a manager with ``ram_tier``)
    looked each step up in the list of durable steps: O(steps**2), 20 s for 40,000 kept
    checkpoints (``KeepAll``/``KeepEvery`` over a long run) while every other rank waits in the
    broadcast of the result."""
    from trainguard.storage.local import LocalStorage
    from trainguard.tiers import RamTier

    (tmp_path / "shm").mkdir()
    rt = RamTier(str(tmp_path / "shm"), root=str(tmp_path / "run"), durable=LocalStorage(), durable_root=str(tmp_path / "run"),
                 ctx=None, events=None)
    (tmp_path / "shm" / "ram").mkdir()
    rt.dir = str(tmp_path / "shm" / "ram")  # an empty RAM tier: every candidate is durable
    n = 3_000
    _Step.eqs = 0
    out = rt.candidates([_Step(s) for s in range(0, 10 * n, 10)])
    assert [s for s, _p, _t in out] == list(range(10 * (n - 1), -1, -10)) and {t for *_, t in out} == {"durable"}
    assert _Step.eqs < 10 * n, _Step.eqs  # the list's `in`: ~n**2 / 2 = 4.5 M


def test_optimizer_load_does_not_scan_its_group_for_every_state_tensor(tmp_path, monkeypatch):
    """torch's ``Optimizer.load_state_dict`` asks, for every state tensor, which group holds its
    parameter: ``param_id in group["params"]``, a list scan, O(params**2) for one big group (Adam
    over 16,000 parameters: 4.7 s; 100,000, an MoE's per-expert tensors: ~3 min, at every restore).
    The groups trainguard hands it answer that with a set. Counted: the scan that torch's test
    would make on a plain list is the position of the id in it."""
    import torch

    import trainguard as tg

    n = 2_000
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.full((2,), float(i))) for i in range(n)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones(2)
    opt.step()
    tg.save(str(tmp_path / "c"), {"model": model, "optim": opt})
    want = {name: opt.state[p]["momentum_buffer"].clone() for name, p in model.items()}
    for p in model.parameters():
        opt.state[p]["momentum_buffer"].zero_()

    original = torch.optim.Optimizer._process_value_according_to_param_policy
    scanned = [0]

    def counting(param: Any, value: Any, param_id: Any, param_groups: Any, key: Any = None) -> Any:
        for pg in param_groups:
            ids = pg["params"]
            scanned[0] += (ids.index(param_id) + 1 if param_id in ids else len(ids)) if type(ids) is list else 1
            if param_id in ids:
                break
        return original(param, value, param_id, param_groups, key)

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(counting))
    tg.load(str(tmp_path / "c"), {"model": model, "optim": opt})
    assert all(torch.equal(opt.state[model[name]]["momentum_buffer"], v) for name, v in want.items())
    assert [g["params"] for g in opt.param_groups] == [list(model.parameters())]
    assert scanned[0] <= 2 * n, scanned[0]  # a plain list: n**2 / 2 = 2 M


def test_retention_reads_kept_checkpoints_facts_without_validating_their_tensors(tmp_path, monkeypatch):
    """A retention policy that reads metadata (``KeepBest``, or any union with it) learns, at the
    first retention after a restart, ``created`` and the metrics of every kept checkpoint. It
    parsed and validated each whole manifest for those two values: for 100,000 tensors, 15 MB and
    1.5-3.7 s each, so a run keeping ``KeepEvery(1000) | KeepBest("loss")`` checkpoints spent
    minutes in the first save after each restart. Counted: tensor entries validated."""
    import torch

    import trainguard as tg
    from trainguard import manifest as mf

    root = str(tmp_path / "run")
    state = {"w": {f"t{i}": torch.zeros(2) for i in range(300)}, "p": tg.StateDict(step=0)}
    keep = tg.KeepBest("loss", n=2) | tg.KeepEvery(10)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(10), keep=keep, handle_signals=False) as mgr:
        for s, loss in ((10, 3.0), (20, float("nan")), (30, 1.0), (40, 2.0), (50, 5.0)):
            mgr.save(s, state, metrics={"loss": loss})
    validated = [0]
    original = mf._tensor

    def counting(*a: Any, **k: Any) -> Any:
        validated[0] += 1
        return original(*a, **k)

    with tg.CheckpointManager(root, save=tg.EveryNSteps(10), keep=tg.KeepBest("loss", n=2), handle_signals=False) as mgr:
        assert mgr.restore(state) == 50
        monkeypatch.setattr(mf, "_tensor", counting)
        mgr.save(60, state, metrics={"loss": 4.0})
        monkeypatch.undo()
        assert mgr._created[30] > 0 and mgr._metrics[30] == {"loss": 1.0}
        assert str(mgr._metrics.get(20, {}).get("loss", "nan")) == "nan"
    # Kept: the two best (30, 40) and the newest (60); 10, 20 and 50 were deleted.
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == [
        "step-000000030", "step-000000040", "step-000000060"]
    assert validated[0] == 0, validated[0]  # before: every kept checkpoint's 301 tensors, 5 times


_MANY_FILES = r'''
import os, resource, sys, torch
import trainguard as tg
from trainguard.io import DEFAULT_BLOCK
from trainguard.manifest import Chunk, Manifest, TensorEntry, checksum

W, d = int(sys.argv[1]), sys.argv[2]
full = torch.arange(W * 4, dtype=torch.float32).reshape(W, 4)
chunks, files = [], {}
os.makedirs(d)
for r in range(W):  # what W ranks write for a tensor sharded by rows: one file each
    b = full[r].numpy().tobytes()
    name = f"data-{r:05d}.bin"
    with open(os.path.join(d, name), "wb") as f:
        f.write(b)
    files[name] = len(b)
    chunks.append(Chunk([r, 0], [1, 4], name, 0, len(b), [checksum(b)]))
m = Manifest(step=1, world_size=W, created=1.0, layout="sharded", block_size=DEFAULT_BLOCK, files=files,
             objects={"t": {"skeleton": {"$t": "t"}}}, tensors={"t": TensorEntry("float32", [W, 4], chunks)})
with open(os.path.join(d, "manifest.json"), "wb") as f:
    f.write(m.to_bytes())
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))  # a common default is 1024, for 1,000+ ranks
t = torch.zeros(W, 4)
tg.load(d, {"t": t})
assert torch.equal(t, full)
v = tg.verify(d)
assert v.ok, v.errors
print("OK")
'''


def test_a_checkpoint_of_more_ranks_than_open_files_allowed_loads_and_verifies(tmp_path, run_child):
    """A load (and ``verify``) keeps every data file it reads open until it ends, up to two
    descriptors each (buffered and O_DIRECT): a checkpoint of more ranks' files than the process
    may open failed with ``OSError: Too many open files``. A replicated (DDP) tensor set is spread
    over every rank's file, so every rank's restore of a 1,000-rank DDP job touches 1,000 files,
    past the common soft limit of 1024 descriptors. The soft limit is now raised (up to the hard
    limit) as files are opened."""
    script = tmp_path / "many.py"
    script.write_text(_MANY_FILES)
    r = run_child([str(script), "300", str(tmp_path / "ckpt")], timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]
