"""Found by an adversarial read of save/load (session 31): a user's child module named like a
torch wrapper's, saving through a symbolic link, and keys added to a progress dict since the save."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.consolidate import consolidate

from dist_helper import attempt, run_ranks


class _Top(nn.Module):  # a child named like torch.compile's, next to the parent's own parameter
    def __init__(self) -> None:
        super().__init__()
        self._orig_mod = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.randn(2))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._orig_mod = nn.Linear(2, 2, bias=False)
        self.weight = nn.Parameter(torch.randn(2, 2))


@pytest.mark.parametrize("model,where", [(_Top, "'_orig_mod'"), (lambda: nn.Sequential(_Block()), "'0._orig_mod'")])
def test_a_child_named_like_a_wrapper_is_refused_not_dropped(tmp_path, model, where):
    m = model()
    opt = torch.optim.Adam(m.parameters())
    with pytest.raises(tg.UnsupportedValueError, match=f"child named '_orig_mod' \\({where}\\).*Rename the child"):
        tg.save(tmp_path / "c", {"model": m, "optim": opt})
    assert not (tmp_path / "c").exists()


def test_compiled_and_checkpoint_wrapped_models_still_save_under_plain_names(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    m = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 3)), nn.Linear(3, 1))
    tg.save(tmp_path / "c", {"model": torch.compile(m)})
    plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    assert not torch.equal(plain[0].weight, m[0]._checkpoint_wrapped_module.weight)
    tg.load(tmp_path / "c", {"model": plain})
    assert torch.equal(plain[0].weight, m[0]._checkpoint_wrapped_module.weight)
    assert torch.equal(plain[1].bias, m[1].bias)


def test_a_save_through_a_symbolic_link_writes_where_it_points(tmp_path):
    (tmp_path / "big" / "latest").mkdir(parents=True)
    os.symlink(tmp_path / "big" / "latest", tmp_path / "latest")
    tg.save(tmp_path / "latest", {"t": torch.ones(3)})
    assert os.path.islink(tmp_path / "latest")
    got = {"t": torch.zeros(3)}
    tg.load(tmp_path / "big" / "latest", got)
    assert torch.equal(got["t"], torch.ones(3))
    # overwrite through the link: the directory it points to holds the new values
    tg.save(tmp_path / "latest", {"t": torch.full((3,), 7.0)}, overwrite=True)
    assert os.path.islink(tmp_path / "latest")
    tg.load(tmp_path / "big" / "latest", got)
    assert torch.equal(got["t"], torch.full((3,), 7.0))
    # a link to a directory that does not exist yet: created there
    os.symlink(tmp_path / "big" / "later", tmp_path / "later")
    tg.save(tmp_path / "later", {"t": torch.ones(1)})
    assert os.path.islink(tmp_path / "later") and (tmp_path / "big" / "later" / "manifest.json").exists()


def test_a_key_added_to_a_progress_dict_since_the_save(tmp_path):
    tg.save(tmp_path / "c", {"progress": tg.StateDict(step=100), "ema": {"w": torch.ones(2), "cfg": {"decay": 0.9}}})
    prog = tg.StateDict(step=0, tokens_seen=5)
    ema = {"w": torch.zeros(2), "b": torch.full((2,), 3.0), "cfg": {"decay": 0.5, "warmup": 10}}
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(tmp_path / "c", {"progress": prog, "ema": ema})
    assert set(e.value.missing) == {"progress/tokens_seen", "ema/b", "ema/cfg/warmup"}
    assert dict(prog) == {"step": 0, "tokens_seen": 5} and torch.equal(ema["w"], torch.zeros(2))  # nothing loaded
    state = {"progress": prog, "ema": ema}
    tg.load(tmp_path / "c", state, strict=False)
    assert dict(prog) == {"step": 100, "tokens_seen": 5}
    assert torch.equal(state["ema"]["w"], torch.ones(2)) and torch.equal(state["ema"]["b"], torch.full((2,), 3.0))
    assert state["ema"]["cfg"] == {"decay": 0.9, "warmup": 10}


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
    return model, opt


def test_an_entry_that_is_part_of_another_loads_its_optimizer_in_any_order(tmp_path):
    model, opt = _trained()
    tg.save(tmp_path / "c", {"model": model, "head": model[1], "optim": opt})
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    tg.load(tmp_path / "c", {"head": m2[1], "model": m2, "optim": o2})  # the same entries, in another order
    for p, q in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], o2.state[q]["exp_avg"])


def test_two_parameters_with_one_name_are_named_in_the_error(tmp_path):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.param = nn.ParameterList([nn.Parameter(torch.randn(2))])

    m, outside = M(), nn.Parameter(torch.randn(2))  # the outside one is named param.0 too
    with pytest.warns(UserWarning, match="belong to no nn.Module"), pytest.raises(
            tg.CheckpointError, match=r"two different optimizer parameters get the same name \['param.0'\]"):
        tg.save(tmp_path / "a", {"model": m, "optim": torch.optim.Adam([outside, *m.parameters()])})
    m1, m2 = nn.Sequential(), nn.Linear(2, 2)
    m1.enc = nn.Linear(2, 2)
    with pytest.raises(tg.CheckpointError, match=r"same name \['model.enc.bias', 'model.enc.weight'\].*entry key with a '.'"):
        tg.save(tmp_path / "b", {"model": m1, "model.enc": m2, "optim": torch.optim.Adam([*m1.parameters(), *m2.parameters()])})


def test_a_name_too_long_for_the_temporary_directory_is_refused_first(tmp_path):
    with pytest.raises(ValueError, match="is 240 bytes.*at most 234 bytes"):
        tg.save(tmp_path / ("x" * 240), {"t": torch.ones(1)})
    assert os.listdir(tmp_path) == []
    tg.save(tmp_path / ("x" * 234), {"t": torch.ones(1)})


def test_a_json_value_where_the_state_holds_a_tensor_is_named_as_such(tmp_path):
    tg.save(tmp_path / "c", {"step": 3})
    with pytest.raises(tg.StateMismatchError, match=r"step \(the state holds one tensor, the checkpoint a JSON value \(int\)\)"):
        tg.load(tmp_path / "c", {"step": torch.tensor(0)})


def _steps(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit())


def test_a_step_directory_renamed_by_hand_is_not_restored_as_its_new_step(tmp_path):
    run = tmp_path / "run"
    state = {"w": torch.zeros(3), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
        for step in (1, 2):
            state["w"].fill_(step)
            state["progress"]["step"] = step
            mgr.save(step, state)
    os.rename(run / "step-000000002", run / "step-000000003")
    with pytest.raises(tg.CorruptCheckpointError, match="named step 3 but holds the checkpoint of step 2.*step-000000002"):
        tg.load(run / "step-000000003", {"w": torch.zeros(3), "progress": tg.StateDict(step=0)})
    fresh = {"w": torch.zeros(3), "progress": tg.StateDict(step=0)}
    with tg.CheckpointManager(run, handle_signals=False) as mgr:
        assert mgr.restore(fresh) == 1  # not 3 with step 2's values
    assert fresh["progress"]["step"] == 1 and torch.equal(fresh["w"], torch.ones(3))
    with pytest.raises(tg.CheckpointError, match="named step 9, and .* is the checkpoint of step 1"):
        consolidate(run / "step-000000001", tmp_path / "other" / "step-000000009")
    assert not (tmp_path / "other" / "step-000000009").exists()


@pytest.mark.parametrize("keep,losses,left", [
    (lambda: tg.KeepBest("loss"), [3.0, 2.0, 1.0], [2, 3]),  # the newest is the best: the one before stays too
    (lambda: tg.KeepBest("loss"), [1.0, 2.0, 3.0], [1, 3]),  # the best is older: it is the one before
    (lambda: tg.KeepEvery(3), [1.0, 1.0, 1.0], [2, 3]),
])
def test_retention_always_keeps_a_checkpoint_before_the_newest(tmp_path, keep, losses, left):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=keep(), handle_signals=False) as mgr:
        for step, loss in enumerate(losses, 1):
            mgr.save(step, {"w": torch.full((2,), float(step))}, metrics={"loss": loss})
    assert _steps(tmp_path) == left


def test_a_file_named_like_a_step_is_named_not_removed(tmp_path):
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    (tmp_path / "step-000000004").write_text("an operator's note")
    with pytest.warns(UserWarning, match="step-000000004 is a file, not a checkpoint directory"):
        with tg.CheckpointManager(tmp_path, handle_signals=False):
            pass
    assert (tmp_path / "step-000000004").read_text() == "an operator's note"


def _load_another_step_per_rank(rank, world, root, via):
    state = {"w": torch.zeros(3), "progress": tg.StateDict(step=-1)}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False, timeout=30) as mgr:
        for step in (1, 2):
            state["w"].fill_(step)
            state["progress"]["step"] = step
            mgr.save(step, state)
        state["w"].zero_()
        state["progress"]["step"] = -1
        if via == "load":
            out = attempt(lambda: tg.load(f"{root}/step-00000000{1 + rank}", state, timeout=30))
        else:
            out = attempt(lambda: mgr.restore(state, step=1 + rank))
    return out, state["w"].tolist(), state["progress"]["step"]


@pytest.mark.parametrize("via", ["load", "restore"])
def test_ranks_that_read_different_checkpoints_all_raise_before_reading(tmp_path, via):
    res = run_ranks(_load_another_step_per_rank, 2, str(tmp_path), via, timeout=90)
    for r in res:
        out, w, step = r.value
        assert out["type"] == "CheckpointError", out
        assert "ranks read different checkpoints (rank 0: step 1 saved at" in out["msg"] and "rank 1: step 2" in out["msg"]
        assert w == [0.0, 0.0, 0.0] and step == -1  # nothing was read into the state


@pytest.mark.parametrize("steps", [(5, 3), (10, 20, 10)])
def test_a_save_behind_this_managers_newest_step_is_refused(tmp_path, steps):
    state = {"w": torch.zeros(2)}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5), handle_signals=False) as mgr:
        assert mgr.restore(state) is None
        for step in steps[:-1]:
            state["w"].fill_(step)
            mgr.save(step, state)
        before = _steps(tmp_path)
        state["w"].fill_(-1.0)
        with pytest.raises(tg.CheckpointError, match=f"save\\(step={steps[-1]}\\): this manager saved step {max(steps)} already.*must grow"):
            mgr.save(steps[-1], state)
    assert _steps(tmp_path) == before
    with tg.CheckpointManager(tmp_path, handle_signals=False) as mgr:
        assert mgr.restore(state) == max(steps) and state["w"][0].item() == max(steps)


def test_load_refuses_a_flag_that_is_not_a_bool_and_takes_a_bytes_path(tmp_path):
    tg.save(os.fsencode(tmp_path / "c"), {"t": torch.ones(2)})
    got = {"t": torch.zeros(2)}
    for bad in ({"strict": "no"}, {"verify": "no"}):
        with pytest.raises(TypeError, match="pass True or False"):
            tg.load(tmp_path / "c", got, **bad)
    tg.load(os.fsencode(tmp_path / "c"), got, strict=False)
    assert torch.equal(got["t"], torch.ones(2))


HUNG_UPLOAD = r"""
import sys, threading
import fsspec, torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
import trainguard as tg

