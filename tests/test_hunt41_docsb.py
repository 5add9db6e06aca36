"""Claims of docs/elastic.md, docs/distributed.md and examples/ checked against what the code does
(session 41's documentation audit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.commit import read_manifest
from trainguard.storage import for_path


@pytest.mark.parametrize("bad", [[1], None, "abc"], ids=["list", "None", "str"])
@pytest.mark.parametrize("policy", ["steps", "seconds"])
def test_manager_save_of_a_state_that_is_no_mapping_is_a_permanent_bad_argument(tmp_path, bad, policy):
    """docs/elastic.md, "Errors a restart will not fix": a bad argument such as "a state that is no
    mapping" exits 78. tg.save/tg.load/restore refused it so (UnsupportedValueError); the manager's
    save, on a step that saves and on one that does not, failed in gradwatch with
    ``AttributeError: 'list' object has no attribute 'values'`` (exit 1: restarted, requeued)."""
    save = tg.EveryNSteps(10) if policy == "steps" else tg.EverySeconds(3600)
    with tg.CheckpointManager(tmp_path / "run", save=save) as mgr:
        for step, force in ((1, False), (2, True)):
            with pytest.raises(tg.UnsupportedValueError, match="state must be a dict of named entries") as err:
                mgr.save(step, bad, force=force)
            assert tg.exit_code_for(err.value) == 78
        mgr.save(3, {"w": torch.ones(2)}, force=True)  # the manager goes on with a good state
        assert mgr.last_saved_step == 3


_HOOKED = r"""
import inspect, sys
import torch.distributed.elastic.agent.server.api, torch.distributed.elastic.agent.server.local_elastic_agent
import torch.distributed.elastic.multiprocessing.api
import torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler
import torch.multiprocessing.spawn
names = ["torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.agent.server.local_elastic_agent",
         "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn",
         "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"]
targets = {}
for name in names:
    m = sys.modules[name]
    targets[name.rsplit(".", 1)[1]] = m
    targets.update({n: o for n, o in vars(m).items() if inspect.isclass(o) and o.__module__ == name})
before = {k: dict(vars(o)) for k, o in targets.items()}
from trainguard.elastic.launcher import install_agent_hooks
from trainguard.events import EventLog
install_agent_hooks(EventLog(None), 5.0)
for k, o in targets.items():
    for n, v in vars(o).items():
        if n in before[k] and before[k][n] is not v and not n.startswith(("_tg", "_trainguard")):
            print(k, n)
"""


def test_known_limits_name_every_torch_internal_that_trainguard_run_replaces():
    """docs/elastic.md, "Known limits", lists the torch internals ``trainguard run`` replaces (a torch
    release renaming one breaks it). It said "four methods of LocalElasticAgent, ProcessContext.join
    and MultiprocessContext._close (launcher.py)"; the agent also replaces LocalElasticAgent._shutdown
    and _stop_workers, SubprocessContext._poll/_close (reap.py), SubprocessHandler.close (spare.py),
    and the multiprocessing api's _wrap and _terminate_process_handler."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _HOOKED], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stderr
    replaced = [line.split() for line in out.stdout.splitlines()]
    assert ["ProcessContext", "join"] in replaced and ["LocalElasticAgent", "_shutdown"] in replaced
    text = (root / "docs" / "elastic.md").read_text()
    start = text.index("- `trainguard run` wraps", text.index("## Known limits"))
    item = " ".join(text[start:text.index("\n- ", start)].split())
    for owner, attr in replaced:
        assert attr in item, f"{owner}.{attr} is replaced by trainguard run but not named in Known limits"
        assert owner in item or owner == "api", f"{owner} ({attr}) not named in Known limits"
    for module in ("agenthooks.py", "reap.py", "spare.py"):  # agenthooks.py: launcher.py's hooks since split58
        assert module in item
        assert "orig" in (root / "src" / "trainguard" / "elastic" / module).read_text()  # it does wrap torch's


def test_ddp_example_spreads_the_replicated_state_over_the_ranks(tmp_path):
    """examples/ddp_torchrun.py's docstring said "rank 0 writes the replicated weights once"; as
    docs/distributed.md says, the replicated tensors are written once in total, spread over the
    ranks: in its checkpoint rank 1's file holds some of the model and of SGD's momentum."""
    from test_examples import EX, _torchrun

    assert "rank 0\nwrites the replicated" not in (EX / "ddp_torchrun.py").read_text()
    _torchrun("ddp_torchrun.py", "--dir", str(tmp_path / "a"), "--steps", "4")
    storage, d = for_path(str(tmp_path / "a" / "step-000000003"))
    m = read_manifest(storage, d)
    files = {name: {c.file for c in t.chunks} for name, t in m.tensors.items() if not name.startswith("rng")}
    assert all(len(f) == 1 for f in files.values())  # written once
    by_file = {f: sorted(n for n, fs in files.items() if f in fs) for f in ("data-00000.bin", "data-00001.bin")}
    assert all(by_file.values()), by_file  # by both ranks


