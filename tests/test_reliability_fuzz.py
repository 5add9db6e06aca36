"""Hostile or malformed checkpoints: every case ends in ``CheckpointError`` (``verify`` reports
it), within bounded time and memory, with no file opened outside the checkpoint directory and
no pickle.

Manifests carry a checksum over their body, so random bytes only test the checksum. To reach
the *validator* and the read paths, each hostile body here is wrapped with a correct checksum
(``_wrap``) and points at the real data file of a real checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainguard as tg
from trainguard.cli import main as cli_main
from trainguard.inspect import describe, list_checkpoints
from trainguard.manifest import checksum

DATA = "data-00000.bin"
# TG_FUZZ_EXAMPLES=5000 runs a longer, randomly seeded search (the default run is fixed and short).
EXAMPLES = int(os.environ.get("TG_FUZZ_EXAMPLES", "0"))
FUZZ = {"deadline": None, "suppress_health_check": list(HealthCheck), "derandomize": not EXAMPLES}


def _wrap(body: bytes) -> bytes:
    """A manifest file with a *correct* checksum around any body."""
    return b'{"checksum":"' + checksum(body).encode() + b'","manifest":' + body + b"}\n"


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "model": model,
        "data": {"a": torch.randn(300, generator=g), "b": torch.arange(64, dtype=torch.int64)},
        "progress": tg.StateDict(step=seed, tags=["x", 1, None]),
    }


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> tuple[Path, dict]:
    """A real checkpoint and its manifest body as parsed JSON."""
    d = tmp_path_factory.mktemp("fuzz") / "step-000000005"
    tg.save(d, _state(5))
    raw = (d / "manifest.json").read_bytes()
    body = json.loads(raw)["manifest"]
    return d, body


class Guard:
    """Watches one operation: files opened (must stay inside ``root``), tensor allocations
    (bounded), pickle / torch.load (never called)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, max_alloc: int) -> None:
        self.root = os.path.realpath(root)
        self.max_alloc = max_alloc
        self.opened: list[str] = []
        real_open, real_empty = os.open, torch.empty

        def watched_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
            fd = real_open(path, flags, *a, **k)
            self.opened.append(os.readlink(f"/proc/self/fd/{fd}"))
            return fd

        def watched_empty(*size: Any, **k: Any) -> torch.Tensor:
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            item = (k.get("dtype") or torch.get_default_dtype()).itemsize
            n = math.prod(int(x) for x in dims) * item
            if n > self.max_alloc:
                raise AssertionError(f"allocation of {n} bytes requested for a {self.max_alloc}-byte checkpoint")
            return real_empty(*size, **k)

        def no_pickle(*a: Any, **k: Any) -> Any:
            raise AssertionError("pickle / torch.load called on checkpoint contents")

        monkeypatch.setattr(os, "open", watched_open)
        monkeypatch.setattr(torch, "empty", watched_empty)
        for mod, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
            monkeypatch.setattr(mod, name, no_pickle)

    def outside(self) -> list[str]:
        return [p for p in self.opened if not (p == self.root or p.startswith(self.root + os.sep))]


def _all_paths(ckpt: Path, monkeypatch: pytest.MonkeyPatch, *, expect_error: bool = True) -> list[str]:
    """Run load, verify, ls, inspect and the CLI on ``ckpt``; return what went wrong (empty: fine)."""
    problems = []
    with monkeypatch.context() as mp:
        guard = Guard(mp, ckpt.parent, max_alloc=max(1 << 20, 2 * sum(f.stat().st_size for f in ckpt.iterdir())))
        try:
            tg.load(ckpt, _state(1))
            if expect_error:
                problems.append("load accepted it")
        except tg.CheckpointError:
            pass
        except BaseException as e:  # noqa: BLE001 - anything else is the finding
            problems.append(f"load raised {type(e).__name__}: {e}")
        try:
            v = tg.verify(ckpt)
            if expect_error and v.ok:
                problems.append("verify passed it")
        except BaseException as e:  # noqa: BLE001
            problems.append(f"verify raised {type(e).__name__}: {e}")
        try:
            rows = list_checkpoints(ckpt.parent)
            if expect_error and any(r.status == "valid" for r in rows) and not problems:
                pass  # ls checks structure and sizes only; verify is the data check
        except BaseException as e:  # noqa: BLE001
            problems.append(f"ls raised {type(e).__name__}: {e}")
        try:
            describe(ckpt)
        except tg.CheckpointError:
            pass
        except BaseException as e:  # noqa: BLE001
            problems.append(f"inspect raised {type(e).__name__}: {e}")
        problems += [f"opened outside the checkpoint: {p}" for p in guard.outside()]
    return problems


def _fresh(real: tuple[Path, dict], tmp: Path) -> Path:
    d = tmp / "step-000000005"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(real[0], d)
    return d


