"""Session 33's audit of resharding loads: optimizer state the live optimizer has no tensor for,
refused loads that changed the state, ``only=`` that differs between ranks.

Multi-rank cases run real gloo process groups on 127.0.0.1 (``dist_helper.run_ranks``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.errors import CheckpointError, StateMismatchError

from dist_helper import cpu_mesh, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "5"}


def _fsdp(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 2))  # 8 rows: uneven over 3 ranks
    mesh = cpu_mesh()
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _step(m: nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    m(torch.ones(4, 5)).sum().backward()
    o.step()


def _save_fsdp(rank: int, world: int, root: str) -> dict:
    """Adam and SGD with momentum, one step each, saved; returns their full state tensors."""
    m = _fsdp(0)
    adam = torch.optim.Adam(m[0].parameters(), lr=0.1, amsgrad=True)
    sgd = torch.optim.SGD(m[1].parameters(), lr=0.1, momentum=0.9)
    _step(m, adam)
    sgd.step()
    tg.save(f"{root}/step-000000001", {"model": m, "adam": adam, "sgd": sgd})
    full = {f"adam/{k}": v.full_tensor() for k, v in adam.state[m[0].weight].items() if k != "step"}
    full["sgd/momentum_buffer"] = sgd.state[m[1].weight]["momentum_buffer"].full_tensor()
    return full


def _load_fsdp(rank: int, world: int, root: str, saved: dict) -> str:
    """Loaded into optimizers that lack state: Adam's weight frozen at load (the bias stepped, so
    the optimizer has state for some parameters only) and built without amsgrad; SGD built
    without momentum. Each such tensor must come back as a DTensor shard like its parameter,
    with the saved values, and training must go on."""
    m = _fsdp(1)
    m[0].weight.requires_grad_(False)
    adam = torch.optim.Adam(m[0].parameters(), lr=0.1)
    sgd = torch.optim.SGD(m[1].parameters(), lr=0.1)
    _step(m, adam)  # state for m[0].bias only
    assert m[0].weight not in adam.state and m[0].bias in adam.state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hyperparameters come from the checkpoint; frozen since the save
        tg.load(f"{root}/step-000000001", {"model": m, "adam": adam, "sgd": sgd})
    a, s = adam.state[m[0].weight], sgd.state[m[1].weight]
    from torch.distributed.tensor import DTensor

    for name, t, param in (("adam/exp_avg", a["exp_avg"], m[0].weight), ("adam/exp_avg_sq", a["exp_avg_sq"], m[0].weight),
                           ("adam/max_exp_avg_sq", a["max_exp_avg_sq"], m[0].weight),
                           ("sgd/momentum_buffer", s["momentum_buffer"], m[1].weight)):
        assert isinstance(t, DTensor) and t.to_local().shape == param.to_local().shape, name
        assert torch.equal(t.full_tensor(), saved[name]), name
    m[0].weight.requires_grad_(True)  # the schedule unfreezes it
    _step(m, adam)
    sgd.step()
    return "ok"


def test_fsdp2_optimizer_state_without_a_live_tensor_is_loaded_as_shards(tmp_path):
    (saved, _) = [r.value for r in run_ranks(_save_fsdp, 2, str(tmp_path), timeout=120, env=ENV)]
    assert [r.value for r in run_ranks(_load_fsdp, 3, str(tmp_path), saved, timeout=120, env=ENV)] == ["ok"] * 3


def _refused(rank: int, world: int, root: str) -> list:
    """A strict load refused (an entry missing from the checkpoint) on a grown world: the fresh
    FSDP2 optimizer gets no state and the new rank's RNG is not re-seeded."""
    m = _fsdp(1)
    adam = torch.optim.Adam(m.parameters(), lr=0.1)
    if world == 2:
        _step(m, adam)
        tg.save(f"{root}/step-000000001", {"model": m, "optim": adam, "rng": tg.RNGState()})
        return []
    torch.manual_seed(100 + rank)
    before = torch.get_rng_state()
    with pytest.raises(StateMismatchError, match="extra"):
        tg.load(f"{root}/step-000000001", {"model": m, "optim": adam, "rng": tg.RNGState(), "extra": {"n": 1}})
    return [len(adam.state), torch.equal(before, torch.get_rng_state())]


