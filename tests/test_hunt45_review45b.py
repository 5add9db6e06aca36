"""Session 45's review of the afternoon's merge (d5abb74): each test runs real processes on real
files and fails on that merge's code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import trainguard as tg

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), **extra}


def _terminated_when_stopped(argv: list[str], env: dict[str, str], **popen: object) -> tuple[int, str, str]:
    """Run ``argv`` until it stops itself (SIGSTOP: a fault point of ``TRAINGUARD_CRASH_KIND=stop``,
    or the test's own), send it a SIGTERM there, then continue it: the signal is handled right after
    that point. (returncode, stdout, stderr)."""
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        _, status = os.waitpid(p.pid, os.WUNTRACED)  # blocks until it stopped (or ended)
        assert os.WIFSTOPPED(status), f"{argv[2:4]} ended before it stopped: {status}"
        os.kill(p.pid, signal.SIGTERM)
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err


def _consolidate_terminated_at(point: str, src: Path, dst: Path, *flags: str) -> tuple[int, str]:
    """`trainguard consolidate SRC DST` stopped at the fault point ``point``, sent a SIGTERM there."""
    env = _env(TRAINGUARD_CRASH_AT=point, TRAINGUARD_CRASH_KIND="stop")
    rc, _, err = _terminated_when_stopped([sys.executable, "-m", "trainguard", "consolidate", str(src), str(dst), *flags], env)
    return rc, err


def test_consolidate_sigterm_after_the_rename_does_not_say_not_written(tmp_path: Path) -> None:
    """A SIGTERM handled after consolidate renamed DST into place (`after_rename`: the last step of
    the commit) said "terminated: DST was not written (its partial output is removed)", exit 143,
    while DST was whole and loadable: a rerun was then refused ("already holds a checkpoint").
    Now it says DST was written. A SIGTERM before the rename, with --overwrite of an earlier DST,
    still says "not written", and the earlier DST is left as it was."""
    src = tmp_path / "ck" / "step-000000003"
    tg.save(str(src), {"model": tg.StateDict(w=torch.arange(1000.0))})
    dst = tmp_path / "full"
    rc, err = _consolidate_terminated_at("after_rename", src, dst)
    assert rc == 143, err
    assert "was not written" not in err and "was written whole" in err, err
    got = {"model": tg.StateDict(w=torch.zeros(1000))}
    tg.load(str(dst), got)
    assert torch.equal(got["model"]["w"], torch.arange(1000.0))
    before = json.loads((dst / "manifest.json").read_bytes())
    rc, err = _consolidate_terminated_at("after_manifest", src, dst, "--overwrite")
    assert rc == 143 and "was not written" in err, err
    assert json.loads((dst / "manifest.json").read_bytes()) == before  # the earlier DST, as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "full"]  # no temporary directory left


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    ev = [{"t": 100.0 + s, "event": "step", "rank": 0, "pid": 7, "step": s} for s in range(12)]
    ev.append({"t": 110.5, "event": "save", "rank": 0, "pid": 7, "step": 10, "stall_s": 0.1, "duration_s": 0.4, "bytes": 64})
    (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in ev) + "\n")
    return run


def _report(tmp_path: Path, *args: str, pre: str = "pass") -> subprocess.CompletedProcess[str]:
    code = f"import sys; {pre}; from trainguard.cli import main; sys.argv[0] = 'trainguard'; main()"
    return subprocess.run([sys.executable, "-c", code, "report", *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)


def test_report_plot_without_matplotlib_is_one_error_line(tmp_path: Path) -> None:
    """matplotlib is no dependency of trainguard (the dev extra only). `report RUN --plot t.png` in an
    environment without it was a ModuleNotFoundError traceback (exit 1), since session 45 before the
    summary; `plan --plot` said "--plot needs matplotlib: pip install matplotlib". Now report says so
    too (exit 2). The environment without matplotlib: its import blocked (sys.modules entry None)."""
    run = _run_dir(tmp_path)
    res = _report(tmp_path, str(run), "--plot", "t.png", pre="sys.modules['matplotlib'] = None")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip() == "error: --plot needs matplotlib: pip install matplotlib"
    assert res.stdout == "" and not (tmp_path / "t.png").exists()


def test_report_plot_pgf_without_latex_is_refused_before_the_summary(tmp_path: Path) -> None:
    """`--plot t.pgf` passed the suffix check (.pgf was even offered in its list of suffixes), then,
    after the summary, matplotlib's pgf backend raised RuntimeError "'xelatex' not found" (a
    traceback, exit 1). Where the TeX program is missing it is now one error line before the summary."""
    import shutil

    import matplotlib

    run = _run_dir(tmp_path)
    res = _report(tmp_path, str(run), "--plot", "t.pgf")
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is not None:  # LaTeX here: the .pgf is written
        assert res.returncode == 0 and (tmp_path / "t.pgf").stat().st_size > 0, res.stderr
        return
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: --plot t.pgf: a .pgf file needs") and res.stdout == ""
    res = _report(tmp_path, str(run), "--plot", "t.v2")
    assert res.returncode == 2 and ".pdf" in res.stderr and ".pgf" not in res.stderr, res.stderr


STOP_IN_DCP_WRITE = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as fs
write = fs._write_item

def stopped_after_one(*args, **kwargs):  # DCP's data file begun: stop here, the test sends SIGTERM
    out = write(*args, **kwargs)
    fs._write_item = write
    os.kill(os.getpid(), signal.SIGSTOP)
    return out

fs._write_item = stopped_after_one
from trainguard.cli import main
sys.argv[0] = "trainguard"
main(prog_name="trainguard")
"""


