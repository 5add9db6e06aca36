"""The fsspec backend on fsspec's in-memory filesystem (no server): part assembly from
out-of-order threaded writes, ranged reads, marker-first deletes, manager on ``memory://``."""

from __future__ import annotations

import random
import threading
import uuid

import pytest
import torch

import trainguard as tg
from trainguard.commit import list_steps
from trainguard.errors import CorruptCheckpointError
from trainguard.storage import for_path
from trainguard.storage.fsspec import FsspecStorage

fsspec = pytest.importorskip("fsspec")
P = 5 << 20


def _url() -> str:
    return f"memory://tg-{uuid.uuid4().hex[:10]}"


def test_parts_from_threads_out_of_order_with_holes():
    storage, root = FsspecStorage.from_url(_url())
    storage.part_size = P
    size = 3 * P + 12345
    data = bytearray(random.Random(0).randbytes(size))
    hole = range(P + 100, P + 5000)  # never written: must read back as zeros
    data[hole.start : hole.stop] = bytes(len(hole))
    pieces = []
    for a in range(0, size, 700_001):
        b = min(a + 700_001, size)
        pieces += [(a, hole.start), (hole.stop, b)] if a < hole.stop and b > hole.start else [(a, b)]
    random.Random(1).shuffle(pieces)
    path = storage.join(root, "f.bin")
    w = storage.open_write(path)
    view = memoryview(data)
    threads = [threading.Thread(target=lambda ps=pieces[i::3]: [w.pwrite(view[a:b], a) for a, b in ps]) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.finish(size)
    assert storage.size(path) == size
    r = storage.open_read(path)
    out = bytearray(size - 10)
    r.readinto(memoryview(out), 10)  # 3 ranged pieces fetched together
    assert out == data[10:]
    with pytest.raises(CorruptCheckpointError):
        r.readinto(memoryview(bytearray(100)), size - 50)


def test_holes_are_zeros_also_in_a_reused_part_buffer():
    storage, root = FsspecStorage.from_url(_url())
    storage.part_size = P
    path = storage.join(root, "f.bin")
    w = storage.open_write(path)
    w.pwrite(memoryview(b"\xab" * P), 0)  # part 0 complete: uploaded, its buffer recycled
    for f in w._futures:
        f.result()
    w.pwrite(memoryview(b"\x01" * 100), P + 4096)  # part 1 in the reused buffer: [P, P+4096) a hole
    w.finish(P + 4096 + 100)
    out = bytearray(4096 + 100)
    storage.open_read(path).readinto(memoryview(out), P)
    assert bytes(out) == bytes(4096) + b"\x01" * 100  # before: the hole held part 0's bytes
    storage.remove_tree(root)


def test_aborted_write_leaves_nothing():
    storage, root = FsspecStorage.from_url(_url())
    path = storage.join(root, "g.bin")
    w = storage.open_write(path)
    w.pwrite(memoryview(b"x" * 1000), 0)
    w.abort()
    assert not storage.exists(path)


def test_remove_tree_deletes_the_marker_first():
    storage, root = FsspecStorage.from_url(_url())
    step = storage.join(root, "step-000000001")
    storage.write_atomic(storage.join(step, "data-00000.bin"), b"d")
    storage.write_atomic(storage.join(step, "manifest.json"), b"{}")
    order = []
    real = storage.fs.rm_file

    def rm_file(p, **kw):
        order.append(p)
        if not p.endswith("manifest.json"):
            raise RuntimeError("crash after the marker")
        return real(p, **kw)

    storage.fs.rm_file = rm_file
    storage.fs.rm = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("crash after the marker"))
    try:
        storage.remove_tree(step)  # dies half-way: best effort, logged
    finally:
        del storage.fs.rm_file, storage.fs.rm
    assert order[0].endswith("manifest.json")
    assert [s.status for s in list_steps(storage, root)] == ["incomplete"]  # ignored, cleaned later


def test_manager_on_memory_url_saves_keeps_restores():
    url = _url()
    model = torch.nn.Linear(300, 200)
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2)) as mgr:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step, {"model": model})
    storage, root = for_path(url)
    assert [s.step for s in list_steps(storage, root)] == [1, 2]
    fresh = torch.nn.Linear(300, 200)
    assert not torch.equal(fresh.weight, model.weight)
    with tg.CheckpointManager(url) as mgr:
        assert mgr.restore({"model": fresh}) == 2
    assert torch.equal(fresh.weight, model.weight)


def _doc_blocks(doc: str) -> list[str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / doc).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_storage_doc_examples_run(tmp_path, monkeypatch):
    blocks = _doc_blocks("docs/storage.md")
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/storage.md", "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "ckpts" / "ram-demo" / "step-000000001" / "manifest.json").exists()


def test_listing_a_run_dir_costs_one_listing_not_one_request_per_step():
    """``list_steps`` runs at every manager open, restore and retention (rank 0): on an object
    store, one request per step directory made each of them grow with the checkpoints kept
    (300 on a local S3 server: 1.5 s per listing, 1 find + 300 HEADs)."""
    url = _url()
    tg.save(f"{url}/step-000000001", {"w": torch.zeros(16)})
    storage, root = for_path(url)
    src = storage.join(root, "step-000000001")
    for s in range(2, 41):
        for f in storage.listdir(src):
            storage.fs.copy(storage.join(src, f), storage.join(root, f"step-{s:09d}", f))
    storage.fs.pipe_file(storage.join(root, "step-000000041", "data-00000.bin"), b"x")  # a save in progress
    calls = []
    real = type(storage.fs).exists

    def counted(fs, path, **kw):
        calls.append(path)
        return real(fs, path, **kw)

    type(storage.fs).exists = counted
    try:
        steps = list_steps(storage, root)
    finally:
        type(storage.fs).exists = real
    assert [(s.step, s.status) for s in steps] == [(s, "committed") for s in range(1, 41)] + [(41, "incomplete")]
    assert calls == []


def test_ctrl_c_right_after_an_object_store_commit_keeps_the_checkpoint(monkeypatch):
    # On an object store the save writes in place and its manifest IS the commit: the Ctrl-C
    # clean-up of a one-process save (which removes a local save's temp directory) must not
    # remove a checkpoint whose manifest is written.
    from trainguard import commit

    path = f"{_url()}/step-000000001"
    real = commit.fault

    def interrupted(point: str, rank: int) -> None:
        real(point, rank)
        if point == "after_manifest":
            raise KeyboardInterrupt

    monkeypatch.setattr(commit, "fault", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tg.save(path, {"w": torch.arange(6.0)})
    monkeypatch.setattr(commit, "fault", real)
    dest = {"w": torch.zeros(6)}
    tg.load(path, dest)
    assert torch.equal(dest["w"], torch.arange(6.0))
