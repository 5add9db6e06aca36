"""Session 46's hunt for a user's ordinary mistakes with the Python API (helper "misuse")."""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        sched.step()
    return model, optim, sched


def test_an_optimizers_or_schedulers_state_dict_copy_in_the_state_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    # `{"optim": optimizer.state_dict()}` (a torch.save habit) filled the copy and left the optimizer and the
    # scheduler at their start, without a word: a resume with Adam's moments and the lr schedule reset.
    model, optim, sched = _trained()
    tg.save(tmp_path / "ck", {"model": model, "optim": optim, "sched": sched})
    fresh = torch.nn.Linear(4, 2)
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fsched = torch.optim.lr_scheduler.StepLR(fopt, step_size=1, gamma=0.5)
    before = fresh.weight.detach().clone()
    with pytest.raises(tg.CheckpointError, match=r"entry 'optim'.*Adam optimizer.*\{'optim': optimizer\}"):
        tg.load(tmp_path / "ck", {"model": fresh, "optim": fopt.state_dict(), "sched": fsched})
    assert torch.equal(fresh.weight, before)  # refused before anything was read
    with pytest.raises(tg.CheckpointError, match=r"entry 'sched'.*StepLR scheduler.*\{'sched': scheduler\}"):
        tg.load(tmp_path / "ck", {"model": fresh, "optim": fopt, "sched": fsched.state_dict()}, strict=False)
    assert torch.equal(fresh.weight, before) and not fopt.state and fsched.last_epoch == 0
    # The objects themselves load; an empty dict still takes the saved values as plain data.
    tg.load(tmp_path / "ck", {"model": fresh, "optim": fopt, "sched": fsched})
    assert torch.equal(fopt.state[fresh.weight]["exp_avg"], optim.state[model.weight]["exp_avg"])
    assert (fsched.last_epoch, fopt.param_groups[0]["lr"]) == (3, optim.param_groups[0]["lr"])
    plain: dict = {"optim": {}, "sched": {}}
    tg.load(tmp_path / "ck", plain, only=["optim", "sched"])
    assert plain["sched"]["last_epoch"] == 3 and set(plain["optim"]["state"]) == {"weight", "bias"}
    # A state saved from the copies (index-keyed, no class) loads into copies as before.
    tg.save(tmp_path / "sd", {"optim": optim.state_dict(), "sched": sched.state_dict()})
    copies = {"optim": fopt.state_dict(), "sched": fsched.state_dict()}
    tg.load(tmp_path / "sd", copies)
    assert copies["sched"]["last_epoch"] == 3


def test_a_managers_restore_into_a_state_dict_copy_raises_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    model, optim, sched = _trained()
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1)) as mgr:
        mgr.save(3, {"model": model, "optim": optim, "sched": sched})
    fresh = torch.nn.Linear(4, 2)
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    with tg.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(tg.CheckpointError, match="optimizer.state_dict"):
            mgr.restore({"model": fresh.state_dict(), "optim": fopt.state_dict()})
        assert mgr.restore({"model": fresh, "optim": fopt, "sched": torch.optim.lr_scheduler.StepLR(fopt, 1, gamma=0.5)}) == 3
    assert torch.equal(fopt.state[fresh.weight]["exp_avg"], optim.state[model.weight]["exp_avg"])


def test_a_path_starting_with_a_tilde_is_refused_not_made_in_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    # "~/ckpts" is expanded by no one: tg.save and the manager made ./~/ckpts, silently, and a restart from
    # another working directory found no checkpoint there and started afresh.
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    state = {"model": torch.nn.Linear(2, 2)}
    with pytest.raises(tg.CheckpointError, match=r"expanduser\('~/ckpts/a'\)") as e:
        tg.save("~/ckpts/a", state)
    assert str(home / "ckpts" / "a") in str(e.value) and str(work / "~" / "ckpts" / "a") in str(e.value)
    with pytest.raises(tg.CheckpointError, match="does not expand"):
        tg.CheckpointManager("~/ckpts", save=tg.EveryNSteps(1), handle_signals=False)
    with pytest.raises(tg.CheckpointError, match="does not expand"):
        tg.load("~/ckpts/a", state)
    assert os.listdir(work) == [] and os.listdir(home) == []
    tg.save(os.path.expanduser("~/ckpts/a"), state)  # what the message says to pass
    tg.save("./~/b", state)  # and a directory really called '~'
    assert (home / "ckpts" / "a" / "manifest.json").is_file() and (work / "~" / "b" / "manifest.json").is_file()