def test_consolidate_help_gives_the_batch_bound_not_the_largest_tensor(tmp_path):
    """``trainguard consolidate --help`` said "Memory use is bounded by the largest tensor"; it reads
    and writes batches of up to 256 MiB (docs/distributed.md, "Full (consolidated) checkpoints"):
    200 tensors of 1 MiB raised its peak RSS by ~207 MiB: one batch holds 256 of them."""
    from click.testing import CliRunner

    from trainguard import consolidate as cons
    from trainguard.cli import main

    text = " ".join(CliRunner().invoke(main, ["consolidate", "--help"]).output.split())
    assert "bounded by the largest tensor" not in text and "up to 256 MiB" in text
    mib = 1 << 20
    assert cons._groups([i * mib for i in range(300)], [mib] * 300)[0] == list(range(256))


def test_planner_scale_layouts_option_of_the_docs_adds_the_format1_row(monkeypatch):
    """docs/distributed.md, "Scale": the option it gives to add the format 1 FSDP row runs that row
    and the default ones. It said ``--layouts fsdp``, which replaces the defaults (fsdp alone)."""
    import re

    import bench.planner_scale as ps

    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text().split())
    option = re.search(r"`(--layouts [^`]+)` adds the format 1 FSDP row", text).group(1).split()
    ran: list[str] = []
    monkeypatch.setattr(ps, "run", lambda ranks, tensors, layout: ran.append(layout))
    monkeypatch.setattr(sys, "argv", ["planner_scale"])
    ps.main()
    defaults = list(ran)
    ran.clear()
    monkeypatch.setattr(sys, "argv", ["planner_scale", *option])
    ps.main()
    assert ran == [*defaults, "fsdp"]