def _write(ckpt: Path, body: Any) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    (ckpt / "manifest.json").write_bytes(_wrap(raw))


# ----------------------------------------------------------------------------- named hostile cases


def _tensor(body: dict, path: str = "data/a") -> dict:
    return body["tensors"][path]


def _case_overlapping_chunks(b: dict, data: bytes) -> None:
    # Two chunks claim the first half of the tensor (from different, correctly checksummed
    # bytes); the second half would never be written.
    t = _tensor(b)
    off, length = t["chunks"][0][3], t["chunks"][0][4]
    h = length // 2
    t["chunks"] = [
        [[0], [150], DATA, off, h, [checksum(data[off : off + h])]],
        [[0], [150], DATA, off + h, h, [checksum(data[off + h : off + length])]],
    ]


def _case_shared_bytes(b: dict) -> None:
    # 1,000 chunks all pointing at the same file bytes: a tensor far larger than the file.
    t = _tensor(b)
    off, length, sums = t["chunks"][0][3:6]
    t["shape"] = [300 * 1000]
    t["chunks"] = [[[300 * i], [300], DATA, off, length, sums] for i in range(1000)]


def _case_huge_file_claim(b: dict) -> None:
    b["files"][DATA] = 1 << 40  # the file is a few KB
    t = _tensor(b)
    t["shape"] = [1 << 37]
    t["chunks"] = [[[0], [1 << 37], DATA, 0, 1 << 39, ["0" * 16] * ((1 << 39) // b["block_size"] + 1)]]


def _case_huge_claim_well_formed(b: dict) -> None:
    # A 512 GiB tensor in a "1 TiB" file, with a well-formed checksum list: only the real file
    # size (checked before any destination is allocated) stops it.
    b["files"][DATA] = 1 << 40
    t = _tensor(b)
    t["shape"] = [1 << 37]
    t["chunks"] = [[[0], [1 << 37], DATA, 1 << 39, 1 << 39, ["0" * 16] * ((1 << 39) // b["block_size"])]]


CASES = {
    "huge_claim_well_formed": _case_huge_claim_well_formed,
    "overlapping_chunks": _case_overlapping_chunks,
    "shared_bytes": _case_shared_bytes,
    "huge_file_claim": _case_huge_file_claim,
    "traversal_name": lambda b: b["files"].update({"../data-00000.bin": 10}),
    "absolute_name": lambda b: _tensor(b)["chunks"][0].__setitem__(2, "/etc/passwd"),
    "unknown_dtype": lambda b: _tensor(b).update(dtype="float128"),
    "negative_shape": lambda b: _tensor(b).update(shape=[-300]),
    "negative_offset": lambda b: _tensor(b)["chunks"][0].__setitem__(3, -64),
    "out_of_file_chunk": lambda b: _tensor(b)["chunks"][0].__setitem__(3, b["files"][DATA] - 8),
    "float_shape": lambda b: _tensor(b).update(shape=[300.0]),
    "bool_length": lambda b: _tensor(b)["chunks"][0].__setitem__(4, True),
    "deep_skeleton": lambda b: b["objects"]["data"].update(skeleton=json.loads("[" * 500 + "]" * 500)),
    "skeleton_ref_unknown": lambda b: b["objects"]["data"].update(skeleton={"$t": "nope"}),
    "skeleton_bad_marker": lambda b: b["objects"]["data"].update(skeleton={"$t": 5}),
    "ranks_not_list": lambda b: b["objects"].update(data={"ranks": {"0": 1}}),
    "ranks_empty": lambda b: b["objects"].update(data={"ranks": []}),
    "block_zero": lambda b: b.update(block_size=0),
    "version_2": lambda b: b.update(format_version=2),
    "tensors_list": lambda b: b.update(tensors=[]),
    "files_size_str": lambda b: b["files"].update({DATA: "100"}),
    "checksums_short": lambda b: _tensor(b)["chunks"][0].__setitem__(5, ["abc"]),
    "chunk_dict": lambda b: _tensor(b)["chunks"].__setitem__(0, {"file": DATA}),
    "shape_17_dims": lambda b: _tensor(b).update(shape=[1] * 17),
    # Holds nothing, but torch cannot even build it: its strides overflow int64.
    "zero_dim_huge_strides": lambda b: _tensor(b).update(shape=[0, 3_036_988_439, 3_037_012_561], chunks=[]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_hostile_manifest(real, tmp_path, monkeypatch, name):
    body = copy.deepcopy(real[1])
    fn = CASES[name]
    fn(body, (real[0] / DATA).read_bytes()) if name == "overlapping_chunks" else fn(body)
    ckpt = _fresh(real, tmp_path)
    _write(ckpt, body)
    assert _all_paths(ckpt, monkeypatch) == []


# ----------------------------------------------------------------------------- files that are not files


def _long_outside_target(base: Path, length: int) -> Path:
    """A path of exactly ``length`` characters under ``base`` (nested 200-character names)."""
    p = base
    while len(str(p)) + 201 < length:
        p = p / ("d" * 200)
    rest = length - len(str(p)) - 1
    p.mkdir(parents=True, exist_ok=True)
    return p / ("f" * rest)


def test_symlinked_data_file_leaving_the_directory_is_refused(real, tmp_path, monkeypatch):
    """The data file is a symlink to an identical copy outside, and the manifest's file size
    equals the link's own size, so every size check passes: only O_NOFOLLOW stands between
    the reader and the outside file."""
    ckpt = _fresh(real, tmp_path / "run")
    data = (ckpt / DATA).read_bytes()
    target = _long_outside_target(tmp_path / "outside", len(data))
    target.write_bytes(data)
    (ckpt / DATA).unlink()
    os.symlink(target, ckpt / DATA)
    assert os.lstat(ckpt / DATA).st_size == len(data)  # the manifest's size claim holds for the link
    assert _all_paths(ckpt, monkeypatch) == []


def test_symlinked_manifest_is_refused(real, tmp_path, monkeypatch):
    ckpt = _fresh(real, tmp_path / "run")
    outside = tmp_path / "elsewhere.json"
    shutil.move(ckpt / "manifest.json", outside)
    os.symlink(outside, ckpt / "manifest.json")
    assert _all_paths(ckpt, monkeypatch) == []


@pytest.mark.parametrize("what", ["data", "manifest"])
def test_fifo_under_a_checkpoint_name_does_not_hang(real, tmp_path, monkeypatch, what):
    """A FIFO named like a checkpoint file would block a plain open() forever."""
    import threading

    ckpt = _fresh(real, tmp_path / "run")
    body = copy.deepcopy(real[1])
    body["files"] = {DATA: 0}  # a FIFO's size is 0: the size check alone cannot catch it
    body["tensors"] = {}
    body["objects"] = {"progress": body["objects"]["progress"]}
    _write(ckpt, body)
    name = DATA if what == "data" else "manifest.json"
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    out: list[list[str]] = []
    t = threading.Thread(target=lambda: out.append(_all_paths(ckpt, monkeypatch)), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader so the thread can end, then fail
        fd = os.open(ckpt / name, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail(f"opening a FIFO named {name} blocked")
    assert out == [[]]


# ----------------------------------------------------------------------------- extreme but valid


def test_huge_block_size_is_read_with_bounded_memory(real, tmp_path):
    """block_size = 1 GiB is legal; verify must not allocate a 1 GiB buffer for a 3 KB file."""
    import tracemalloc

    ckpt = _fresh(real, tmp_path)
    body = copy.deepcopy(real[1])
    body["block_size"] = 1 << 30
    _write(ckpt, body)
    tracemalloc.start()
    try:
        assert tg.verify(ckpt).ok
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    state = _state(1)
    tg.load(ckpt, state)
    assert torch.equal(state["data"]["a"], _state(5)["data"]["a"])


# ----------------------------------------------------------------------------- property-based


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in a JSON tree (dict keys and list indexes)."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _deep(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


HOSTILE_SCALARS = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, -1, 1, 2**31, 2**32 + 1, 2**48, 2**48 + 1, 2**62, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.sampled_from(
        [
            "", "../data-00000.bin", "/etc/passwd", "data-00000.bin/../../x", "data-00001.bin", "data-0.bin",
            "float128", "object", "torch.float32", "$t", "$tuple", "$dict", "$float", "nan", "\x00", "é" * 50,
            "0" * 16, "z" * 16, "step-000000001", "full", "sharded",
        ]
    ),
    st.text(max_size=20),
)
HOSTILE = st.one_of(
    HOSTILE_SCALARS,
    st.lists(HOSTILE_SCALARS, max_size=8),
    st.dictionaries(st.text(max_size=8), HOSTILE_SCALARS, max_size=4),
    st.integers(min_value=50, max_value=2000).map(_deep),
    st.just({"$t": "data/a"}),
    st.just([[[0], [300], DATA, 0, 1 << 40, ["0" * 16]]]),
)


def _mutate(body: dict, data: st.DataObject) -> dict:
    body = copy.deepcopy(body)
    locations = [p for p in _paths(body) if p]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        loc = data.draw(st.sampled_from(locations), label="where")
        parent: Any = body
        try:
            for k in loc[:-1]:
                parent = parent[k]
            action = data.draw(st.sampled_from(["replace", "delete", "insert"]), label="action")
            if action == "replace" or not isinstance(parent, (dict, list)):
                parent[loc[-1]] = data.draw(HOSTILE, label="value")
            elif action == "delete":
                del parent[loc[-1]]
            elif isinstance(parent, dict):
                parent[data.draw(st.text(max_size=12), label="key")] = data.draw(HOSTILE, label="value")
            else:
                parent.insert(loc[-1], data.draw(HOSTILE, label="value"))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this location
    return body


@settings(max_examples=EXAMPLES or 200, **FUZZ)
@given(data=st.data())
def test_fuzzed_manifest_bodies_end_in_checkpoint_error(real, tmp_path_factory, data):
    """Random hostile edits of a real manifest body, checksummed correctly, over the real data
    file: load/verify/ls/inspect never fail with anything but CheckpointError; no file outside
    the directory is opened; no giant allocation. (An edit that keeps the manifest meaningful,
    e.g. new metadata, may load: then it must load the saved values.)"""
    body = _mutate(real[1], data)
    ckpt = _fresh(real, tmp_path_factory.mktemp("hyp"))
    _write(ckpt, body)
    with pytest.MonkeyPatch.context() as mp:
        problems = _all_paths(ckpt, mp, expect_error=False)
    assert problems == [], (problems, json.dumps(body)[:2000])
    # If load accepted it, what it loaded is what the manifest's chunks describe: for the saved
    # tensors whose entries are unchanged, the saved values.
    state = _state(1)
    try:
        tg.load(ckpt, state, strict=False)
    except tg.CheckpointError:
        return
    want = _state(5)
    unchanged = (
        isinstance(body.get("tensors"), dict)
        and body["tensors"].get("data/a") == real[1]["tensors"]["data/a"]
        and isinstance(body.get("objects"), dict)
        and body["objects"].get("data") == real[1]["objects"]["data"]
    )
    if unchanged:
        assert torch.equal(state["data"]["a"], want["data"]["a"])


@settings(max_examples=EXAMPLES or 150, **FUZZ)
@given(
    shape=st.lists(st.integers(-2, 1 << 40), min_size=0, max_size=3),
    chunks=st.lists(
        st.tuples(
            st.lists(st.integers(-2, 400), min_size=1, max_size=2),
            st.lists(st.integers(-2, 400), min_size=1, max_size=2),
            st.integers(-8, 1 << 20),
            st.integers(-8, 1 << 20),
            st.booleans(),
        ),
        max_size=5,
    ),
    file_size=st.one_of(st.none(), st.integers(-1, 1 << 50)),
)
def test_fuzzed_chunk_tables_through_the_read_path(real, tmp_path_factory, shape, chunks, file_size):
    """Hostile chunk tables for one tensor, with *correct* checksums of whatever bytes they point
    at in the real file, so the planner and io read paths (not only the checksum) are exercised."""
    data = (real[0] / DATA).read_bytes()
    body = copy.deepcopy(real[1])
    if file_size is not None:
        body["files"][DATA] = file_size
    block = body["block_size"]
    table = []
    for offs, sizes, off, length, good_sums in chunks:
        piece = data[max(off, 0) : max(off, 0) + max(length, 0)]
        sums = [checksum(piece[b : b + block]) for b in range(0, max(len(piece), 1), block)] if good_sums else ["0" * 16]
        table.append([offs, sizes, DATA, off, length, sums])
    body["tensors"]["data/a"] = {"dtype": "float32", "shape": shape, "chunks": table}
    ckpt = _fresh(real, tmp_path_factory.mktemp("chunks"))
    _write(ckpt, body)
    with pytest.MonkeyPatch.context() as mp:
        assert _all_paths(ckpt, mp, expect_error=False) == []


# ----------------------------------------------------------------------------- no pickle anywhere


def test_no_path_runs_pickle(real, tmp_path, monkeypatch):
    """load, verify, restore, ls, inspect and the CLI all work with pickle and torch.load broken."""
    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        mgr.save(3, _state(3))

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle / torch.load called while reading a checkpoint")

    for mod, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, boom)
    ckpt = root / "step-000000003"
    state = _state(0)
    assert not torch.equal(state["data"]["a"], _state(3)["data"]["a"])
    tg.load(ckpt, state)
    assert torch.equal(state["data"]["a"], _state(3)["data"]["a"])
    assert tg.verify(ckpt).ok
    fresh = _state(0)
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore(fresh) == 3
    assert torch.equal(fresh["model"].weight, _state(3)["model"].weight)
    assert [r.status for r in list_checkpoints(root, verify_data=True)] == ["valid"]
    assert describe(ckpt).step == 3
    runner = CliRunner()
    for args in (["ls", str(root)], ["inspect", str(ckpt)], ["verify", str(ckpt)]):
        r = runner.invoke(cli_main, args, catch_exceptions=True)
        assert r.exit_code == 0 and r.exception is None, (args, r.output, r.exception)