def _epoch_warnings(count: Any, *, loader_drop_last: bool = False, restored_at: int = 0, world: int = 1) -> tuple[int, list[str]]:
    """One epoch through a DataLoader of batches of 8 over 100 samples, ``advance(count(x))`` after each
    batch, then ``next_epoch()``: the position at the epoch's end and the warnings."""
    ds = torch.utils.data.TensorDataset(torch.arange(100))
    sampler = tg.ResumableSampler(ds, seed=0, rank=0, world_size=world)
    sampler.position = restored_at
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler, drop_last=loader_drop_last)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for (x,) in loader:
            sampler.advance(count(x))
        position = sampler.position
        sampler.next_epoch()
    return position, [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def test_advance_counting_steps_or_a_dict_batchs_keys_is_warned_at_the_epochs_end() -> None:
    # advance(1) per step, advance(len(batch)) of a dict batch: the position ended the epoch at 13 (or 26) of
    # 100, silently, and a checkpoint mid-epoch kept a position short of what was trained on (its resume reads
    # those samples again).
    pos, msgs = _epoch_warnings(lambda x: 1)
    assert pos == 13 and len(msgs) == 1 and "counted 13 sample(s) in 13 call(s)" in msgs[0] and "not 1 per step" in msgs[0]
    pos, msgs = _epoch_warnings(lambda x: len({"input_ids": x, "labels": x}))
    assert pos == 26 and len(msgs) == 1 and "dict batch" in msgs[0]
    pos, msgs = _epoch_warnings(lambda x: 1, restored_at=40)  # from a restored position too
    assert pos == 48 and len(msgs) == 1 and "from 40 to 48" in msgs[0]
    # Counted right: nothing, also with the loader's partial last batch dropped (4 short of the end),
    # from a restored position, and on 2 ranks (each rank's own samples).
    assert _epoch_warnings(len) == (100, [])
    assert _epoch_warnings(len, loader_drop_last=True) == (96, [])
    assert _epoch_warnings(len, restored_at=40) == (100, [])
    assert _epoch_warnings(len, world=2) == (100, [])
    pos, msgs = _epoch_warnings(lambda x: len(x) // 2, world=2)
    assert pos == 50 and len(msgs) == 1
    # advance never called: the warning of before.
    pos, msgs = _epoch_warnings(lambda x: 0)
    assert pos == 0 and len(msgs) == 1 and "advance(n) was not called" in msgs[0]


def test_a_fresh_start_one_level_above_a_run_is_warned_about_naming_the_run(tmp_path: Path, caplog) -> None:
    # CheckpointManager("ckpts") for a run saved by CheckpointManager("ckpts/run1"): restore() found nothing
    # and started afresh without a word, beside the run it should have resumed.
    model = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(tmp_path / "ckpts" / "run1", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) is None
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model})
    (tmp_path / "ckpts" / "notes").mkdir()  # a directory of the user's: not a run
    caplog.set_level(logging.WARNING, logger="trainguard")
    with tg.CheckpointManager(tmp_path / "ckpts", handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) is None
    said = [r.getMessage() for r in caplog.records if "starts this run afresh" in r.getMessage()]
    assert len(said) == 1 and "'run1' (newest step 2)" in said[0], said
    assert f"CheckpointManager({str(tmp_path / 'ckpts' / 'run1')!r})" in said[0] and "notes" not in said[0]
    assert sorted(os.listdir(tmp_path / "ckpts" / "run1")) == [".lock", ".trainguard-run-id", "events.jsonl", "step-000000001", "step-000000002"]
    caplog.clear()  # a fresh start where no run lies below: nothing
    with tg.CheckpointManager(tmp_path / "other", handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) is None
    with tg.CheckpointManager(tmp_path / "ckpts" / "run1", handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) == 2
    assert not [r for r in caplog.records if "afresh" in r.getMessage()]


def test_a_restore_whose_newest_checkpoint_lacks_an_entry_names_the_older_one_that_holds_it(tmp_path: Path) -> None:
    # A last save of the weights alone: the restart's restore said "Pass strict=False", which starts the
    # optimizer afresh, and not that the checkpoint before held it.
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.Adam(model.parameters())
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(5), handle_signals=False) as mgr:
        mgr.restore({"model": model, "optim": optim})
        for step in range(1, 11):
            optim.zero_grad()
            model(torch.randn(2, 2)).sum().backward()
            optim.step()
            mgr.save(step, {"model": model, "optim": optim})
        mgr.save(11, {"model": model}, force=True)
    fresh = torch.nn.Linear(2, 2)
    fopt = torch.optim.Adam(fresh.parameters())
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        with pytest.raises(tg.StateMismatchError, match=r"step 10 holds optim.*mgr.restore\(state, step=10\)") as e:
            mgr.restore({"model": fresh, "optim": fopt})
        assert e.value.missing == ["optim"] and not fopt.state
        assert mgr.restore({"model": fresh, "optim": fopt}, step=10) == 10
    assert torch.equal(fopt.state[fresh.weight]["exp_avg"], optim.state[model.weight]["exp_avg"])