def test_a_refused_load_leaves_optimizer_and_rng_as_they_were(tmp_path):
    run_ranks(_refused, 2, str(tmp_path), timeout=120, env=ENV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [r.value for r in run_ranks(_refused, 3, str(tmp_path), timeout=120, env=ENV)]
    assert out == [[0, True]] * 3


def test_strict_false_drops_the_optimizer_state_of_a_parameter_whose_shape_changed(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 3))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(2, 7)).sum().backward()
    o.step()
    tg.save(tmp_path / "ck", {"model": m, "optim": o})
    grown = nn.Sequential(nn.Linear(7, 14), nn.Linear(14, 3))  # the first layer grew, the second's input too
    o2 = torch.optim.Adam(grown.parameters(), lr=1e-2)
    with pytest.raises(StateMismatchError) as refused:
        tg.load(tmp_path / "ck", {"model": grown, "optim": o2})
    assert "optim/state/0.weight/exp_avg" in str(refused.value) and "'0.weight', whose shape is [14, 7]" in str(refused.value)
    assert not o2.state  # nothing loaded
    with pytest.warns(UserWarning, match="strict=False") as caught:
        tg.load(tmp_path / "ck", {"model": grown, "optim": o2}, strict=False)
    text = " ".join(str(w.message) for w in caught)
    assert "optim/state/0.weight/exp_avg_sq" in text and "optim/state/1.bias" not in text
    # The changed parameters start their state afresh; the unchanged one (1.bias) has the saved state.
    assert set(o2.state) == {grown[1].bias}
    assert torch.equal(o2.state[grown[1].bias]["exp_avg"], o.state[m[1].bias]["exp_avg"])
    grown(torch.randn(2, 7)).sum().backward()
    o2.step()  # failed on the old shape before
    assert o2.state[grown[0].weight]["exp_avg"].shape == (14, 7)


def _only(rank: int, world: int, root: str) -> list:
    torch.manual_seed(rank)
    m = nn.Linear(3, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    tg.save(f"{root}/ck", {"model": m, "optim": o})
    o2 = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="the ranks passed different only="):
        tg.load(f"{root}/ck", {"model": m, "optim": o2}, only=["model"] if rank == 0 else None)
    return [len(o2.state)]


def test_ranks_passing_different_only_all_raise_before_reading(tmp_path):
    assert [r.value for r in run_ranks(_only, 2, str(tmp_path), timeout=120, env=ENV)] == [[0], [0]]