@pytest.mark.parametrize("flags", [[], ["-W", "error"]], ids=["default", "warnings-as-errors"])
def test_a_permanent_error_exits_78_without_a_warning_even_when_warnings_are_errors(tmp_path, flags):
    """docs/elastic.md: a worker of ``trainguard run`` dying of a permanent error prints the traceback
    and the "exit 78" line, runs the atexit handlers, then exits 78. The hook's flush of open files
    ran isinstance() on every object, which warned for a deprecated one (FutureWarning:
    `torch.distributed.reduce_op` is deprecated: a stray line at every such exit); under ``python -W
    error`` that warning raised out of the hook ("Error in sys.excepthook") and the process exited 1,
    restarted by the agent like any crash."""
    out = tmp_path / "metrics.txt"
    script = ("import atexit, sys, torch.distributed, trainguard as tg\n"
              "atexit.register(lambda: print('atexit ran'))\n"
              "log = open(sys.argv[1], 'w')\nlog.write('kept')\n"
              "raise tg.UnsupportedValueError('a value no restart fixes')\n")
    env = {**os.environ, "TRAINGUARD_AGENT_PID": str(os.getpid()),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    p = subprocess.run([sys.executable, *flags, "-c", script, str(out)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 78, p.stderr[-2000:]
    assert "a restart will not fix this error; exit 78" in p.stderr and "atexit ran" in p.stdout
    assert "Warning" not in p.stderr and "Error in sys.excepthook" not in p.stderr, p.stderr[-2000:]
    assert out.read_text() == "kept"


def test_a_bad_fault_spec_exits_2_from_the_agent_and_78_from_the_workers(tmp_path):
    """docs/elastic.md, "Errors a restart will not fix": it listed "a bad `--fault` spec" among the
    errors that end a job with 78; ``trainguard run --fault`` validates its specs before starting
    anything, a usage error (exit 2). The workers' 78 is for a bad ``TRAINGUARD_FAULT``."""
    script = tmp_path / "train.py"
    script.write_text("import trainguard.elastic as te\nte.heartbeat(0)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    base = [sys.executable, "-m", "trainguard", "run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run")]
    p = subprocess.run([*base, "--fault", "rank=1", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error: fault spec 'rank=1'"), p.stderr[-2000:]
    assert not (tmp_path / "run" / "events.jsonl").exists()  # nothing started
    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "elastic.md").read_text().split())
    assert "and a bad `--fault` spec." not in text
    assert "a bad `--fault` is refused by `trainguard run` itself before any worker starts: one `error:` line and exit 2" in text


@pytest.mark.parametrize(("second", "says"), [
    ("5", "returned (state, int): the second item must be a CheckpointManager or a dict of its settings"),
    ('{"root": ROOT, "save": 5}', "save=5: pass a save policy such as tg.EveryNSteps(100)"),
    ('{"root": ROOT, "keep": 3}', "keep=3: pass a retention policy such as tg.KeepLatest(3)"),
], ids=["not-a-manager", "bad-save", "bad-keep"])
def test_doctor_refuses_a_hook_whose_manager_is_unusable_in_one_line_exit_2(tmp_path, second, says):
    """docs/planning.md: a script the doctor cannot use (a hook that raises or returns no dict) is one
    ``error:`` line with exit code 2, apart from findings (1). A hook returning ``(state, 5)`` ended
    in a TypeError traceback (exit 1), and a settings dict that CheckpointManager(**settings) refuses
    (``keep=3``) was checked as fine ("retention ok: 3 keeps at least two recent checkpoints")."""
    from click.testing import CliRunner

    from trainguard.cli import main

    script = tmp_path / "train.py"
    script.write_text(f"import torch\nROOT = {str(tmp_path / 'run')!r}\n"
                      f"def trainguard_state():\n    return {{'model': torch.nn.Linear(2, 2)}}, {second}\n")
    r = CliRunner().invoke(main, ["doctor", str(script)])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {script}: ") and says in lines[0], r.output


@pytest.mark.slow  # both examples run in make test (test_examples.py), the SIGTERM stop there on the plain loop: suite time
def test_fsdp2_and_transformers_examples_save_on_sigterm_and_stop(tmp_path):
    """docs/interop.md: the examples' tests check "that on SIGTERM each saves the step and exits";
    tests/test_examples.py did so for plain_loop.py and ddp_torchrun.py only. fsdp2.py (SIGTERM to
    rank 1 alone, in its 4th step: the ranks stop together, at that step or the next) and
    hf_transformers.py (in its 3rd step) save and stop before their last step."""
    from test_examples import EX, STOP, _torchrun

    from conftest import run_py

    out = _torchrun(str(STOP), "4", "fsdp2.py", "--dir", str(tmp_path / "f"), "--steps", "9", env={"STOP_RANK": "1"})
    saved = sorted(p.name for p in (tmp_path / "f").glob("step-*"))
    assert saved[-1] in ("step-000000004", "step-000000005"), (saved, out)
    assert f"restored step {int(saved[-1][5:])} on 2 ranks: state equal = True" in out, out
    pytest.importorskip("transformers", reason="transformers is not installed")
    r = run_py([str(STOP), "2", str(EX / "hf_transformers.py"), "--dir", str(tmp_path / "h"), "--out",
                str(tmp_path / "hf"), "--steps", "6"], timeout=240)
    assert r.returncode == 0 and "stopped at step 2, saved step 2" in r.stdout, r.stdout + r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "h").glob("step-*")) == ["step-000000002"]
    assert not (tmp_path / "hf").exists()  # stopped: no export


@pytest.mark.parametrize("name", ["missing.pt", "a_directory.bin"])
def test_convert_of_a_torch_file_it_cannot_open_says_so_not_that_it_refused_to_unpickle(tmp_path, name):
    """docs/interop.md: a foreign file that cannot be read (missing, damaged) is one ``error:`` line,
    exit 2. For a missing or unreadable ``.pt`` that line said "torch.load(weights_only=True) refused
    it ([Errno 2] No such file or directory ...). trainguard does not unpickle arbitrary objects; if
    you trust the file, re-save ... torch.load(..., weights_only=False)": advice about unpickling for a
    file that is not there (a missing .safetensors says "cannot read ...: FileNotFoundError")."""
    from click.testing import CliRunner

    from trainguard.cli import main

    src = tmp_path / name
    if name.startswith("a_directory"):
        src.mkdir()
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out" / "step-000000000")])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    said = f"error: {src}: no such file or directory" if name.startswith("missing") else f"error: cannot read {src} as a torch.save file: "
    assert len(lines) == 1 and lines[0].startswith(said), r.output  # missing: as docs/interop.md says it (review58a)
    assert "unpickle" not in r.output and "weights_only=False" not in r.output


def test_bench_stopped_by_sigterm_removes_its_files_and_exits_143(tmp_path, monkeypatch):
    """``trainguard bench`` stopped by SIGTERM (``timeout``, a scheduler) left its directory behind (up
    to twice --size: 17 GB at --size 4GiB): SIGTERM's default action skipped the cleanup that a Ctrl-C
    gets. It now unwinds as a Ctrl-C does and exits 143; the caller's SIGTERM handler is put back."""
    import signal

    from click.testing import CliRunner

    from trainguard.cli import main as cli

    class Outside(Exception):
        pass

    def outer(signum, frame):  # before the fix, the bench installed none: this one raised in its run
        raise Outside

    real_load = tg.load

    def load(path, state, **kw):  # SIGTERM in the first round's first load: both checkpoints written
        os.kill(os.getpid(), signal.SIGTERM)
        return real_load(path, state, **kw)

    monkeypatch.setattr(tg, "load", load)
    old = signal.signal(signal.SIGTERM, outer)
    try:
        res = CliRunner().invoke(cli, ["bench", str(tmp_path), "--size", "2MiB", "--rounds", "1"], catch_exceptions=False)
        assert signal.getsignal(signal.SIGTERM) is outer
    finally:
        signal.signal(signal.SIGTERM, old)
    assert res.exit_code == 143 and res.stderr.strip() == "terminated: its files are removed", res.output
    assert os.listdir(tmp_path) == []