def test_a_samplers_or_seeded_datasets_seed_or_size_of_the_wrong_type_is_named() -> None:
    # seed=args.seed left None: int()'s "argument must be a string, a bytes-like object or a real number, not
    # 'NoneType'"; a float count: len()'s "object of type 'float' has no len()". Neither named the argument.
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    with pytest.raises(TypeError, match=r"ResumableSampler\(seed=None\): pass an int seed"):
        tg.ResumableSampler(ds, seed=None)
    with pytest.raises(TypeError, match=r"SeededDataset\(seed='x'\): pass an int seed"):
        tg.SeededDataset(ds, seed="x")
    for data in (10.0, None):
        with pytest.raises(TypeError, match=r"ResumableSampler\((10.0|None)\): pass the dataset .* or its number of samples"):
            tg.ResumableSampler(data, rank=0, world_size=1)
    import numpy as np

    assert tg.ResumableSampler(np.int64(10), seed=np.int64(3), rank=0, world_size=1).num_samples == 10
    assert tg.ResumableSampler(ds, seed=3, rank=0, world_size=1).order() == tg.ResumableSampler(10, seed=3).order()


def test_an_empty_only_is_refused_not_a_load_of_nothing(tmp_path: Path) -> None:
    # only=[k for k in state if k.startswith("modle")]: [] loaded nothing and returned the manifest as if done.
    model = torch.nn.Linear(2, 2)
    tg.save(tmp_path / "ck", {"model": model})
    fresh = torch.nn.Linear(2, 2)
    before = fresh.weight.detach().clone()
    for empty in ([], (), iter([])):
        with pytest.raises(tg.CheckpointError, match=r"only=\[\] names no entry.*only=None for all"):
            tg.load(tmp_path / "ck", {"model": fresh}, only=empty)
    assert torch.equal(fresh.weight, before)
    tg.load(tmp_path / "ck", {"model": fresh}, only=["model"])
    assert torch.equal(fresh.weight, model.weight)
    tg.load(tmp_path / "ck", {}, strict=False)  # an empty state without only= is no mistake of only=


_SCRIPT = """import torch
model = torch.nn.Linear(2, 2)
opt = torch.optim.AdamW(model.parameters())
noise = torch.Generator()
for step in range(10):
    x = torch.randn(2, 2, generator=noise)
    opt.step()
"""


def test_doctor_given_the_scripts_path_as_source_checks_the_script(tmp_path: Path, monkeypatch) -> None:
    # source="train.py" was parsed as a one-line program: the static checks found nothing in it (the
    # optimizer missing from the state, the loop's own generator), a silent all-clear.
    (tmp_path / "train.py").write_text(_SCRIPT)
    monkeypatch.chdir(tmp_path)
    state = {"model": torch.nn.Linear(2, 2)}

    def flagged(source: Any) -> set[str]:
        return {f.check for f in tg.doctor(state, source=source) if f.severity != "ok"}

    want = flagged(_SCRIPT)
    assert {"optimizer+scheduler", "own generators"} <= want
    assert flagged("train.py") == flagged(str(tmp_path / "train.py")) == want
    with pytest.raises(FileNotFoundError, match=r"source='nope.py': no such file"):
        tg.doctor(state, source="nope.py")
    with pytest.raises(TypeError, match=r"source=1: pass the training script's text or its path"):
        tg.doctor(state, source=1)  # type: ignore[arg-type]


def test_a_path_of_the_wrong_type_is_named_as_the_checkpoint_path(tmp_path: Path) -> None:
    # CheckpointManager(args.ckpt_dir) with the option unset: os.fspath's "expected str, bytes or os.PathLike
    # object, not NoneType" named no argument.
    for call in (lambda: tg.CheckpointManager(None), lambda: tg.save(None, {"t": torch.zeros(1)}),  # type: ignore[arg-type]
                 lambda: tg.load(None, {}), lambda: tg.verify(3)):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"checkpoint path (None|3): pass a directory path"):
            call()
    assert tg.save(os.fsencode(tmp_path / "b"), {"t": torch.zeros(1)}).step == 0  # bytes paths still work


class _SaveOnly:
    def state_dict(self) -> dict:
        return {"x": 1}


class _LoadOnly:
    def load_state_dict(self, sd: dict) -> None:
        pass


