"""Session 57's hostile review of corruption detection (helper review57c).

- A data file replaced by a symbolic link (``cp -rs``, DVC and git-annex put one in place of each file) was told by
  ``tg.load``, ``tg.verify`` and ``restore``'s skip as "44 bytes on disk, the manifest says 6004160 (truncated or
  replaced)": the link's own size, read as a truncation of an intact file. It is now said to be a symbolic link, to
  where, and what to do; one whose target is gone is no longer "missing" but a link to a file that is not there.
- A rank's missing index file (``data-00001.idx``, format 2) was called a "data file".
- Checked and held up (the report lists the matrix): bit flips over every file kind, truncations, a zeroed page,
  appended bytes, files swapped between steps and ranks, a manifest of another step or run, directories and links
  in place of files, EACCES, 2 gloo ranks (DTensor shards and their index files, rank-local entries, ``only=``),
  ``memory://``, the RAM tier, cold (O_DIRECT) and hot reads: every one refused by ``tg.load`` and ``verify``, and
  ``restore`` fell back to the newest step that verifies, saying why. The compact matrix below keeps that.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from tests.conftest import evict_page_cache
from tests.dist_helper import run_ranks

import trainguard as tg


def _state(v: float = 0.0) -> dict:
    return {"w": torch.full((300_000,), v), "small": torch.full((7,), int(v)), "progress": tg.StateDict(step=int(v))}


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    with tg.CheckpointManager(str(run), save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(float(s)))
    return run


def _restore(run: Path, caplog: pytest.LogCaptureFixture) -> tuple[int | None, dict, str]:
    fresh = _state()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainguard"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.CheckpointManager(str(run), save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            step = mgr.restore(fresh)
    return step, fresh, caplog.text


def test_a_data_file_that_is_a_symbolic_link_is_said_to_be_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = _run(tmp_path)
    ck = run / "step-000000002"
    data = ck / "data-00000.bin"
    kept = tmp_path / "kept.bin"
    shutil.move(data, kept)
    os.symlink(kept, data)  # the same bytes, through a link
    with pytest.raises(tg.CorruptCheckpointError) as e:
        tg.load(str(ck), _state())
    assert str(data) in str(e.value) and f"symbolic link (to {kept})" in str(e.value)
    assert "truncated" not in str(e.value) and "put a copy of it in place of the link" in str(e.value)
    report = tg.verify(str(ck))
    assert not report.ok and "symbolic link" in report.errors[0] and "truncated" not in report.errors[0]
    step, fresh, log = _restore(run, caplog)
    assert step == 1 and torch.equal(fresh["w"], _state(1.0)["w"])
    assert "step 2 is not usable" in log and "symbolic link" in log
    kept.unlink()  # a link whose target is gone: not "missing"
    with pytest.raises(tg.CorruptCheckpointError, match="a symbolic link to .*kept.bin, which is not there"):
        tg.load(str(ck), _state())
    assert "which is not there" in tg.verify(str(ck)).errors[0]


def _save_sharded(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(3000.0).reshape(300, 10)
    tg.save(path, {"d": distribute_tensor(full, DeviceMesh("cpu", list(range(world))), [Shard(0)])})


def test_a_ranks_missing_index_file_is_not_called_a_data_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run_ranks(_save_sharded, 2, str(ck), timeout=120)
    assert (ck / "data-00001.idx").exists()
    (ck / "data-00001.idx").unlink()
    with pytest.raises(tg.CorruptCheckpointError) as e:
        tg.load(str(ck), {"d": torch.zeros(300, 10)})  # one process reads both ranks' parts
    assert f"{ck / 'data-00001.idx'}: index file is missing" in str(e.value)
    assert tg.verify(str(ck)).errors == ["data-00001.idx: missing"]


def _flip(p: Path, off: int) -> None:
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))


def _chunk(ck: Path, name: str) -> tuple[int, int]:
    body = json.loads((ck / "manifest.json").read_bytes())["manifest"]
    c = body["tensors"][name]["chunks"][0]
    return c[3], c[4]


def _damage(ck: Path, how: str, other: Path) -> None:
    data, man = ck / "data-00000.bin", ck / "manifest.json"
    off, length = _chunk(ck, "w")
    if how == "flip first block":
        _flip(data, off + 3)
    elif how == "flip last byte":
        _flip(data, off + length - 1)
    elif how == "flip small tensor":
        _flip(data, _chunk(ck, "small")[0])
    elif how == "flip manifest":
        _flip(man, man.stat().st_size // 2)
    elif how == "data cut by 1":
        os.truncate(data, data.stat().st_size - 1)
    elif how == "data emptied":
        os.truncate(data, 0)
    elif how == "zeroed page":
        with open(data, "r+b") as f:
            f.seek((off + length // 2) // 4096 * 4096)
            f.write(b"\0" * 4096)
    elif how == "bytes appended":
        with open(data, "ab") as f:
            f.write(b"garbage")
    elif how == "manifest newline cut":
        os.truncate(man, man.stat().st_size - 1)
    elif how == "data of another step":
        shutil.copy(other / "data-00000.bin", data)
    elif how == "manifest of another step":
        shutil.copy(other / "manifest.json", man)
    elif how == "directory for data":
        data.unlink()
        data.mkdir()


KINDS = ["flip first block", "flip last byte", "flip small tensor", "flip manifest", "data cut by 1", "data emptied",
         "zeroed page", "bytes appended", "manifest newline cut", "data of another step", "manifest of another step",
         "directory for data"]


@pytest.mark.parametrize("how", KINDS)
def test_damage_is_never_loaded_and_restore_falls_back(tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    run = _run(tmp_path)
    ck = run / "step-000000002"
    _damage(ck, how, run / "step-000000001")
    evict_page_cache(ck) if how.startswith("flip") and ck.joinpath("data-00000.bin").is_file() else None  # cold reads
    with pytest.raises(tg.CorruptCheckpointError) as e:
        tg.load(str(ck), _state())
    assert str(ck) in str(e.value)
    assert not tg.verify(str(ck)).ok
    step, fresh, log = _restore(run, caplog)
    assert step == 1 and torch.equal(fresh["w"], _state(1.0)["w"]) and fresh["progress"]["step"] == 1
    assert "step 2 is not usable" in log
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "restore_skip"] == [2]


def test_tg_load_of_a_damaged_step_says_what_to_load_instead(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = _run(tmp_path)
    ck = run / "step-000000002"
    os.truncate(ck / "data-00000.bin", 100)  # found before a byte is read: nothing else to say
    with pytest.raises(tg.CorruptCheckpointError) as e:
        tg.load(str(ck), _state())
    assert str(ck / "data-00000.bin") in str(e.value)
    assert f"use an earlier step that verifies ({run} holds step 1: `trainguard verify {run}` says which verify)" in str(e.value)
    step, _fresh, log = _restore(run, caplog)  # restore falls back itself: its skip line has no such advice
    assert step == 1 and "step 2 is not usable" in log and "use an earlier step" not in log
