"""Hostile checkpoints found by a review of SECURITY.md's promises against the code: each case
is built here from a real checkpoint whose manifest is edited and re-checksummed (so the
validator and the read paths are reached, not only the checksum)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.consolidate import consolidate
from trainguard.convert import convert
from trainguard.errors import CorruptCheckpointError
from trainguard.export import export
from trainguard.manifest import checksum

DATA = "data-00000.bin"


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 8, generator=g), "b": torch.randn(4, generator=g)}, "progress": tg.StateDict(step=seed)}


def _ckpt(tmp_path: Path) -> tuple[Path, dict]:
    d = tmp_path / "run" / "step-000000005"
    tg.save(d, _state(5))
    return d, json.loads((d / "manifest.json").read_bytes())["manifest"]


def _write(d: Path, body: dict | bytes) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    (d / "manifest.json").write_bytes(b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n")


def _bounded_empty(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """``torch.empty`` refuses (AssertionError) any allocation above ``limit`` bytes."""
    real = torch.empty

    def empty(*size: Any, **k: Any) -> torch.Tensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        n = math.prod(int(x) for x in dims) * (k.get("dtype") or torch.get_default_dtype()).itemsize
        assert n <= limit, f"allocation of {n} bytes for a checkpoint of a few KB"
        return real(*size, **k)

    monkeypatch.setattr(torch, "empty", empty)


# ----------------------------------------------------------------------------- allocation before the size check


@pytest.mark.parametrize("how", ["export_safetensors", "export_pt", "convert", "consolidate"])
def test_offline_readers_check_file_sizes_before_allocating(tmp_path, monkeypatch, how):
    """A manifest claiming a 16 GiB tensor in a file it says holds 16 GiB (the file holds 2 KB):
    export, convert and consolidate allocated the tensor before looking at the file (a raw
    RuntimeError from the allocator, or 16 GiB of address space); a load refuses it first."""
    d, body = _ckpt(tmp_path)
    n = 1 << 34
    body["files"][DATA] += n
    body["tensors"]["model/w"] = {
        "dtype": "float32", "shape": [1 << 16, 1 << 16],
        "chunks": [[[0, 0], [1 << 16, 1 << 16], DATA, body["files"][DATA] - n, n, ["0" * 16] * (n // body["block_size"])]],
    }
    _write(d, body)
    _bounded_empty(monkeypatch, 1 << 20)
    run = {
        "export_safetensors": lambda: export(d, tmp_path / "w.safetensors"),
        "export_pt": lambda: export(d, tmp_path / "w.pt"),
        "convert": lambda: convert(d, tmp_path / "c.safetensors"),
        "consolidate": lambda: consolidate(d, tmp_path / "full" / "step-000000005"),
    }[how]
    with pytest.raises(CorruptCheckpointError, match="bytes on disk"):
        run()


# ----------------------------------------------------------------------------- JSON that is not JSON


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(tmp_path, literal):
    """``json.loads`` accepts ``NaN``/``Infinity``, which trainguard never writes (non-finite
    floats are ``{"$float": ...}``). One in a skeleton loaded, and made ``consolidate`` fail with
    a raw ValueError when it wrote the skeleton back (``allow_nan=False``)."""
    d, body = _ckpt(tmp_path)
    body["objects"]["progress"]["skeleton"]["step"] = "@"
    _write(d, json.dumps(body, separators=(",", ":")).replace('"@"', literal).encode())
    with pytest.raises(CorruptCheckpointError, match="invalid JSON"):
        tg.load(d, _state(1))
    assert not tg.verify(d).ok
    with pytest.raises(CorruptCheckpointError, match="invalid JSON"):
        consolidate(d, tmp_path / "full" / "step-000000005")


# ----------------------------------------------------------------------------- names shown by the CLI


@pytest.mark.parametrize("name", ["[/x]", "[bold]w", "w\\", "w\x1b[2J\x1b]0;t\x07"])
def test_cli_shows_hostile_names_verbatim(tmp_path, name):
    """Entry and tensor names, library strings and error messages that quote a manifest went to
    rich as markup: ``[/x]`` made ``inspect``, ``ls`` and ``verify`` end in a MarkupError
    traceback, and an escape sequence reached the terminal."""
    from click.testing import CliRunner

    from trainguard.cli import main

    d, body = _ckpt(tmp_path)
    body["objects"][name] = body["objects"].pop("model")
    body["objects"][name]["skeleton"] = {name: {"$t": "model/w"}, "b": {"$t": "model/b"}}
    body["library"] = name
    _write(d, body)
    bad = tmp_path / "run" / "step-000000006"
    bad.mkdir()
    _write(bad, {**body, "files": {name: 1}})  # its error message quotes the name
    runner = CliRunner()
    shown = name.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    for args, code in ((["inspect", str(d)], 0), (["ls", str(d.parent)], 0), (["verify", str(bad)], 1), (["verify", str(d.parent)], 1)):
        r = runner.invoke(main, args, terminal_width=300)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.output)
        assert r.exit_code == code, (args, r.output)
        assert "\x1b" not in r.output and "\x07" not in r.output, args
        if args[0] == "inspect":
            assert f"── {shown}\n" in r.output  # the entry, as named
        if args[0] == "verify" and args[1] == str(bad):
            assert f"{shown[:40]}" in r.output


# ----------------------------------------------------------------------------- chunk tables that cost quadratic time


class _LineBudget:
    """Counts the lines run in trainguard's modules (``sys.settrace``); raises AssertionError in
    the traced code past ``limit``, so that quadratic work fails quickly instead of running on."""

    def __init__(self, limit: int) -> None:
        self.limit, self.lines = limit, 0
        self.root = str(Path(tg.__file__).parent)

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines > self.limit:
                raise AssertionError(f"more than {self.limit} lines of trainguard run")
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        return self._local if frame.f_code.co_filename.startswith(self.root) else None

    def __enter__(self) -> _LineBudget:
        import sys

        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        import sys

        sys.settrace(None)


def _staircase(n: int, fname: str = DATA) -> tuple[list, int]:
    """Chunks tiling an ``[n, n]`` uint8 tensor column by column: rows ``[0, i)`` and ``[i, n)`` of
    column ``i``, so the long lower parts all overlap each other along dim 0 (and the short
    upper parts along dim 1 are disjoint from them only through dim 1)."""
    chunks, pos = [], 0
    for i in range(n):
        for off, size in (((0, i), (i, 1)), ((i, i), (n - i, 1))):
            if size[0]:
                chunks.append([list(off), list(size), fname, pos, size[0], ["0" * 16]])
                pos += size[0]
    return chunks, pos


def test_chunk_table_is_validated_in_time_linear_in_its_size(tmp_path):
    """A 2,000-chunk staircase (a 130 KB manifest) cost the overlap sweep 2 million box
    comparisons (a 575 KB one: 25 s, 6 MB: hours) in every load, verify, ls and restore. The
    tiling check is linear: a budget of lines run per chunk, not a clock, says so."""
    from trainguard.manifest import parse

    d, body = _ckpt(tmp_path)
    chunks, size = _staircase(1000)
    body["block_size"] = 1 << 30
    body["files"] = {DATA: size}
    body["tensors"] = {"x": {"dtype": "uint8", "shape": [1000, 1000], "chunks": chunks}}
    body["objects"] = {"x": {"skeleton": {"$t": "x"}}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    data = b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n"
    with _LineBudget(100 * len(chunks)):
        m = parse(data)
    assert len(m.tensors["x"].chunks) == len(chunks)
    chunks[-1][0][0] -= 1  # the last element's chunk moved up a row: it overlaps, (999, 999) is a gap
    _write(d, body)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        tg.load(d, {"x": torch.empty(1000, 1000, dtype=torch.uint8)})


def test_tiling_check_matches_brute_force():
    """``planner.tiles`` (corners) and its fallback sweep against counting every element."""
    import itertools
    import random

    from trainguard.planner import _sweep, tiles

    rng = random.Random(7)
    for _ in range(3000):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:  # a grid, sometimes with a box twice or one missing
            cuts = [sorted({0, n} | {rng.randint(0, n) for _ in range(2)}) for n in shape]
            boxes = [([c[i] for c, i in zip(cuts, ix)], [c[i + 1] - c[i] for c, i in zip(cuts, ix)])
                     for ix in itertools.product(*[range(len(c) - 1) for c in cuts])]
            if rng.random() < 0.3:
                boxes.append(rng.choice(boxes))
            if rng.random() < 0.3 and len(boxes) > 1:
                boxes.pop(rng.randrange(len(boxes)))
        else:
            boxes = []
            for _ in range(rng.randint(1, 6)):
                o = [rng.randint(0, n - 1) for n in shape]
                boxes.append((o, [rng.randint(1, n - a) for a, n in zip(o, shape)]))
        count: dict[tuple, int] = {}
        for o, s in boxes:
            for ix in itertools.product(*[range(a, a + b) for a, b in zip(o, s)]):
                count[ix] = count.get(ix, 0) + 1
        want = len(count) == math.prod(shape) and all(v == 1 for v in count.values())
        assert tiles(boxes, shape) is want, (shape, boxes)
        if sum(math.prod(s) for _o, s in boxes) == math.prod(shape):
            assert _sweep(boxes, 1 << 30) is want, (shape, boxes)


def test_consolidate_cli_prints_names_without_escape_sequences(tmp_path):
    """``trainguard consolidate`` lists each tensor it writes; a name holding an escape sequence
    went to the terminal as is (click.echo does not escape)."""
    from click.testing import CliRunner

    import trainguard as tg
    from trainguard.cli import main

    name = "w\x1b[2J\x1b]0;t\x07"
    tg.save(tmp_path / "run" / "step-000000001", {"m": {name: torch.arange(4.0)}})
    r = CliRunner().invoke(main, ["consolidate", str(tmp_path / "run" / "step-000000001"), str(tmp_path / "full")])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output
    assert "m/w\\x1b[2J\\x1b]0;t\\x07" in r.output


def test_printed_names_escape_bidirectional_overrides():
    """A name with U+202E (right-to-left override) reorders what the terminal shows after it."""
    from trainguard.commands import printable

    assert printable("w\u202egpj.exe\x1b") == "w\\u202egpj.exe\\x1b"