def test_an_object_with_half_of_the_state_dict_protocol_is_told_what_it_lacks(tmp_path: Path) -> None:
    # An object with state_dict() and no load_state_dict() was told to "wrap other objects in a class with
    # state_dict()/load_state_dict()": it has one of them, and the message did not say which is missing.
    with pytest.raises(tg.UnsupportedValueError, match=r"it has state_dict\(\) but no load_state_dict\(\) method"):
        tg.save(tmp_path / "a", {"counter": _SaveOnly()})
    with pytest.raises(tg.UnsupportedValueError, match=r"it has load_state_dict\(\) but no state_dict\(\) method"):
        tg.save(tmp_path / "b", {"counter": _LoadOnly()})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_generator_the_checkpoint_holds_and_the_rngstate_does_not_name_is_warned_about(tmp_path: Path) -> None:
    # A resume script that builds tg.RNGState() without the loop's generator: the checkpoint's state of it was
    # left out without a word, and the resumed run drew from it as after a fresh start.
    noise = torch.Generator().manual_seed(5)
    torch.randn(3, generator=noise)
    tg.save(tmp_path / "ck", {"rng": tg.RNGState(generators={"noise": noise})})
    with pytest.warns(UserWarning, match=r"generator\(s\) \['noise'\], which this RNGState does not name") as seen:
        tg.load(tmp_path / "ck", {"rng": tg.RNGState()})
    assert [w.filename for w in seen if "does not name" in str(w.message)] == [__file__]  # the caller's line
    again = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.load(tmp_path / "ck", {"rng": tg.RNGState(generators={"noise": again})})
    assert torch.equal(torch.randn(3, generator=again), torch.randn(3, generator=noise))
    with pytest.warns(UserWarning, match=r"holds no state for generator\(s\) \['added'\]") as seen:  # strict=False's
        tg.load(tmp_path / "ck", {"rng": tg.RNGState(generators={"noise": again, "added": torch.Generator()})}, strict=False)
    assert {w.filename for w in seen if "holds no state" in str(w.message)} == {__file__}  # dist.py's wrapper before


def test_a_modules_entry_loaded_into_a_state_dict_copy_that_cannot_take_it_in_place_is_refused(tmp_path: Path) -> None:
    # {"model": model.state_dict()} loads in place when its tensors fit (they are the module's); a bf16 model's or
    # one of another shape had its tensors replaced in the copy, and the module kept its values (a meta model's is a
    # template for load_state_dict(assign=True): tests/test_hunt46_review46b.py).
    model = torch.nn.Linear(2, 2)
    tg.save(tmp_path / "ck", {"model": model})
    for other, what in ((torch.nn.Linear(2, 2).to(torch.bfloat16), r"bfloat16\[2, 2\]"),
                        (torch.nn.Linear(3, 2), r"float32\[2, 3\]")):
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(tg.CheckpointError, match=rf"entry 'model': the checkpoint holds a module's state.*{what}"
                                                     r".*\{'model': model\}.*\{'model': \{\}\}"):
            tg.load(tmp_path / "ck", {"model": other.state_dict()}, strict=False)
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    same = torch.nn.Linear(2, 2)  # a copy whose tensors fit: loaded in place, as before
    tg.load(tmp_path / "ck", {"model": same.state_dict()})
    assert torch.equal(same.weight, model.weight)
    plain: dict = {"model": {}}
    tg.load(tmp_path / "ck", plain)
    assert torch.equal(plain["model"]["weight"], model.weight)


def test_a_stateful_save_policy_shared_by_two_open_managers_is_refused(tmp_path: Path) -> None:
    # save=pol for a model's and an EMA's manager: one clock, and the second manager, asked after the first had
    # saved, never saved (its run directory held no checkpoint after 29 steps of EverySeconds(0.05)).
    model = torch.nn.Linear(2, 2)
    every = tg.EverySeconds(1800)
    with tg.CheckpointManager(tmp_path / "a", save=every, handle_signals=False) as first:
        with pytest.raises(ValueError, match=r"save=EverySeconds\(1800\) is already the save policy of the open "
                                             rf"CheckpointManager of {re.escape(str(tmp_path / 'a'))}.*its own"):
            tg.CheckpointManager(tmp_path / "b", save=every, handle_signals=False)
        daly = tg.DalyInterval(node_mtbf_s=3600.0)
        with tg.CheckpointManager(tmp_path / "c", save=daly, handle_signals=False):
            with pytest.raises(ValueError, match="already the save policy"):
                tg.CheckpointManager(tmp_path / "d", save=daly, handle_signals=False)
        steps = tg.EveryNSteps(2)  # no state of its own: shared as before
        with tg.CheckpointManager(tmp_path / "e", save=steps, handle_signals=False) as e, \
                tg.CheckpointManager(tmp_path / "f", save=steps, handle_signals=False) as f:
            e.save(2, {"model": model})
            f.save(2, {"model": model})
        assert first.latest_step() is None and e.latest_step() == f.latest_step() == 2
    with tg.CheckpointManager(tmp_path / "b", save=every, handle_signals=False):  # the first one closed: reused
        pass
    assert not (tmp_path / "b" / "step-000000001").exists()