def test_convert_to_dcp_sigterm_is_terminated_not_a_dcp_error(tmp_path: Path) -> None:
    """A SIGTERM while `convert SRC DST --to dcp` wrote (DCP's first item written): DCP turns every
    exception, the interrupt too, into its CheckpointException, and the zip writer torch.save was in
    failed on the way out; foreign_errors reported that: "error: cannot write DST as dcp:
    RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", exit 2.
    Now the interrupt is raised as it is: "terminated: DST was not written", exit 143, no temporary
    directory left. The child stops itself (SIGSTOP) after DCP's first item; the SIGTERM is handled
    when it continues."""
    src = tmp_path / "ck" / "step-000000001"
    tg.save(str(src), {"model": tg.StateDict(**{f"w{i:02d}": torch.full((1 << 16,), float(i)) for i in range(24)})})
    dst = tmp_path / "out_dcp"
    rc, _, err = _terminated_when_stopped(
        [sys.executable, "-c", STOP_IN_DCP_WRITE, "convert", str(src), str(dst), "--to", "dcp"], _env())
    assert rc == 143, err
    assert err.startswith("terminated: ") and "was not written" in err and "RuntimeError" not in err, err
    assert sorted(d.name for d in tmp_path.iterdir()) == ["ck"]


def test_consolidate_with_sigterm_ignored_by_its_parent_goes_on(tmp_path: Path) -> None:
    """A command started with SIGTERM ignored (`trap '' TERM` in the script that runs it, a launcher
    that keeps its children through its own shutdown) ignored it before session 45; the SIGTERM
    handler of consolidate/convert/export replaced the inherited SIG_IGN, and a SIGTERM then ended
    it: exit 143, DST not written. An ignored SIGTERM stays ignored (as Python leaves an ignored
    SIGINT): the consolidation completes."""
    src = tmp_path / "ck" / "step-000000003"
    tg.save(str(src), {"model": tg.StateDict(w=torch.arange(1000.0))})
    dst = tmp_path / "full"
    env = _env(TRAINGUARD_CRASH_AT="after_manifest", TRAINGUARD_CRASH_KIND="stop")
    rc, out, err = _terminated_when_stopped(
        [sys.executable, "-m", "trainguard", "consolidate", str(src), str(dst)], env,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))  # inherited by exec
    assert rc == 0 and "consolidated 1 tensor," in out, err
    got = {"model": tg.StateDict(w=torch.zeros(1000))}
    tg.load(str(dst), got)
    assert torch.equal(got["model"]["w"], torch.arange(1000.0))
