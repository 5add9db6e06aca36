"""Hunt 44, "review44": defects found reviewing the day's changes (export/convert to ``.pt`` of
the entry as saved, bare-tensor imports, the RAM tier's medium check, doctor's interval inputs)
and misusing the public API."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import trainguard as tg
from test_hunt43_hostilefs import _tmpfs
from trainguard.convert import convert
from trainguard.export import export


class _Counted(nn.Module):
    """A module with an int extra state (a ``.pt`` of its state_dict has a non-tensor value)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.k = 0

    def get_extra_state(self) -> Any:
        return {"k": self.k, "seen": torch.full((2,), float(self.k))}

    def set_extra_state(self, state: Any) -> None:
        self.k = state["k"]


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(_Counted(), nn.Linear(3, 2))


def _entries(d: Path) -> list[str]:
    from trainguard.commit import read_manifest
    from trainguard.storage import for_path

    storage, directory = for_path(d)
    return sorted(read_manifest(storage, directory).objects)


def test_a_pt_export_of_a_module_with_extra_state_imports_back_as_one_entry(tmp_path: Path) -> None:
    """``export`` to ``.pt`` now writes a module's extra state as its value (not only tensors), so the
    file's dict is not all tensors; ``convert`` back made each key an entry of its own
    (``0.lin.weight``, ``0._extra_state``, ...), which ``{"model": module}`` could not load."""
    src = _model(0)
    src[0].k = 7
    tg.save(tmp_path / "c", {"model": src})
    export(tmp_path / "c", tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "back")
    assert _entries(tmp_path / "back") == ["model"]
    dst = _model(1)
    assert dst[0].k != 7 and not torch.equal(dst[1].weight, src[1].weight)
    tg.load(tmp_path / "back", {"model": dst})
    assert dst[0].k == 7
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    # A user's own torch.save(model.state_dict()) of such a model: one entry too.
    torch.save(src.state_dict(), tmp_path / "own.pt")
    convert(tmp_path / "own.pt", tmp_path / "own")
    assert _entries(tmp_path / "own") == ["model"]
    # ... and of a wrapped one (DDP: every key "module."): the prefix goes, as for a model without extra state.
    wrapper = nn.Module()
    wrapper.module = src
    torch.save(wrapper.state_dict(), tmp_path / "ddp.pt")
    convert(tmp_path / "ddp.pt", tmp_path / "ddp")
    assert _entries(tmp_path / "ddp") == ["model"]
    dst = _model(2)
    tg.load(tmp_path / "ddp", {"model": dst})
    assert dst[0].k == 7 and torch.equal(dst[1].weight, src[1].weight)


