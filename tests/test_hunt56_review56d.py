"""Session 56's hostile review of the ``trainguard`` command line (review56d): the commands run on
real checkpoints, broken ones too (a flipped byte, a truncated or missing data file), and on URLs of
hosts that do not answer. Each test fails on the code before its fix."""

from __future__ import annotations

import functools
import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main


def _run(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, prog_name="trainguard")


def _run_dir(root: Path, steps: tuple[int, ...] = (10, 20)) -> None:
    for s in steps:
        tg.save(root / f"step-{s:09d}", {"model": tg.StateDict(w=torch.arange(64.0) + s)})


def _flip(step_dir: Path) -> None:
    """One byte of the tensor's data flipped (its block's checksum fails)."""
    data = step_dir / "data-00000.bin"
    b = bytearray(data.read_bytes())
    b[3] ^= 0xFF
    data.write_bytes(bytes(b))


@pytest.mark.parametrize("cmd", ["export", "convert", "convert-dcp", "consolidate"])
def test_a_corrupt_source_is_named_with_what_to_use_instead(tmp_path: Path, cmd: str) -> None:
    """``export``/``convert``/``consolidate`` of a step whose block fails its checksum said only
    ``error: data-00000.bin: checksum mismatch in tensor 'model/w' (bytes 0..256): the checkpoint is
    corrupt``: which checkpoint of which run, and what to do, was the user's to find out. Now the
    error names the step directory and its step, and the earlier steps with ``trainguard verify``.
    ``convert --to dcp`` said "cannot write OUT as dcp: CorruptCheckpointError: ..." (the source's
    fault told as the output's)."""
    run = tmp_path / "run"
    _run_dir(run)
    bad = run / "step-000000020"
    _flip(bad)
    args = {"export": ("export", bad, "--to", tmp_path / "w.safetensors"),
            "convert": ("convert", bad, tmp_path / "w.pt"),
            "convert-dcp": ("convert", bad, tmp_path / "out_dcp", "--to", "dcp"),
            "consolidate": ("consolidate", bad, tmp_path / "full")}[cmd]
    r = _run(*args)
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: "), r.output
    assert f"{bad}/data-00000.bin (checkpoint of step 20): checksum mismatch" in line, line
    assert "holds step 10" in line and f"`trainguard verify {run}`" in line, line
    assert "cannot write" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written beside it


def test_a_truncated_data_file_says_which_earlier_steps_to_try(tmp_path: Path) -> None:
    """A truncated data file was named with its path, and nothing to do: now the earlier steps follow."""
    run = tmp_path / "run"
    _run_dir(run, (10, 20, 30))
    data = run / "step-000000030" / "data-00000.bin"
    data.write_bytes(data.read_bytes()[:50])
    r = _run("export", run / "step-000000030", "--to", tmp_path / "w.pt")
    assert r.exit_code == 2, r.output
    assert "truncated" in r.output and "holds steps 20, 10" in r.output, r.output


@pytest.mark.parametrize("cmd", ["export", "convert", "consolidate"])
def test_closing_lines_count_in_the_singular(tmp_path: Path, cmd: str) -> None:
    """"converted 1 tensors", "wrote 1 tensors", "consolidated 1 tensors, ... (saved by 1 ranks)"."""
    src = tmp_path / "step-000000001"
    tg.save(src, {"model": tg.StateDict(w=torch.ones(3))})
    args = {"export": ("export", src, "--to", tmp_path / "w.pt"),
            "convert": ("convert", src, tmp_path / "w.safetensors"),
            "consolidate": ("consolidate", src, tmp_path / "full", "-q")}[cmd]
    r = _run(*args)
    assert r.exit_code == 0, r.output
    out = r.output
    assert "1 tensors" not in out and "1 ranks" not in out, out
    assert {"export": "wrote 1 tensor to", "convert": "converted 1 tensor:",
            "consolidate": "consolidated 1 tensor, "}[cmd] in out, out
    if cmd == "consolidate":
        assert "(saved by 1 rank)" in out, out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cmd", ["ls", "verify", "inspect", "export"])