def test_an_optimizer_without_its_model_in_the_state_says_so(tmp_path):
    m = nn.Linear(4, 3)
    o = torch.optim.Adam(m.parameters())
    tg.save(tmp_path / "ck", {"model": m, "optim": o})
    with pytest.raises(CheckpointError, match=r"the state holds no module to name this optimizer's parameters.*"
                                              r"\['weight', 'bias'\].*only=\['optim'\]"):
        tg.load(tmp_path / "ck", {"optim": torch.optim.Adam(nn.Linear(4, 3).parameters())}, strict=False)
    fresh = nn.Linear(4, 3)
    tg.load(tmp_path / "ck", {"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}, only=["optim"])


# ---- state kinds (helper audit 1): freed storage, destinations without memory of their own, RNGState mismatch


def _freed(n: int = 1024) -> torch.Tensor:
    t = torch.randn(n)
    t.untyped_storage().resize_(0)  # as FSDP1 does to unsharded parameters
    return t


@pytest.mark.parametrize("async_", [False, True])
def test_a_tensor_whose_memory_was_freed_is_refused_at_save_naming_it(tmp_path, async_):
    m = nn.Linear(4, 4)
    m.weight.data.untyped_storage().resize_(0)
    with pytest.raises(tg.UnsupportedValueError, match=r"model/weight: the tensor's memory was freed"):
        tg.save(tmp_path / "a", {"model": m}, async_=async_)  # sync: the heap's bytes were saved; async: a segfault
    with pytest.raises(tg.UnsupportedValueError, match=r"x/w: the tensor's memory was freed"):
        tg.save(tmp_path / "b", {"x": {"w": _freed()}}, async_=async_)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_destinations_without_dense_memory_of_their_own(tmp_path):
    """A plain entry's freed, sparse, nested or overlapping destination is replaced by the loaded
    tensor (it returned with nothing loaded, raised torch's words, or loaded overlapping values);
    a module's is refused, naming it and why."""
    x = torch.arange(9.0).reshape(3, 3)
    tg.save(tmp_path / "c", {"s": {"a": x, "b": x, "c": x, "d": x}, "top": x.reshape(-1)[:5]})
    dest = {"s": {"a": _freed(9).view(3, 3), "b": x.to_sparse(), "c": torch.zeros(5).unfold(0, 3, 1),
                  "d": torch.nested.nested_tensor([torch.zeros(3)] * 3)}, "top": _freed(5)}
    tg.load(tmp_path / "c", dest)
    assert all(torch.equal(dest["s"][k], x) for k in "abcd") and torch.equal(dest["top"], x.reshape(-1)[:5])

    class M(nn.Module):
        def __init__(self, w: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("w", w)

    tg.save(tmp_path / "m", {"model": M(torch.ones(3, 3))})
    for w, why in ((torch.zeros(5).unfold(0, 3, 1), "elements share memory"), (_freed(9).view(3, 3), "has no memory")):
        with pytest.raises(StateMismatchError, match=f"model/w \\(the state's tensor .*{why}"):
            tg.load(tmp_path / "m", {"model": M(w)})


def test_a_tensor_view_that_overlaps_is_not_taken_for_freed_memory():
    from trainguard.buffers import holds

    base = torch.zeros(5)
    assert holds(base.unfold(0, 3, 1)) and holds(base[1:].t()) and not holds(_freed())
    assert holds(torch.empty(0)) and holds(torch.zeros(3, 4).t())


def test_an_rng_entry_saved_from_a_dict_is_a_state_that_does_not_fit_not_corruption(tmp_path):
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": nn.Linear(2, 2), "rng": {"seed": 1234, "epoch": step}})
    with tg.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(CheckpointError, match=r"entry 'rng': the state's tg.RNGState\(\) meets .*\['epoch', 'seed'\]") as e:
            mgr.restore({"model": nn.Linear(2, 2), "rng": tg.RNGState()})
    assert e.value.permanent and not isinstance(e.value, tg.CorruptCheckpointError)  # before: every step "corrupt"


# ---- crash points and corruption (helper audit 3)


def test_a_symlink_loop_in_place_of_a_checkpoint_file_is_corruption(tmp_path):
    """Before: a bare OSError (ELOOP) from verify, and restore raised instead of taking step 1."""
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    for name in ("data-00000.bin", "manifest.json"):
        run = tmp_path / name
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1)) as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": torch.full((100,), float(step))})
        f = run / "step-000000002" / name
        f.unlink()
        f.symlink_to(name + ".x")
        (run / "step-000000002" / (name + ".x")).symlink_to(name)  # a -> a.x -> a
        assert CliRunner().invoke(cli, ["verify", str(run)]).exit_code == 1
        state = {"w": torch.zeros(100)}
        with tg.CheckpointManager(run) as mgr:
            assert mgr.restore(state) == 1 and state["w"][0] == 1


def test_a_file_system_out_of_inodes_is_a_disk_full_error(tmp_path):
    """ENOSPC creating the temp directory or a file (no inodes left) was a plain CheckpointError."""
    from test_reliability_diskfull import small_fs

    root = tmp_path / "fs"
    with small_fs(root, "20m,nr_inodes=3") as mounted:  # the root, the run directory, its lock: nothing more
        if not mounted:
            pytest.skip("cannot mount a tmpfs here")
        with tg.CheckpointManager(root / "run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2)) as mgr:
            with pytest.raises(tg.DiskFullError, match="out of space or of inodes"):
                mgr.save(1, {"w": torch.ones(10)})
        assert sorted(p.name for p in (root / "run").iterdir()) == [".lock"]


# ---- gradient-accumulation guard (helper audit 5)


def _accumulate(tmp_path, overflow_at: int, save_at: int) -> list:
    """Windows of 3 micro-batches under a GradScaler (zero_grad at each window's start), micro-batch
    ``overflow_at`` overflowing, one save at micro-batch ``save_at``: the PendingGradientsWarnings."""
    torch.manual_seed(0)
    m = nn.Linear(8, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    state = {"model": m, "optim": opt, "scaler": scaler}
    with warnings.catch_warnings(record=True) as caught, tg.CheckpointManager(tmp_path / f"run{overflow_at}-{save_at}",
                                                                              handle_signals=False) as mgr:
        warnings.simplefilter("always")
        assert mgr.restore(state) is None  # the recipe: restore first (the optimizer is watched from here)
        for k in range(6):
            if k % 3 == 0:
                opt.zero_grad()
            loss = m(torch.randn(2, 8)).sum() / 3
            scaler.scale(loss * (float("inf") if k == overflow_at else 1.0)).backward()
            if k % 3 == 2:
                scaler.step(opt)
                scaler.update()
            if k == save_at:
                mgr.save(k, state, force=True)
    return [w for w in caught if issubclass(w.category, tg.PendingGradientsWarning)]


def test_a_save_mid_window_after_an_overflowed_micro_batch_is_warned_a_skipped_step_is_not(tmp_path):
    assert len(_accumulate(tmp_path, overflow_at=3, save_at=4)) == 1  # mid-window: no warning before
    assert _accumulate(tmp_path, overflow_at=1, save_at=2) == []  # the window's step was skipped: its gradients used
    assert len(_accumulate(tmp_path, overflow_at=99, save_at=4)) == 1  # the plain mid-window case, as before


def test_a_pending_sparse_gradient_is_warned_about_not_a_crash(tmp_path):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        mgr.save(0, {"model": emb, "optim": opt}, force=True)  # watched from here: nothing pending
        opt.step()
        opt.zero_grad()
        emb(torch.tensor([3])).sum().backward()
        with pytest.warns(tg.PendingGradientsWarning):  # raised NotImplementedError (isfinite of a sparse tensor)
            mgr.save(1, {"model": emb, "optim": opt}, force=True)


# ---- destinations that share memory (helper audit 1)


def test_overlapping_destinations_are_filled_in_path_order(tmp_path):
    x, y = torch.arange(10.0), torch.full((6,), -1.0)
    tg.save(tmp_path / "c", {"s": {"a": x, "b": y, "c": x}})
    base = torch.zeros(10)
    tg.load(tmp_path / "c", {"s": {"a": base, "b": base[2:8], "c": base}})
    assert torch.equal(base, x)  # c last: before, b's staged copy landed after c was skipped: [0, 1, -1 x 6, 8, 9]


def test_an_untied_checkpoint_into_a_non_contiguous_tie_warns(tmp_path):
    class LM(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.wte, self.head = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
            if tie:
                self.wte.weight = nn.Parameter(torch.randn(4, 6).t())  # (6, 4), transposed: not read in place
                self.head.weight = self.wte.weight

    src = LM(tie=False)
    tg.save(tmp_path / "c", {"model": src})
    dst = LM(tie=True)
    with pytest.warns(UserWarning, match="tied weights"):
        tg.load(tmp_path / "c", {"model": dst})
    assert torch.equal(dst.wte.weight, src.wte.weight)  # the later name's (model/wte.weight) in path order


def test_errors_name_the_entry_and_the_destination(tmp_path):
    """An entry's state_dict() that raises, a class where its object was meant, a read-only
    destination (blamed on the checkpoint's file: "Bad address"), a float4 tensor cast by
    strict=False (no kernel: it failed after the reads)."""
    import numpy as np

    class Boom:
        def state_dict(self):
            raise ValueError("boom")

        def load_state_dict(self, sd):
            pass

    with pytest.raises(CheckpointError, match="entry 'counter': its state_dict\\(\\) raised ValueError: boom"):
        tg.save(tmp_path / "a", {"counter": Boom()})
    tg.save(tmp_path / "c", {"x": {"w": torch.arange(8.0)}})
    for call in (lambda: tg.save(tmp_path / "b", {"ema": nn.Linear}), lambda: tg.load(tmp_path / "c", {"ema": nn.Linear})):
        with pytest.raises(tg.UnsupportedValueError, match=r"ema: the state holds the class Linear, not an object of it"):
            call()
    (tmp_path / "w.bin").write_bytes(bytes(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: a non-writable array
        dest = torch.from_numpy(np.memmap(tmp_path / "w.bin", dtype=np.float32, mode="r"))
    with pytest.raises(CheckpointError, match="cannot be written: a tensor of the state on read-only memory"):
        tg.load(tmp_path / "c", {"x": {"w": dest}})

    class M(nn.Module):
        def __init__(self, scales: torch.Tensor) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scales", scales)

    saved = M(torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2))
    tg.save(tmp_path / "f", {"model": saved})
    into = M(torch.ones(4))
    with pytest.warns(UserWarning, match=r"model/scales \(checkpoint float4_e2m1fn_x2\[4\], state float32\[4\]\)"):
        tg.load(tmp_path / "f", {"model": into}, strict=False)  # raised NotImplementedError after the reads
    assert torch.equal(into.scales, torch.ones(4)) and torch.equal(into.lin.weight, saved.lin.weight)


def test_optimizer_state_shared_on_save_loads_as_one_tensor_per_parameter(tmp_path):
    """FSDP1 (use_orig_params=False) saves one flat step tensor for all its parameters: written as
    aliases. Loaded into a fresh optimizer it became one tensor, which Adam stepped once per
    parameter (steps 15 instead of 6 after 3 steps: the run diverged, silently)."""
    m = nn.Linear(3, 2)
    o = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    o.state[m.bias]["step"] = o.state[m.weight]["step"]  # shared, as FSDP1's flat parameter's step
    tg.save(tmp_path / "c", {"model": m, "optim": o})
    m2 = nn.Linear(3, 2)
    o2 = torch.optim.Adam(m2.parameters())
    tg.load(tmp_path / "c", {"model": m2, "optim": o2})
    w, b = o2.state[m2.weight]["step"], o2.state[m2.bias]["step"]
    assert w is not b and w.data_ptr() != b.data_ptr() and float(w) == float(b) == 1.0
    m2(torch.ones(1, 3)).sum().backward()
    o2.step()
    assert float(o2.state[m2.weight]["step"]) == float(o2.state[m2.bias]["step"]) == 2.0  # was 3.0


_FORKED_SAVE = r'''
import os, signal, sys, threading, torch, trainguard as tg
from trainguard import io as tgio
held, release = threading.Event(), threading.Event()
def holder():  # as a writer thread inside io._POOL.get/put at the moment of the fork
    with tgio._POOL._lock:
        held.set()
        release.wait()
threading.Thread(target=holder, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a hung save ends the child, not the test
    tg.save(sys.argv[1], {"q": tg.StateDict(**{f"t{i}": torch.randn(8) for i in range(50)})})  # small chunks: the pool
    os._exit(0)
release.set()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
'''


def test_a_child_forked_while_a_writer_held_the_buffer_pool_lock_can_save(tmp_path):
    from conftest import run_py

    r = run_py(["-c", _FORKED_SAVE, str(tmp_path / "ck")], timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr[-2000:])  # before: -14 (SIGALRM)
    assert (tmp_path / "ck" / "manifest.json").exists()


def test_a_plain_entry_on_shrunk_or_offset_freed_memory_is_replaced_on_load(tmp_path):
    """The plain-entry fast path checked a freed storage by its data pointer alone: a shrunk
    storage was read past its end (a segfault), a freed view at an offset raised "Bad address"."""
    x = torch.arange(1000.0)
    tg.save(tmp_path / "c", {"a": x, "b": x[:500]})
    shrunk = torch.zeros(1000)
    shrunk.untyped_storage().resize_(64)
    base = torch.zeros(600)
    view = base[100:]
    base.untyped_storage().resize_(0)
    dest = {"a": shrunk, "b": view}
    tg.load(tmp_path / "c", dest)
    assert torch.equal(dest["a"], x) and torch.equal(dest["b"], x[:500]) and dest["a"] is not shrunk


def test_the_wrapped_grad_scaler_step_keeps_its_name_and_takes_optimizers_without_weakrefs(tmp_path):
    class Slotted:  # an optimizer wrapper of __slots__ without __weakref__
        __slots__ = ("optimizer",)

        def __init__(self, opt):
            self.optimizer = opt

        def step(self, *a, **kw):
            return self.optimizer.step(*a, **kw)

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        @property
        def state(self):
            return self.optimizer.state

    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        mgr.restore({"model": m, "optim": opt})  # watches: GradScaler.step wrapped
    assert torch.amp.GradScaler.step.__name__ == "step" and torch.amp.GradScaler.step.__wrapped__
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    m(torch.ones(1, 2)).sum().backward()
    scaler.step(Slotted(opt))  # TypeError: cannot create weak reference, before
