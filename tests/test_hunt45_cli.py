"""Session 45's hunt through the `trainguard` command line: each test runs the command (in a
process of its own, or in this one through click's CliRunner: ``_cli_here``) on real files and
fails on the code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "trainguard", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _cli_here(monkeypatch: pytest.MonkeyPatch, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``_cli`` in this process (click's CliRunner, in ``cwd``): the same command, its exit status,
    stdout and stderr, without a child that imports torch (about 2 s each). For a command's refusals
    and conversions; what needs a process of its own (a launcher, a signal) stays with ``_cli``."""
    try:
        runner = CliRunner(mix_stderr=False)  # click 8.1: stderr apart from stdout
    except TypeError:
        runner = CliRunner()  # click 8.2: always apart
    monkeypatch.chdir(cwd)
    r = runner.invoke(main, list(args), prog_name="trainguard")
    err = r.stderr
    if r.exc_info is not None and not isinstance(r.exception, SystemExit):  # what Python prints before exit 1
        err += "".join(traceback.format_exception(*r.exc_info))
    return subprocess.CompletedProcess(["trainguard", *args], r.exit_code, r.stdout, err)


def _run_dir(tmp_path: Path, extra: list[dict] | None = None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    ev = [{"t": 100.0 + s, "event": "step", "rank": 0, "pid": 7, "step": s} for s in range(12)]
    ev.append({"t": 110.5, "event": "save", "rank": 0, "pid": 7, "step": 10, "stall_s": 0.1, "duration_s": 0.4, "bytes": 64})
    lines = [json.dumps(e) for e in ev + (extra or [])]
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_report_json_with_plot_keeps_stdout_json(tmp_path: Path) -> None:
    """`report --json --plot P` printed "timeline written to P" on stdout after the JSON: a script's
    json.loads(stdout) failed. The line goes to stderr with --json; the plot is written."""
    run = _run_dir(tmp_path)
    res = _cli("report", str(run), "--json", "--plot", str(tmp_path / "t.png"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["final_step"] == 11
    assert "timeline written to" in res.stderr
    assert (tmp_path / "t.png").stat().st_size > 0


def test_report_plot_unknown_suffix_is_one_error_line_before_the_summary(tmp_path: Path) -> None:
    """`report RUN --plot timeline.txt` printed the summary, then matplotlib's ValueError as a
    traceback (exit 1). Now one `error:` line naming the suffixes it can write, exit 2, nothing on
    stdout; a missing directory is refused the same way, before the summary."""
    run = _run_dir(tmp_path)
    res = _cli("report", str(run), "--plot", str(tmp_path / "timeline.txt"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: ") and ".png" in res.stderr and len(res.stderr.splitlines()) == 1
    assert res.stdout == "" and not (tmp_path / "timeline.txt").exists()
    res = _cli("report", str(run), "--plot", str(tmp_path / "nodir" / "t.png"), cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "" and "does not exist" in res.stderr


def test_report_plot_without_suffix_names_the_file_written(tmp_path: Path) -> None:
    """`--plot timeline` (no suffix): matplotlib writes timeline.png; the command said it wrote
    `timeline`, a file that does not exist."""
    run = _run_dir(tmp_path)
    res = _cli("report", str(run), "--plot", "timeline", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    said = res.stdout.strip().splitlines()[-1].removeprefix("timeline written to ")
    assert (tmp_path / said).is_file()


def test_report_plot_of_a_save_event_without_step(tmp_path: Path) -> None:
    """A `save` line without an int `step` (another tool's log, a hand-edited line) raised KeyError
    in the timeline plot (a traceback): read_events skips it, as it does such `step`/`restore` lines."""
    run = _run_dir(tmp_path, [{"t": 111.0, "event": "save", "rank": 0, "pid": 7},
                              {"t": 111.5, "event": "save", "rank": 0, "pid": 7, "step": "x"},
                              {"t": 111.7, "event": "save", "rank": 0, "pid": 7, "step": 11, "committed_t": "soon"}])
    res = _cli("report", str(run), "--plot", str(tmp_path / "t.png"), cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "1 saves" in res.stdout and (tmp_path / "t.png").is_file()


def test_consolidate_sigterm_removes_its_temporary_directory(tmp_path: Path) -> None:
    """SIGTERM (`timeout`, `kill PID`, a scheduler's stop) mid-consolidate ended the process at
    once (Python's default) and left DST's `NAME.tmp-<id>` directory with a whole data file in it:
    a checkpoint's worth of disk, never cleaned. It is now unwound as a Ctrl-C is: the temporary
    directory is removed, exit 143, one `terminated:` line. No timing: the progress lines fill the
    stdout pipe the test does not read, so the command is blocked mid-consolidation when signalled."""
    import signal

    import torch

    import trainguard as tg

    src = tmp_path / "run" / "step-000000004"
    tg.save(src, {"model": {f"block{i:04d}.attention.query_key_value.weight_with_a_long_name": torch.full((4,), float(i))
                            for i in range(3000)}})
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "consolidate", str(src), str(out / "c")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip()  # the first tensor is written
        assert [p.name for p in out.iterdir()][0].startswith("c.tmp-")  # blocked on the full pipe, mid-write
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert b"terminated:" in err and b"Traceback" not in err
    assert list(out.iterdir()) == []
    res = _cli("verify", str(src), cwd=tmp_path)  # the source untouched
    assert res.returncode == 0, res.stdout + res.stderr


def test_convert_between_two_trainguard_directories_says_what_to_change(tmp_path: Path) -> None:
    """`convert ckpts/run1/step-000000007 out` (DST without a file suffix: a trainguard directory)
    said "convert trainguard -> trainguard: one side must be a trainguard checkpoint": both are.
    Now it says to name DST .safetensors/.pt or to use consolidate; nothing is written."""
    import torch

    import trainguard as tg

    src = tmp_path / "run" / "step-000000007"
    tg.save(src, {"model": {"w": torch.ones(3)}})
    res = _cli("convert", str(src), "weights", cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    assert ".safetensors" in res.stderr and "trainguard consolidate" in res.stderr, res.stderr
    assert not (tmp_path / "weights").exists()


def test_doctor_of_a_binary_file_names_no_line_none(tmp_path: Path) -> None:
    """`doctor model.bin` (a file with NUL bytes, passed by mistake) said "(line None: source code
    string cannot contain null bytes)"; the line is left out when Python gives none."""
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01binary\x00")
    res = _cli("doctor", "weights.bin", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: weights.bin is not valid Python 3")
    assert "None" not in res.stderr and "null bytes" in res.stderr, res.stderr
    (tmp_path / "bad.py").write_text("x = 1\ndef f(:\n")
    res = _cli("doctor", "bad.py", cwd=tmp_path)
    assert res.returncode == 2 and "line 2" in res.stderr, res.stderr


def test_export_and_convert_take_file_urls_as_inspect_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`inspect`/`consolidate` take `file:///abs/path`; `export --to file:///x.pt` and `convert ...
    file:///x.safetensors` refused it as "an object store's URL", and `convert file:///x.safetensors
    DST` said the existing file did not exist. A file: URL is now the local file, on either side."""
    import torch

    import trainguard as tg

    src = tmp_path / "run" / "step-000000002"
    tg.save(src, {"model": {"w": torch.arange(6.0)}})
    res = _cli_here(monkeypatch, "export", f"file://{src}", "--to", f"file://{tmp_path}/w.pt", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.arange(6.0))
    res = _cli_here(monkeypatch, "convert", str(src), f"file://{tmp_path}/w.safetensors", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = _cli_here(monkeypatch, "convert", f"file://{tmp_path}/w.safetensors", str(tmp_path / "imp"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    state = {"model": {"w": torch.zeros(6)}}
    tg.load(tmp_path / "imp", state)
    assert torch.equal(state["model"]["w"], torch.arange(6.0))
    res = _cli_here(monkeypatch, "export", str(src), "--to", "s3://bucket/w.pt", cwd=tmp_path)  # an object store: still refused
    assert res.returncode == 2 and "local path only" in res.stderr