def test_an_unreachable_http_host_is_not_told_as_absence(tmp_path: Path, cmd: str) -> None:
    """``trainguard ls http://HOST/run`` with HOST down (refused here; a DNS failure alike) said
    "no such directory": fsspec's HTTP filesystem answers ``exists`` False for any client error, so a
    server that is down read as a path mistyped. Now the error says the store could not be reached."""
    pytest.importorskip("aiohttp")
    url = f"http://127.0.0.1:{_closed_port()}/run"
    args = {"ls": ("ls", url), "verify": ("verify", url), "inspect": ("inspect", url + "/step-000000010"),
            "export": ("export", url + "/step-000000010", "--to", tmp_path / "w.pt")}[cmd]
    r = _run(*args)
    assert r.exit_code == 2, r.output
    assert "no such" not in r.output, r.output
    assert "Cannot connect to host 127.0.0.1" in r.output, r.output


def test_convert_of_a_step_without_manifest_is_told_as_a_crashed_save(tmp_path: Path) -> None:
    """``convert RUN/step-N OUT.pt`` of a step directory without ``manifest.json`` (a save that crashed
    or is running) said "not a trainguard checkpoint ..., DCP directory ..., .pt ...; pass the source
    format explicitly (--from)": no format flag helps. Now as ``export`` and ``inspect`` say it."""
    run = tmp_path / "run"
    _run_dir(run, (10,))
    (run / "step-000000010" / "manifest.json").unlink()
    r = _run("convert", run / "step-000000010", tmp_path / "w.pt")
    assert r.exit_code == 2, r.output
    assert "--from" not in r.output and "not a committed checkpoint" in r.output, r.output


@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_ctrl_c_of_a_reading_command_exits_130_not_verify_s_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             cmd: str) -> None:
    """Ctrl-C during ``verify`` (or ``ls --verify``) ended in click's "Aborted!", exit 1: ``verify``'s
    code for a checkpoint that failed, so a script took the interrupted check for corruption. Now one
    ``interrupted:`` line and 130, as ``convert``/``export``/``consolidate`` exit."""
    import trainguard.inspect as tgi

    run = tmp_path / "run"
    _run_dir(run, (10,))

    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tgi, "verify", interrupted)
    monkeypatch.setattr(tgi, "list_checkpoints", interrupted) if cmd == "ls" else None
    r = _run(*(("verify", run) if cmd == "verify" else ("ls", "--verify", run)))
    assert r.exit_code == 130, r.output
    assert f"interrupted: `trainguard {cmd}` stopped before it finished" in r.output, r.output
    assert "Aborted" not in r.output, r.output


def test_convert_into_a_directory_named_like_a_file_names_the_destination(tmp_path: Path) -> None:
    """``convert CKPT out.pt`` where ``out.pt`` is a directory said "error: .../.out.pt.tmp-<id>: Is a
    directory": a temporary name the user never gave. Now as ``export`` says it."""
    src = tmp_path / "step-000000001"
    tg.save(src, {"model": tg.StateDict(w=torch.ones(3))})
    (tmp_path / "out.pt").mkdir()
    r = _run("convert", src, tmp_path / "out.pt")
    assert r.exit_code == 2, r.output
    assert f"{tmp_path / 'out.pt'} is a directory" in r.output and ".tmp-" not in r.output, r.output


def test_a_run_directory_of_one_step_is_not_told_one_of_its_1_step_directories(tmp_path: Path) -> None:
    """``inspect RUN`` of a run directory holding one step said "pass one of its 1 step directories
    (`trainguard ls RUN` shows which are valid)"."""
    run = tmp_path / "run"
    _run_dir(run, (10,))
    r = _run("inspect", run)
    assert r.exit_code == 2, r.output
    assert "pass its step directory" in r.output and "shows whether it is valid" in r.output, r.output


def test_verify_of_a_checkpoint_s_data_file_names_its_checkpoint(tmp_path: Path) -> None:
    """``verify RUN/step-N/data-00000.bin`` said "is a file; pass a run directory (the one holding step-*
    directories)", though verify takes the checkpoint the file belongs to (``inspect`` names it)."""
    run = tmp_path / "run"
    _run_dir(run, (10,))
    r = _run("verify", run / "step-000000010" / "data-00000.bin")
    assert r.exit_code == 2, r.output
    assert f"is a file of the checkpoint {run / 'step-000000010'}: pass that directory" in r.output, r.output


