"""Format 2: regular (``Shard(d)`` over all ranks) tensors described by a rule in the manifest
and per-rank index files. tests/data/v2 was written by a 2-rank FSDP2 save (make_v2.py) and is
never regenerated; the rest checks the part arithmetic against torch and that index files are
validated as strictly as the manifest.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import trainguard as tg
from trainguard.errors import CheckpointError, CorruptCheckpointError
from trainguard.export import iter_tensors
from trainguard.manifest import checksum, parse
from trainguard.planner import Box, Regular
from trainguard.storage import for_path

from dist_helper import cpu_mesh, run_ranks

sys.path.insert(0, str(Path(__file__).parent / "data"))
from make_v2 import golden_extra, golden_model  # noqa: E402

V2 = Path(__file__).parent / "data" / "v2" / "step-000000009"


def _plain() -> dict:
    return {"model": nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1)), "progress": tg.StateDict(), "extra": None}


def _assert_golden(state: dict) -> None:
    ref = golden_model().state_dict()
    got = state["model"].state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert dict(state["progress"]) == {"step": 9}
    assert torch.equal(state["extra"]["plain"], golden_extra()["plain"]) and state["extra"]["note"] == "v2"


def test_format_v2_fixture_loads_verifies_and_lists() -> None:
    m = tg.inspect.describe(V2)
    assert m.format_version == 2 and sorted(m.indexes) == ["data-00000.idx", "data-00001.idx"]
    assert m.tensors["model/0.weight"].regular == Regular(0, 2) and not m.tensors["model/0.weight"].chunks
    assert m.tensors["extra/plain"].regular is None  # replicated tensors stay explicit chunks
    assert tg.verify(V2).ok
    assert [s.status for s in tg.inspect.list_checkpoints(V2.parent)] == ["valid"]
    state = _plain()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    tg.load(V2, state)
    assert not all(torch.equal(before[k], v) for k, v in state["model"].state_dict().items())
    _assert_golden(state)
    storage, d = for_path(V2)
    whole = dict(iter_tensors(storage, d, m, "model"))
    assert torch.equal(whole["0.weight"], golden_model()[0].weight.detach())


def test_dtensor_parts_match_torch_chunking() -> None:
    from torch.distributed.tensor import Shard

    for n in range(0, 40):
        for parts in range(1, 12):
            r = Regular(0, parts)
            boxes = [r.part_box((n, 3), i) for i in range(parts)]
            for i, b in enumerate(boxes):
                size, off = Shard.local_shard_size_and_offset(n, parts, i)
                assert (b.offsets[0], b.sizes[0]) == (off, size), (n, parts, i)
            assert r.nonempty((n, 3)) == sum(1 for b in boxes if b.sizes[0])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), parts=st.integers(1, 70), lo=st.integers(0, 300), size=st.integers(0, 300))
def test_overlapping_parts_match_brute_force(n: int, parts: int, lo: int, size: int) -> None:
    r = Regular(1, parts)
    lo = min(lo, n)
    dest = Box((0, lo), (2, min(size, n - lo)))
    want = [i for i in range(parts) if (x := r.part_box((2, n), i).intersect(dest)) is not None and x.numel]
    assert [i for i in r.overlapping((2, n), dest) if r.part_box((2, n), i).numel] == want


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "step-000000009"
    shutil.copytree(V2, dst)
    return dst


def _rewrite_index(ck: Path, name: str, body: dict) -> None:
    """Replace an index and re-sign it in the manifest (a hostile but self-consistent checkpoint)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    (ck / name).write_bytes(data)
    raw = (ck / "manifest.json").read_bytes()
    man = json.loads(raw)["manifest"]
    man["indexes"][name] = [len(data), checksum(data)]
    b = json.dumps(man, separators=(",", ":")).encode()
    (ck / "manifest.json").write_bytes(b'{"checksum":"' + checksum(b).encode() + b'","manifest":' + b + b"}\n")


def _hostile(which: str, idx: dict) -> dict:
    t = idx["tensors"]
    if which == "past_file":
        t["model/0.weight"][0] = 10_000
    elif which == "wrong_length":
        t["model/0.weight"][1] = 12
    elif which == "missing_part":
        del t["model/0.bias"]
    elif which == "unknown_tensor":
        t["extra/plain"] = [0, 32, ["0" * 16]]
    elif which == "overlap":
        t["model/0.bias"][0] = t["model/0.weight"][0]
    elif which == "checksums":
        t["model/0.weight"][2] = []
    elif which == "other_file":
        idx["file"] = "data-00001.bin"
    return idx


