"""review48c: fresh-eyes review of the elastic runner, planning and CLI (session 48)."""

from __future__ import annotations

import pytest

SCRIPT = "import os\nprint('trained', os.environ['RANK'], flush=True)\n"


@pytest.mark.parametrize("bad,says", [
    # torchrun refuses an item without a value; trainguard's c10d defaults merge dropped it silently
    # (the job ran with torch's join timeout, not the one meant: `join_timeout:900` is a typo of `=`)
    (["--rdzv-conf", "join_timeout:900"], "--rdzv-conf"),
    (["--rdzv-conf", "last_call_timeout=5,"], "--rdzv-conf"),
    # these reached torch's config_from_args after the run directory and agent_start: a traceback, exit 1
    (["--nnodes", "2:1"], "--nnodes"),
    (["--nnodes", "0"], "--nnodes"),
    (["--nnodes", "1:2:3"], "--nnodes"),
    (["--nnodes", "x"], "--nnodes"),
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--nproc-per-node", "foo"], "--nproc-per-node"),
    (["--nproc-per-node", "0"], "--nproc-per-node"),
])
def test_run_refuses_bad_launcher_arguments_before_starting(tmp_path, capsys, bad, says):
    """``trainguard run``'s main with launcher arguments torchrun refuses: one ``error:`` line, exit 2,
    before the run directory (and its agent_start event) exists and before any worker runs. The
    old code ran the job (--rdzv-conf) or raised torch's AssertionError/ValueError from run()."""
    from trainguard.elastic.launcher import main

    (tmp_path / "t.py").write_text(SCRIPT)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["--nproc-per-node", "1", *bad, "--run-dir", str(run_dir), str(tmp_path / "t.py")])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], err
    assert not run_dir.exists()


def test_run_still_accepts_what_torchrun_accepts():
    """Spaces around an --rdzv-conf key and value, --nnodes N and MIN:MAX, --max-restarts 0, cpu: no refusal."""
    from trainguard.elastic.args import check
    from trainguard.elastic.launcher import build_parser

    for argv in (["--rdzv-conf", " join_timeout = 60 ,is_host=false", "--nnodes", "1:4", "--max-restarts", "0"],
                 ["--nnodes", "3", "--nproc-per-node", "cpu", "--rdzv-conf", ""]):
        check(build_parser().parse_args([*argv, "t.py"]))