def serve(www: Path, handler: type) -> Iterator[str]:
    """``www`` served on 127.0.0.1 by ``handler`` (a ``SimpleHTTPRequestHandler``) until the generator is
    closed; yields its URL. The fixtures of this file and of test_hunt56_review56j."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(www)))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=30)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def http_root(tmp_path: Path):
    """An HTTP server on 127.0.0.1 serving ``tmp_path / "www"`` (read-only, as any plain web server); its URL."""
    www = tmp_path / "www"
    www.mkdir()
    yield from serve(www, _Quiet)


@pytest.mark.parametrize("cmd", ["consolidate", "convert"])
def test_writing_to_an_http_url_is_refused_as_read_only(tmp_path: Path, http_root: str, cmd: str) -> None:
    """``consolidate CKPT http://HOST/x`` ended in fsspec's NotImplementedError traceback (exit 1), ``convert
    w.pt http://HOST/x/step-000000001`` in "save of ... failed: NotImplementedError: " after a warning that it
    "could not remove" the step: fsspec's HTTP filesystem cannot write. Now one line saying it is read-only."""
    pytest.importorskip("aiohttp")
    src = tmp_path / "step-000000001"
    tg.save(src, {"model": tg.StateDict(w=torch.ones(3))})
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    args = (("consolidate", src, f"{http_root}/full") if cmd == "consolidate" else
            ("convert", tmp_path / "w.pt", f"{http_root}/imp/step-000000001"))
    r = _run(*args)
    assert r.exit_code == 2, r.output
    assert "an http(s):// URL is read-only" in r.output and "NotImplementedError" not in r.output, r.output


def test_an_http_run_directory_is_listed_and_a_missing_one_is_absent(tmp_path: Path, http_root: str) -> None:
    """The strict ``exists`` of an HTTP URL still reads a served run directory, and a 404 is still absence."""
    pytest.importorskip("aiohttp")
    _run_dir(tmp_path / "www" / "run", (10,))
    r = _run("verify", f"{http_root}/run")
    assert r.exit_code == 0 and "OK" in r.output, r.output
    r = _run("ls", f"{http_root}/nope")
    assert r.exit_code == 2 and "no such directory" in r.output, r.output


def _newer_format(step_dir: Path) -> None:
    """The manifest rewritten as a later trainguard's (format_version 99), its checksum made to match."""
    from trainguard.manifest import _PREFIX, checksum

    p = step_dir / "manifest.json"
    data = p.read_bytes()
    head = len(_PREFIX) + 16
    body = data[head + 13 : len(data) - 2]
    old = b'"format_version":' + body.split(b'"format_version":', 1)[1].split(b",", 1)[0]
    body = body.replace(old, b'"format_version":99', 1)
    p.write_bytes(_PREFIX + checksum(body).encode() + b'","manifest":' + body + b"}\n")


def test_a_checkpoint_of_a_newer_format_is_not_called_corrupt(tmp_path: Path) -> None:
    """A step saved by a later trainguard (a manifest format this one cannot read) was listed by ``ls`` and
    ``verify`` as ``corrupt``/``CORRUPT``: an operator cleaning up deletes corrupt checkpoints, and this one
    is whole (the error's own words say "upgrade trainguard"). Now ``newer format``; verify still fails (1)."""
    import json

    run = tmp_path / "run"
    _run_dir(run, (10, 20))
    _newer_format(run / "step-000000020")
    r = _run("ls", "--json", run)
    assert r.exit_code == 0, r.output
    assert [(x["step"], x["status"]) for x in json.loads(r.output)] == [(10, "valid"), (20, "newer format")]
    r = _run("verify", run)
    assert r.exit_code == 1, r.output
    assert "NEWER FORMAT" in r.output and "CORRUPT" not in r.output and "upgrade trainguard" in r.output, r.output
    r = _run("verify", "--json", run)
    assert [x["status"] for x in json.loads(r.output)] == ["valid", "newer format"], r.output