@pytest.mark.parametrize(
    "which", ["past_file", "wrong_length", "missing_part", "unknown_tensor", "overlap", "checksums", "other_file"]
)
def test_hostile_index_is_refused_by_load_and_verify(tmp_path: Path, which: str) -> None:
    ck = _copy(tmp_path)
    idx = json.loads((ck / "data-00000.idx").read_bytes())
    _rewrite_index(ck, "data-00000.idx", _hostile(which, idx))
    with pytest.raises(CorruptCheckpointError):
        tg.load(ck, _plain())
    assert not tg.verify(ck).ok


def test_corrupt_or_missing_index_and_v1_with_indexes(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    data = bytearray((ck / "data-00001.idx").read_bytes())
    data[5] ^= 1  # a flipped byte, size unchanged: the manifest's checksum catches it
    (ck / "data-00001.idx").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        tg.load(ck, _plain())
    v = tg.verify(ck)
    assert not v.ok and "data-00001.idx" in " ".join(v.errors)
    (ck / "data-00001.idx").unlink()
    assert not tg.verify(ck).ok and tg.inspect.list_checkpoints(tmp_path)[0].status == "corrupt"
    # A v1 manifest cannot carry v2 fields; a v2 one needs every part's file and index.
    body = json.loads((V2 / "manifest.json").read_bytes())["manifest"]
    huge = {**body["tensors"], "model/0.weight": {"dtype": "float32", "shape": [5_000_000, 3], "regular": {"dim": 0, "parts": 2}}}
    bad_rule = {**body["tensors"], "model/0.bias": {"dtype": "float32", "shape": [5], "regular": {"dim": 1, "parts": 2}}}
    changes = ({"format_version": 1}, {"indexes": {}}, {"indexes": {"../x.idx": [1, "0" * 16]}}, {"tensors": huge},
               {"tensors": bad_rule})
    for change in changes:  # the huge shape claims more bytes than the data files hold
        b = json.dumps({**body, **change}, separators=(",", ":")).encode()
        with pytest.raises(CheckpointError):
            parse(b'{"checksum":"' + checksum(b).encode() + b'","manifest":' + b + b"}\n")


def _fsdp_load(rank: int, world: int, src: str, dst: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    fully_shard(model, mesh=cpu_mesh())
    tg.load(src, {"model": model, "progress": tg.StateDict(), "extra": None})
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    tg.save(dst, {"model": model})
    return {"full": full}


def test_v2_loads_into_fsdp_at_3_ranks_and_resaves(tmp_path: Path) -> None:
    out = run_ranks(_fsdp_load, 3, str(V2), str(tmp_path / "w3" / "step-000000001"), timeout=120)
    ref = golden_model().state_dict()
    for r in out:
        assert all(torch.equal(r.value["full"][k], ref[k]) for k in ref)
    m = tg.inspect.describe(tmp_path / "w3" / "step-000000001")
    assert m.format_version == 2 and m.tensors["model/0.weight"].regular == Regular(0, 3)
    state = _plain()
    tg.load(tmp_path / "w3" / "step-000000001", {"model": state["model"]})
    assert all(torch.equal(state["model"].state_dict()[k], ref[k]) for k in ref)


DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"


def _run_doc_block(rank: int, world: int, code: str) -> str:
    exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
    return "ok"


def test_distributed_doc_format2_example(tmp_path: Path) -> None:
    import re

    code = next(b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "fully_shard" in b)
    root = tmp_path / "fsdp"
    res = run_ranks(_run_doc_block, 2, code, timeout=90, env={"CKPT_DIR": str(root), "TRAINGUARD_DEAD_AFTER": "3"})
    assert [r.value for r in res] == ["ok", "ok"]
    ck = root / "step-000000001"
    assert sorted(p.name for p in ck.iterdir()) == [
        "data-00000.bin", "data-00000.idx", "data-00001.bin", "data-00001.idx", "manifest.json"
    ]
    assert tg.verify(ck).ok
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    before = model[0].weight.detach().clone()
    tg.load(ck, {"model": model}, only=["model"])  # 2 -> 1
    assert not torch.equal(model[0].weight, before)
