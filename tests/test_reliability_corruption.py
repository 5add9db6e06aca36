"""Corruption: 1,000 single-byte flips and 100 truncations of a real checkpoint's data file and
manifest are all detected by ``verify`` and by ``load``; ``restore`` falls back to the previous
checkpoint and its log names the bad file (and, for data, the bad tensor).

The state is laid out so that every byte of the data file belongs to some chunk (tensor sizes are
multiples of 64 bytes, the big one of 4096), so "every byte flipped is detected" is a claim about
the whole file, not only about chunk bytes. Padding bytes, where a real checkpoint has them, carry
no data and are not checksummed (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import torch

import trainguard as tg
from trainguard.commit import read_manifest
from trainguard.storage import LocalStorage

FLIPS = 1000
TRUNCATIONS = 100


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(64, 32)  # 8192 + 128 bytes
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "model": model,
        "data": {
            "big": torch.randn(263168, generator=g),  # 1,052,672 bytes = 257 pages: its own write
            "mid": [torch.randn(4096, generator=g) for _ in range(3)],
            "ints": torch.randint(0, 1 << 30, (48,), generator=g, dtype=torch.int64),
        },
        "progress": tg.StateDict(step=step, note="corruption test"),
    }


def same_state(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["model"].weight, b["model"].weight)
        and torch.equal(a["model"].bias, b["model"].bias)
        and torch.equal(a["data"]["big"], b["data"]["big"])
        and all(torch.equal(x, y) for x, y in zip(a["data"]["mid"], b["data"]["mid"]))
        and torch.equal(a["data"]["ints"], b["data"]["ints"])
        and a["progress"]["step"] == b["progress"]["step"]
    )


def _owner_map(ckpt: Path) -> tuple[list[tuple[int, int, str]], int]:
    """(start, end, tensor path) of every chunk in data-00000.bin, and the file size."""
    m = read_manifest(LocalStorage(), str(ckpt))
    spans = sorted((c.offset, c.offset + c.length, p) for p, e in m.tensors.items() for c in e.chunks)
    return spans, m.files["data-00000.bin"]


def _tensor_at(spans: list[tuple[int, int, str]], pos: int) -> str:
    return next(p for s, e, p in spans if s <= pos < e)


def _flip(path: Path, pos: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ mask]))


def _detected(ckpt: Path, state: dict) -> tuple[bool, bool, str]:
    """(verify failed, load raised CheckpointError, load's message)."""
    v = tg.verify(ckpt)
    try:
        tg.load(ckpt, state)
    except tg.CheckpointError as e:
        return not v.ok, True, str(e)
    return not v.ok, False, ""


def test_every_flip_and_truncation_is_detected_and_restore_falls_back(tmp_path, caplog):
    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5)) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    ckpt = root / "step-000000002"
    data, man = ckpt / "data-00000.bin", ckpt / "manifest.json"
    spans, size = _owner_map(ckpt)
    # Chunks do not overlap and end with the file. Between them lies alignment padding (large
    # chunks start where their memory address lies within a page, for O_DIRECT), which holds no
    # data: flips in the data file target chunk bytes, chosen uniformly over all of them.
    assert spans[-1][1] == size == data.stat().st_size
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    chunk_bytes = sum(e - s for s, e, _ in spans)
    assert chunk_bytes > 0.9 * size  # padding is a small part of the file

    def chunk_byte(k: int) -> int:
        for s, e, _ in spans:
            if k < e - s:
                return s + k
            k -= e - s
        raise AssertionError(k)
    pristine = {p: p.read_bytes() for p in (data, man)}
    rng = random.Random(1234)
    state = make_state(7)
    caplog.set_level(logging.WARNING, logger="trainguard")

    trials = failures = restores = 0
    misses: list[str] = []

    def check(kind: str, where: Path, detail: str, tensor: str | None, do_restore: bool) -> None:
        nonlocal trials, failures, restores
        trials += 1
        by_verify, by_load, msg = _detected(ckpt, state)
        ok = by_verify and by_load and where.name in msg and (tensor is None or repr(tensor) in msg)
        if do_restore and ok:
            restores += 1
            caplog.clear()
            fresh = make_state(9)
            with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as m2:
                got = m2.restore(fresh)
            logged = " ".join(r.getMessage() for r in caplog.records)
            ok = got == 1 and same_state(fresh, make_state(1)) and where.name in logged
            ok = ok and (tensor is None or repr(tensor) in logged)
        if not ok:
            failures += 1
            misses.append(f"{kind} {where.name} {detail}: verify={by_verify} load={by_load} msg={msg[:200]}")

    for i in range(FLIPS):
        target = data if i % 10 < 7 else man  # 700 flips in data, 300 in the manifest
        pos = chunk_byte(rng.randrange(chunk_bytes)) if target is data else rng.randrange(len(pristine[target]))
        mask = rng.randrange(1, 256)
        _flip(target, pos, mask)
        try:
            tensor = _tensor_at(spans, pos) if target is data else None
            check("flip", target, f"byte {pos} ^ {mask:#x}", tensor, do_restore=i % 20 == 0)
        finally:
            target.write_bytes(pristine[target])

    for i in range(TRUNCATIONS):
        target = data if i % 2 == 0 else man
        n = rng.randrange(len(pristine[target]))
        os.truncate(target, n)
        try:
            check("truncate", target, f"to {n} bytes", None, do_restore=i % 10 == 0)
        finally:
            target.write_bytes(pristine[target])

    # The pristine checkpoint still loads: the detector is not simply "always fail".
    assert tg.verify(ckpt).ok
    tg.load(ckpt, state)
    assert same_state(state, make_state(2))
    print(f"corruption: trials={trials} failures={failures} restores={restores}")
    assert trials == FLIPS + TRUNCATIONS
    assert failures == 0, "\n".join(misses[:20])


def test_manifest_tail_edits_are_detected(tmp_path):
    """The manifest's last bytes: a newline turned into other whitespace, or cut off, is a
    changed file and must not pass as intact (random flips rarely land there)."""
    tg.save(tmp_path / "ck", make_state(3))
    man = tmp_path / "ck" / "manifest.json"
    good = man.read_bytes()
    assert good.endswith(b"}\n")
    edits = [good[:-1], good[:-1] + b" ", good[:-1] + b"\r", good[:-1] + b"\t", good + b"\n", good + b"x"]
    edits += [good[:-1] + bytes([good[-1] ^ m]) for m in (0x06, 0x07, 0x2A, 0x03, 0x01)]
    state = make_state(8)
    for data in edits:
        man.write_bytes(data)
        by_verify, by_load, msg = _detected(tmp_path / "ck", state)
        assert by_verify and by_load and "manifest.json" in msg, data[-4:]
    man.write_bytes(good)
    assert tg.verify(tmp_path / "ck").ok


def test_reliability_doc_example_runs(tmp_path, monkeypatch):
    """The example in docs/reliability.md runs as written (flip, verify names it, restore falls back)."""
    import re

    doc = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, str(doc), "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "ckpts" / "rel" / "step-000000001").exists()
