"""Async save (one process): what is saved is the state at the call, the optimizer pre-step hook
holds step() until the background copies are done, failures surface at the next save/wait/close,
the staging pool is reused, the cap works, and the doc example runs."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import async_save, faults, stagecopy
from trainguard.events import read_events
from trainguard.stage import StagingPool, default_pool

ROOT = Path(__file__).resolve().parent.parent


class Net(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.norm = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make_state(width: int = 64, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = Net(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}
    train_step(state)
    return state


def train_step(state: dict) -> None:
    x = torch.randn(32, 16)
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["progress"]["step"] += 1


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optim"].state.values()):
        for k, v in s.items():
            out[f"optim/{i}/{k}"] = v.detach().clone()
    out["rng"] = torch.get_rng_state().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def load_fresh(path: Path, width: int = 64) -> dict[str, torch.Tensor]:
    state = make_state(width, seed=99)
    tg.load(path, state)
    return tensors_of(state)


@pytest.fixture(params=["zero_copy", "copy"])
def mode(request, monkeypatch):
    """Both ways of staging protected CPU tensors: copied into the staging pool first (the
    default) or written from their own memory (``TRAINGUARD_ASYNC_ZERO_COPY=1``)."""
    monkeypatch.setenv("TRAINGUARD_ASYNC_ZERO_COPY", "1" if request.param == "zero_copy" else "0")
    return request.param


@pytest.fixture
def copy_mode(monkeypatch):
    """Tests of the staging copies themselves (caps, batches, copy errors)."""
    monkeypatch.setenv("TRAINGUARD_ASYNC_ZERO_COPY", "0")


def no_save_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("trainguard-async-save")]


def test_step_waits_for_staging_and_checkpoint_holds_state_at_call(tmp_path, gate, mode):
    state = make_state()
    at_call = tensors_of(state)
    h = tg.save(tmp_path / "a", state, async_=True)
    assert not h.staged()  # parameters and Adam moments are still being copied
    # Training continues in another thread: forward (mutates BatchNorm stats) then step().
    t = threading.Thread(target=train_step, args=(state,))
    t.start()
    assert h.waiting.wait(30), "optimizer.step() did not reach the pre-step hook"
    assert state["model"].fc1.weight.equal(at_call["model/fc1.weight"])  # step() is held
    assert not state["model"].norm.running_mean.equal(at_call["model/norm.running_mean"])  # forward ran
    gate.set()
    t.join(30)
    assert not t.is_alive()
    assert differs(tensors_of(state), at_call)  # the step went through after staging
    assert h.hook_wait_s > 0
    h.result(timeout=60)
    assert_same(load_fresh(tmp_path / "a"), at_call)
    assert no_save_threads()


def test_in_place_mutation_right_after_save(tmp_path, mode):
    state = make_state()
    at_call = tensors_of(state)
    h = tg.save(tmp_path / "a", state, async_=True)
    # Buffers and RNG are copied inside the call: mutate them at once.
    state["model"].norm.running_mean.add_(5.0)
    torch.randn(100)
    # Parameters outside optimizer.step(): the documented rule is wait_staged() first.
    assert h.wait_staged(60)
    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(-3.0)
    assert differs(tensors_of(state), at_call)
    h.result(timeout=60)
    assert_same(load_fresh(tmp_path / "a"), at_call)


def test_stage_in_background_copies_nothing_in_the_call_and_saves_the_state_at_the_call(tmp_path, gate, copy_mode):
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(8)}  # plain tensors: no optimizer
    total = sum(v.nbytes for v in state.values())
    at_call = {k: v.clone() for k, v in state.items()}
    h = tg.save(tmp_path / "a", state, async_=True, stage_in_background=True)
    assert h.staged_sync_bytes == 0 and not h.staged()  # the gate holds the save thread: nothing copied yet
    gate.set()
    assert h.wait_staged(60)
    assert h.staged_background_bytes == total
    for v in state.values():  # allowed once staged, though the write may still run
        v.mul_(-2.0)
    h.result(timeout=60)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    tg.load(tmp_path / "a", out)
    assert all(torch.equal(out[k], at_call[k]) for k in state)
    # The default copies plain tensors inside the call.
    h2 = tg.save(tmp_path / "b", state, async_=True)
    assert h2.staged_sync_bytes == total
    h2.result(timeout=60)
    assert h2.staged_background_bytes == 0
    with pytest.raises(ValueError, match="needs async_=True"):
        tg.save(tmp_path / "c", state, stage_in_background=True)
    assert not (tmp_path / "c").exists()
    assert no_save_threads()


def test_manager_logs_stall_including_pre_step_wait(tmp_path, gate):
    state = make_state()
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False) as mgr:
        h = mgr.save(1, state)
        t = threading.Thread(target=train_step, args=(state,))
        t.start()
        assert h.waiting.wait(30)
        gate.set()
        t.join(30)
    saves = [e for e in read_events(tmp_path) if e["event"] == "save"]
    assert len(saves) == 1
    assert saves[0]["stall_hook_s"] > 0
    assert saves[0]["stall_s"] == pytest.approx(saves[0]["stall_call_s"] + saves[0]["stall_hook_s"], abs=2e-6)
    assert no_save_threads()

def test_manager_stage_in_background_counts_wait_staged_as_stall(tmp_path, gate, copy_mode):
    weights = {f"w{i}": torch.randn(300, 7) for i in range(5)}
    state = {"weights": tg.StateDict(**weights), "progress": tg.StateDict(step=0)}
    at_call = {k: v.clone() for k, v in weights.items()}
    with pytest.raises(ValueError, match="needs async_save=True"):
        tg.CheckpointManager(tmp_path / "x", stage_in_background=True, handle_signals=False)
    with tg.CheckpointManager(tmp_path / "m", save=tg.EveryNSteps(1), async_save=True, stage_in_background=True,
                              handle_signals=False) as mgr:
        h = mgr.save(1, state)
        assert h.staged_sync_bytes == 0 and not h.staged()
        # The loop waits before mutating; the staging is released once it is seen waiting.
        opener = threading.Thread(target=lambda: h.waiting.wait(30) and gate.set())
        opener.start()
        assert h.wait_staged(60)
        opener.join(30)
        for w in weights.values():
            w.add_(1.0)
    saves = [e for e in read_events(tmp_path / "m") if e["event"] == "save"]
    assert len(saves) == 1 and saves[0]["stall_wait_s"] > 0
    assert saves[0]["stall_s"] == pytest.approx(
        saves[0]["stall_call_s"] + saves[0]["stall_hook_s"] + saves[0]["stall_wait_s"], abs=3e-6
    )
    fresh = {"weights": tg.StateDict(**{k: torch.zeros_like(v) for k, v in weights.items()}), "progress": tg.StateDict(step=0)}
    tg.load(tmp_path / "m" / "step-000000001", fresh)
    assert all(torch.equal(fresh["weights"][k], at_call[k]) for k in weights)
    assert no_save_threads()



@pytest.mark.parametrize("where", ["save", "wait", "close"])
def test_disk_error_surfaces_and_previous_checkpoint_stays_valid(tmp_path, monkeypatch, where):
    state = make_state()
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, handle_signals=False).open()
    mgr.save(1, state)
    mgr.wait()
    at_1 = tensors_of(state)
    train_step(state)
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "write_begin")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    h = mgr.save(2, state)
    assert h is not None
    with pytest.raises(tg.CheckpointError, match="injected failure"):
        if where == "save":
            mgr.save(3, state)
        elif where == "wait":
            mgr.wait()
        else:
            mgr.close()
    monkeypatch.delenv("TRAINGUARD_CRASH_AT")
    assert no_save_threads()
    assert not default_pool().in_use  # buffers released
    assert mgr.latest_step() == 1
    assert_same(load_fresh(tmp_path / "step-000000001"), at_1)
    train_step(state)  # no hook left waiting on the failed save
    mgr.close()
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "save_failed"] == [2]


def test_staging_error_does_not_block_training(tmp_path, monkeypatch, copy_mode):
    state = make_state()
    real = stagecopy.copy_many  # the save thread's copies of CPU tensors into the staging buffer

    def broken(pairs, threads=2):
        if threading.current_thread().name.startswith("trainguard-async-save"):
            raise MemoryError("simulated: host memory exhausted")
        return real(pairs, threads)

    monkeypatch.setattr(stagecopy, "copy_many", broken)
    h = tg.save(tmp_path / "a", state, async_=True)
    train_step(state)  # the hook returns: a failed staging releases waiters
    with pytest.raises(tg.CheckpointError, match="staging failed"):
        h.result(timeout=60)
    assert not (tmp_path / "a" / "manifest.json").exists()
    assert not default_pool().in_use
    assert no_save_threads()


def test_unobserved_failure_is_raised_by_the_next_api_save(tmp_path, monkeypatch):
    state = make_state()
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "before_fsync")
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    first = tg.save(tmp_path / "a", state, async_=True)
    first.join()  # finished (and failed), but nobody called result()
    assert first.done() and first.exception() is not None
    monkeypatch.delenv("TRAINGUARD_CRASH_AT")
    with pytest.raises(tg.CheckpointError, match="previous async save") as raised:
        tg.save(tmp_path / "b", state, async_=True)
    assert f"({tmp_path / 'a'}) failed" in str(raised.value)  # names the save, not "(step None)"
    tg.save(tmp_path / "b", state, async_=True).result(timeout=60)  # reported once, then saving works
    assert (tmp_path / "b" / "manifest.json").exists()


def test_pool_reused_over_50_saves_without_rss_growth(tmp_path):
    state = make_state(width=1024)  # ~0.1 MB of fc weights ... plus Adam: a few hundred KB
    state["big"] = torch.randn(2 << 20)  # 8 MB plain tensor: copied in the call, into the pool
    pool = default_pool()
    proc = psutil.Process()
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2),
                              async_save=True, handle_signals=False) as mgr:
        for step in range(1, 51):
            train_step(state)
            mgr.save(step, state)
            if step == 5:
                mgr.wait()
                allocations, capacity, rss5 = pool.allocations, pool.capacity, proc.memory_info().rss
        mgr.wait()
        rss50 = proc.memory_info().rss
        assert pool.capacity == capacity and pool.allocations == allocations  # no arena growth
    assert pool.capacity == 0  # close() freed the staging memory
    assert rss50 - rss5 < 64 << 20, f"RSS grew by {(rss50 - rss5) >> 20} MiB over 45 saves"
    assert mgr.latest_step() == 50


def test_staging_cap_stages_in_batches_and_step_waits_for_the_last(tmp_path, gate, monkeypatch, copy_mode):
    # fc1.weight and its Adam moments are 6.4 MB each: larger than the 4 MiB batch buffer the cap
    # leaves, so they are split into block-aligned pieces across batches.
    state = make_state(width=100_000)
    at_call = tensors_of(state)
    cap = 8 << 20
    staged_at_batch: list[bool] = []  # was step() released when each batch reached the writer?
    real = tg.api.write_batches

    def spy(storage, path, batches, size, **kw):
        def watch():
            for batch in batches:
                staged_at_batch.append(async_save._INFLIGHT.handle.staged())
                yield batch

        return real(storage, path, watch(), size, **kw)

    monkeypatch.setattr(tg.api, "write_batches", spy)
    h = tg.save(tmp_path / "a", state, async_=True, max_staging_bytes=cap)
    t = threading.Thread(target=train_step, args=(state,))
    t.start()
    assert h.waiting.wait(30)
    gate.set()
    t.join(60)
    assert not t.is_alive()
    assert differs(tensors_of(state), at_call)  # the step ran after staging, while/after writing
    h.result(timeout=60)
    protected = sum(p.nbytes for p in state["model"].parameters()) * 3  # params + exp_avg + exp_avg_sq
    assert h.staged_background_bytes >= protected
    assert h.staging_batches >= protected // (4 << 20)  # copy, write, copy, ...
    assert staged_at_batch == [False] * (h.staging_batches - 1) + [True]  # released with the last batch
    pool = default_pool(cap)
    assert pool.capacity <= cap  # sync slots (BN stats, RNG) + the 4 MiB batch buffer
    assert_same(load_fresh(tmp_path / "a", width=100_000), at_call)
    assert tg.load(tmp_path / "a", make_state(width=100_000, seed=3)) is not None


def test_write_error_between_batches_releases_step_and_pool(tmp_path, monkeypatch, copy_mode):
    state = make_state(width=100_000)
    cap = 8 << 20
    tg.save(tmp_path / "a", state, async_=True, max_staging_bytes=cap).result(timeout=60)
    at_a = tensors_of(state)
    train_step(state)
    monkeypatch.setattr(faults, "_passed", {})
    monkeypatch.setenv("TRAINGUARD_CRASH_AT", "write_piece")
    monkeypatch.setenv("TRAINGUARD_CRASH_SKIP", "2")  # fail inside the second batch's writes
    monkeypatch.setenv("TRAINGUARD_CRASH_KIND", "raise")
    h = tg.save(tmp_path / "b", state, async_=True, max_staging_bytes=cap)
    train_step(state)  # not blocked for good: staging stops when writing fails
    with pytest.raises(tg.CheckpointError, match="injected failure"):
        h.result(timeout=60)
    assert h.staged() and 1 <= h.staging_batches < 5
    assert not (tmp_path / "b" / "manifest.json").exists()
    assert not default_pool(cap).in_use and no_save_threads()
    assert_same(load_fresh(tmp_path / "a", width=100_000), at_a)


def test_staging_cap_bounds_rss_over_many_saves(tmp_path, copy_mode):
    torch.manual_seed(0)
    model = nn.Linear(3000, 3000)  # 36 MB of parameters, 108 MB with Adam's moments; tiny activations
    state = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-3)}

    def step() -> None:
        state["optim"].zero_grad()
        model(torch.randn(8, 3000)).square().mean().backward()
        state["optim"].step()

    step()
    protected = sum(p.nbytes for p in model.parameters()) * 3
    cap = 12 << 20
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    peak = 0
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True,
                              handle_signals=False, max_staging_bytes=cap) as mgr:
        for i in range(1, 7):
            step()
            h = mgr.save(i, state)
            mgr.wait()
            assert h.staged_background_bytes >= protected and h.staging_batches >= 9  # 108 MB / 12 MiB
            peak = max(peak, proc.memory_info().rss)
            if i == 1:
                allocations = default_pool(cap).allocations
    pool = default_pool(cap)
    assert pool.capacity <= cap and pool.allocations == allocations  # one buffer, reused by every save
    # Uncapped staging would add >= 108 MB; the cap, coalescing buffers and allocator slack stay below.
    assert peak - rss0 < cap + (48 << 20), f"RSS grew by {(peak - rss0) >> 20} MiB"
    assert mgr.latest_step() == 6


def test_write_batches_pieces_give_the_whole_chunks_checksums(tmp_path):
    from trainguard.io import DEFAULT_BLOCK, WriteChunk, tensor_bytes, write_batches, write_file
    from trainguard.storage import for_path

    data = torch.randint(0, 255, (3 * DEFAULT_BLOCK + 12345,), dtype=torch.uint8)
    small = torch.arange(100, dtype=torch.uint8)
    storage, root = for_path(tmp_path)
    size = data.numel() + 4096 + 100
    whole = write_file(storage, storage.join(root, "a"), [WriteChunk(tensor_bytes(data), 0),
                                                          WriteChunk(tensor_bytes(small), data.numel() + 4096)], size)
    buf = torch.empty(2 * DEFAULT_BLOCK, dtype=torch.uint8)  # one buffer reused for every batch

    def batches():
        for start in range(0, data.numel(), 2 * DEFAULT_BLOCK):
            n = min(2 * DEFAULT_BLOCK, data.numel() - start)
            buf[:n].copy_(data[start : start + n])
            yield [WriteChunk(tensor_bytes(buf[:n]), start)]
        yield [WriteChunk(tensor_bytes(small), data.numel() + 4096)]

    parts = write_batches(storage, storage.join(root, "b"), batches(), size)
    assert parts[0] + parts[1] == whole[0] and parts[2] == whole[1]
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_pool_rejects_bad_cap_and_double_acquire():
    with pytest.raises(ValueError, match="max_staging_bytes"):
        StagingPool(max_bytes=-1)
    pool = StagingPool(pin=False)
    a = pool.acquire([10, 100])
    assert [s.numel() for s in a] == [10, 100]
    with pytest.raises(tg.CheckpointError, match="in flight"):
        pool.acquire([1])
    pool.release()
    b = pool.acquire([100, 10])
    assert pool.allocations == 1 and b[0].data_ptr() == a[0].data_ptr()
    capped = StagingPool(max_bytes=10 << 20, pin=False)
    capped.acquire([3 << 20])
    block = 4 << 20
    assert capped.background_bytes(100 << 20, 8 << 20, block=block) == block  # 7 MiB left: one block
    assert capped.background_bytes(1000, 500, block=block) == 1000  # everything fits
    tiny = StagingPool(max_bytes=1000, pin=False)
    tiny.acquire([900])
    assert tiny.background_bytes(10 << 20, 6000, block=block) == 6000  # at least the largest chunk
    assert tiny.background_bytes(10 << 20, 8 << 20, block=block) == block  # ... or one block of it


def test_doc_example_runs(tmp_path):
    text = (ROOT / "docs" / "async.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3  # the manager example, the capped-staging one, stage_in_background
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for code in blocks:
            exec(compile(code, "docs/async.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert (tmp_path / "ckpts" / "async-demo").is_dir()
    assert (tmp_path / "ckpts" / "capped" / "manifest.json").is_file()
    assert (tmp_path / "ckpts" / "background" / "step-1" / "manifest.json").is_file()


def test_async_save_duration_is_when_it_finished_not_when_collected(tmp_path):
    state = {"x": {"w": torch.randn(1000)}, "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True) as mgr:
        h = mgr.save(1, state)
        h.result(timeout=60)
        finished = h.finished_at
        assert finished is not None
        mgr.wait()
    ev = [e for e in read_events(tmp_path) if e["event"] == "save"]
    assert len(ev) == 1 and ev[0]["duration_s"] == round(finished - mgr._pending_t0, 6)


def test_zero_copy_writes_protected_tensors_from_their_memory(tmp_path, monkeypatch):
    """CPU training on local files: parameters and Adam moments are written straight from the
    live tensors (no staging copy, no staging memory); step() after the write does not wait."""
    monkeypatch.setenv("TRAINGUARD_ASYNC_ZERO_COPY", "1")
    state = make_state(width=20_000)
    at_call = tensors_of(state)
    protected = sum(p.nbytes for p in state["model"].parameters()) * 3  # params + exp_avg + exp_avg_sq
    h = tg.save(tmp_path / "a", state, async_=True)
    assert h.wait_staged(60)
    assert h.written_live_bytes >= protected and h.staged_background_bytes == 0
    train_step(state)
    assert h.hook_wait_s == 0 and differs(tensors_of(state), at_call)
    h.result(timeout=60)
    assert_same(load_fresh(tmp_path / "a", width=20_000), at_call)


def test_zero_copy_step_during_the_write_copies_the_rest(tmp_path, monkeypatch):
    """step() comes while the live tensors are still being written: the save thread finishes the
    batch in flight, copies every chunk not yet written into the staging buffer, releases step()
    and writes the copies; the checkpoint holds the state at the call, not the stepped one."""
    from trainguard.storage import local

    monkeypatch.setenv("TRAINGUARD_ASYNC_ZERO_COPY", "1")
    monkeypatch.setattr(async_save, "ZERO_COPY_BATCH", 1 << 20)  # many batches
    state = make_state(width=20_000)  # fc1.weight and its moments: 1.3 MB each
    at_call = tensors_of(state)
    handles: list = []
    known = threading.Event()  # the save thread may reach its first write before save() returns
    real = local._LocalWriter.pwrite

    def held(self, data, offset):  # the first batch's writes wait until step() waits
        assert known.wait(60) and handles[0].waiting.wait(60)
        return real(self, data, offset)

    monkeypatch.setattr(local._LocalWriter, "pwrite", held)
    h = tg.save(tmp_path / "a", state, async_=True)
    handles.append(h)
    known.set()
    train_step(state)  # blocks in the pre-step hook until the rest is copied
    assert h.hook_wait_s > 0 and h.written_live_bytes > 0 and h.staged_background_bytes > 0
    assert differs(tensors_of(state), at_call)
    h.result(timeout=60)
    assert_same(load_fresh(tmp_path / "a", width=20_000), at_call)
    assert not default_pool().in_use and no_save_threads()