HANG = threading.Event()


class HangFile(MemoryFile):
    def write(self, data):
        if HANG.is_set():
            threading.Event().wait()  # an upload that never returns
        return super().write(data)


class HangFS(MemoryFileSystem):
    protocol = ("hangmem",)
    store = {}
    pseudo_dirs = [""]

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        if "w" in mode:
            f.__class__ = HangFile
        return f


fsspec.register_implementation("hangmem", HangFS, clobber=True)
state = {"w": torch.ones(1000)}
mgr = tg.CheckpointManager("hangmem://b/run", save=tg.EveryNSteps(1), async_save=True, timeout=3.0, handle_signals=False)
mgr.open()
mgr.save(1, state)
mgr.wait()
HANG.set()
mgr.save(2, state)
try:
    mgr.close()
except tg.CheckpointError as e:
    print("RAISED", type(e).__name__, flush=True)
    print([t.name for t in threading.enumerate()], flush=True)
    sys.exit(3)
"""


def test_a_process_exits_with_an_object_store_upload_stuck(tmp_path):
    # Before: the upload ran on a ThreadPoolExecutor's worker, which Python joins at exit: after
    # StuckWriteError the interpreter never exited (here: the subprocess timeout).
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", HUNG_UPLOAD], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 3, p.stderr[-3000:]
    assert "RAISED StuckWriteError" in p.stdout and "trainguard-upload_0" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_max_staging_bytes_that_is_not_a_byte_count_is_named(tmp_path):
    for bad in ("10", 1.5e6, True):
        with pytest.raises(TypeError, match=r"max_staging_bytes=.*pass a byte count \(an int >= 0\)"):
            tg.CheckpointManager(tmp_path / "m", async_save=True, max_staging_bytes=bad, handle_signals=False)
    with pytest.raises(TypeError, match="pass a byte count"):
        tg.save(tmp_path / "c", {"t": torch.ones(4)}, async_=True, max_staging_bytes="10")
    tg.save(tmp_path / "c", {"t": torch.ones(4)}, async_=True, max_staging_bytes=10).result()  # an int: fine


def test_an_object_store_checkpoint_that_exists_does_not_suggest_overwrite():
    url = f"memory://audit31-{os.getpid()}/c"
    tg.save(url, {"t": torch.ones(2)})
    with pytest.raises(tg.StepExistsError, match="save to a new directory") as e:
        tg.save(url, {"t": torch.ones(2)})
    assert "overwrite=True" not in str(e.value)


def test_verify_names_a_stray_file_named_like_a_step(tmp_path):
    import subprocess
    import sys

    tg.save(tmp_path / "step-000000001", {"w": torch.ones(2)})
    (tmp_path / "step-000000004").write_text("an operator's note")
    p = subprocess.run([sys.executable, "-m", "trainguard.cli", "verify", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert "a file, not a checkpoint directory" in p.stdout and "removes it when it next opens" not in p.stdout, p.stdout + p.stderr