def test_a_pt_export_of_an_optimizer_entry_imports_back_as_that_entry(tmp_path: Path) -> None:
    """An optimizer entry exported to ``.pt`` is ``{"state", "param_groups"}``: imported as two entries
    named ``state`` and ``param_groups`` before; now as the entry ``--entry`` names, which loads."""
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0123)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tg.save(tmp_path / "c", {"model": model, "optim": opt})
    export(tmp_path / "c", tmp_path / "o.pt", entry="optim")
    convert(tmp_path / "o.pt", tmp_path / "back", entry="optim")
    assert _entries(tmp_path / "back") == ["optim"]
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    tg.load(tmp_path / "back", {"model": model, "optim": opt2}, only=["optim"])
    assert opt2.param_groups[0]["lr"] == 0.0123
    assert torch.equal(opt2.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_a_tmpfs_whose_mount_point_has_a_space_and_an_accent_is_taken_for_a_tmpfs(tmp_path: Path) -> None:
    """``/proc/self/mountinfo`` writes a space as ``\\040`` and an accent as its UTF-8 bytes; the
    parser decoded the line with ``unicode_escape``, which reads those bytes as Latin-1: the mount
    point "données x" became "donnÃ©es x", matched nothing, and a path on that tmpfs took its
    parent's filesystem. The RAM tier there warned "is on ext4, not tmpfs", and doctor said a run
    directory there was fine ("is on ext4") instead of the error for a tmpfs."""
    from trainguard.doctor import Settings, filesystem_of, parse_mountinfo
    from trainguard.doctor_storage import storage_check

    with _tmpfs(tmp_path / "données x", "16m") as base:
        mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text(encoding="utf-8"))
        assert filesystem_of(str(base / "run"), mounts) == "tmpfs"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), ram_tier=str(base),
                                      handle_signals=False) as mgr:
                mgr.save(1, {"progress": tg.StateDict(step=1)})
        assert [str(w.message) for w in seen if str(w.message).startswith("ram_tier: ")] == []
        assert (tmp_path / "run" / "step-000000001" / "manifest.json").exists()
        finding = storage_check([], Settings(root=str(base / "ckpts")))
        assert finding is not None and finding.severity == "error" and "tmpfs" in finding.message, finding
        # The doctor read mountinfo in the locale's codec: under LANG=C (no UTF-8 coercion) a
        # traceback, UnicodeDecodeError, for a mount point named with an accent anywhere on the machine.
        script = tmp_path / "train.py"
        script.write_text("import trainguard as tg\n\ndef trainguard_state():\n"
                          f"    return {{'p': tg.StateDict(step=0)}}, {{'root': {str(tmp_path / 'r')!r}}}\n")
        env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        res = subprocess.run([sys.executable, "-m", "trainguard", "doctor", "--json", str(script)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert "UnicodeDecodeError" not in res.stderr and res.returncode in (0, 1), res.stderr[-2000:]


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kwargs", [
    {"overwrite": "no"}, {"overwrite": "False"}, {"async_": "no"}, {"split_state": "no"},
    {"overwrite": None}, {"max_staging_bytes": "1G"},
])
def test_save_refuses_a_flag_that_is_not_a_bool_before_touching_the_checkpoint(tmp_path: Path, kwargs: dict) -> None:
    """A string is truthy: ``tg.save(path, state, overwrite="no")`` (a value read from a config or an
    environment variable) replaced the checkpoint at ``path``; ``async_="no"`` returned a handle, not
    the manifest. Now a TypeError naming the argument, before anything is written."""
    model = nn.Linear(2, 2)
    tg.save(tmp_path / "c", {"model": model})
    before = _files(tmp_path / "c")
    with pytest.raises(TypeError, match=f"{next(iter(kwargs))}=.*pass (True or False|a byte count)"):
        tg.save(tmp_path / "c", {"model": nn.Linear(2, 2)}, **kwargs)
    assert _files(tmp_path / "c") == before
    with pytest.raises(TypeError):
        tg.save(tmp_path / "new", {"model": model}, **kwargs)
    assert not (tmp_path / "new").exists()
    tg.save(tmp_path / "c", {"model": model}, overwrite=1)  # 0 and 1 are taken, as by tg.load's strict


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"async_save": "no"}, TypeError), ({"handle_signals": "no"}, TypeError), ({"split_state": "no"}, TypeError),
    ({"ram_tier": 1}, TypeError), ({"ram_tier": 2.5}, TypeError),
])
def test_manager_refuses_a_flag_that_is_not_a_bool_at_construction(tmp_path: Path, kwargs: dict, error: type) -> None:
    """``async_save="no"`` made the saves asynchronous, ``split_state="no"`` split them and
    ``ram_tier=1`` failed in ``os.fspath`` ("expected str, bytes or os.PathLike object, not int"):
    now each is refused at construction, naming the argument and what to pass, and nothing is
    created (``ram_tier=None`` and ``""``, an unset variable, are off as before)."""
    with pytest.raises(error, match=f"{next(iter(kwargs))}=.*pass True"):
        tg.CheckpointManager(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()
    for off in (None, ""):
        assert tg.CheckpointManager(tmp_path / "run", ram_tier=off).ram is None


def test_doctor_refuses_manager_settings_that_the_manager_refuses(tmp_path: Path) -> None:
    """``trainguard doctor`` on a script whose hook returns the manager's settings as a dict checked
    them with ``bool(...)``: ``async_save="no"`` passed as if fine, though the manager refuses it."""
    from click.testing import CliRunner

    from trainguard.commands.plan import doctor_cmd

    script = tmp_path / "train.py"
    script.write_text("import trainguard as tg\n\ndef trainguard_state():\n"
                      f"    return {{}}, {{'root': {str(tmp_path / 'r')!r}, 'async_save': 'no'}}\n")
    res = CliRunner().invoke(doctor_cmd, [str(script)])
    assert res.exit_code == 2 and "async_save='no'" in res.output and "True or False" in res.output, res.output


def test_a_file_given_for_a_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    """``tg.load("ck/manifest.json", state)`` said "not a committed checkpoint (no manifest.json); it may
    be a save that crashed or is still running": now that it is a file of the checkpoint ``ck``, and
    to pass that directory (``tg.verify`` the same); a lone file is named a file, not a save."""
    model = nn.Linear(2, 2)
    tg.save(tmp_path / "ck", {"model": model})
    for name in ("manifest.json", "data-00000.bin"):
        with pytest.raises(tg.NotACheckpointError, match=f"is a file of the checkpoint {tmp_path / 'ck'}: pass"):
            tg.load(tmp_path / "ck" / name, {"model": model})
        res = tg.verify(tmp_path / "ck" / name)
        assert not res.ok and "is a file of the checkpoint" in res.errors[0], res
    torch.save(model.state_dict(), tmp_path / "w.pt")
    with pytest.raises(tg.NotACheckpointError, match="is a file, not a checkpoint directory.*trainguard convert"):
        tg.load(tmp_path / "w.pt", {"model": model})


def test_the_ram_tier_medium_warning_made_an_error_does_not_say_to_remove_a_directory(tmp_path: Path) -> None:
    """Under ``-W error`` (pytest's ``filterwarnings = error``), the new "not tmpfs" warning of a RAM tier
    on a disk was raised as "rank 0 could not prepare DIR: UserWarning: ... Remove that directory by
    hand if it holds no copy you need": nothing failed to be prepared, and removing it fixes nothing.
    Now the warning's own text, said to be a warning made an error."""
    from trainguard.doctor import filesystem_of, parse_mountinfo

    base = tmp_path / "disk"
    base.mkdir()
    if filesystem_of(os.path.realpath(base), parse_mountinfo(Path("/proc/self/mountinfo").read_text())) in (None, "tmpfs"):
        pytest.skip(f"{tmp_path} is on a tmpfs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(tg.CheckpointError) as info:
            tg.CheckpointManager(tmp_path / "run", ram_tier=str(base), handle_signals=False).open()
    msg = str(info.value)
    assert "not tmpfs" in msg and "made an error by the warnings filter" in msg, msg
    assert "could not prepare" not in msg and "Remove that directory" not in msg, msg
    with pytest.warns(UserWarning, match="not tmpfs"), \
            tg.CheckpointManager(tmp_path / "run", ram_tier=str(base), handle_signals=False):
        pass  # the failed open left the run directory unlocked; a warning again without the filter


def test_doctor_given_only_the_node_count_says_what_the_interval_check_needs(tmp_path: Path) -> None:
    """``trainguard doctor train.py --nodes 64`` (the job's size, the first input of the interval
    check) left the check out without a word, as ``--step-time`` alone did before today."""
    import json

    from click.testing import CliRunner

    from trainguard.commands.plan import doctor_cmd

    script = tmp_path / "train.py"
    script.write_text("import trainguard.policies as pol\n\ndef trainguard_state():\n"
                      "    return {}, {'root': '/tmp/r', 'save': pol.EveryNSteps(100)}\n")
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json", "--nodes", "64"])
    assert res.exit_code in (0, 1), res.output
    (f,) = [f for f in json.loads(res.output) if f["check"] == "interval"]
    assert f["message"].startswith("not checked: it needs") and "failure rate" in f["message"], f
    assert "--save-stall" in f["message"], f


def test_load_refuses_a_split_state_that_is_not_a_bool(tmp_path: Path) -> None:
    """``tg.load``'s ``strict`` and ``verify`` were checked (``strict="no"`` is truthy), its
    ``split_state`` not: ``split_state="no"`` loaded as a pipeline stage's share."""
    model = nn.Linear(2, 2)
    tg.save(tmp_path / "c", {"model": model})
    with pytest.raises(TypeError, match="split_state='no': pass True or False"):
        tg.load(tmp_path / "c", {"model": model}, split_state="no")


def test_nothing_is_saved_inside_a_committed_checkpoint(tmp_path: Path) -> None:
    """A ``CheckpointManager`` whose root lies inside a committed checkpoint (``run/step-1/eval``, or
    deeper) opened and saved there, and ``tg.save(run/step-1/x)`` too: the run's retention (or an
    overwrite) of ``step-1`` then deleted them with it. Now both are refused, naming the checkpoint,
    before anything is written into it."""
    model = nn.Linear(2, 2)
    run = tmp_path / "run"
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, {"model": model})
    step1 = run / "step-000000001"
    before = _files(step1)
    for root in (step1 / "eval", step1 / "a" / "b" / "eval"):
        with pytest.raises(tg.CheckpointError, match=f"inside the checkpoint {step1}"):
            tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False).open()
    with pytest.raises(tg.CheckpointError, match=f"inside the checkpoint {step1}"):
        tg.save(step1 / "x", {"model": model})
    assert _files(step1) == before and sorted(p.name for p in step1.iterdir()) == ["data-00000.bin", "manifest.json"]
    with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        assert mgr.restore({"model": model}) == 1
        mgr.save(2, {"model": model})  # the run itself saves on as before
    tg.save(tmp_path / "elsewhere" / "x", {"model": model})  # a plain directory's subdirectory: as before
