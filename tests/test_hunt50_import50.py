"""The commands that read no checkpoint do not import torch; the library API is as it was.

Before, ``import trainguard`` imported torch and every module of the library (about 2 s of CPU and
230 MB on the test machine), and so did every ``trainguard`` command, ``--help`` included, as the
command is a submodule of the package: ``trainguard report RUN`` (the JSON-lines event log) and
``trainguard plan`` (arithmetic) took 2.0 s and 229 MB where they need 0.2 s and 32 MB. Now the package
binds the names of ``__all__`` at their first use (PEP 562) and the command modules import the
checkpoint machinery when a command runs. The hooks the eager import registered (the at-fork reset,
the exit's drain of a save in flight, a ``trainguard run`` worker's excepthook) are still registered
before the first save, in the same order relative to torch's and ``dist``'s.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = Path(importlib.util.find_spec("trainguard").origin).parent.parent  # the trainguard this test imports

# Runs trainguard's command with argv[1:] in this process and prints, after it, its exit code and
# whether torch (and numpy) were imported: stdout's last line, as JSON.
_CLI = r"""
import json, sys
from trainguard.cli import main
code = 0
try:
    main(sys.argv[1:], prog_name="trainguard")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
sys.stdout.flush()
print("\n" + json.dumps({"code": code, "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules}))
"""

_PLAN = ["plan", "--nodes", "256", "--node-failures-per-day", "0.0065", "--save-stall", "30s", "--restart", "10m",
         "--step-time", "2s", "--every", "500,1000"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRAINGUARD_AGENT_PID", None)
    return env


def _py(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=120)


def _cli(args: list[str], cwd: Path) -> tuple[dict, str]:
    p = _py(["-c", _CLI, *args], cwd)
    assert p.returncode == 0, p.stderr
    out, _, last = p.stdout.rstrip("\n").rpartition("\n")
    return json.loads(last), out


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    ev = [{"t": 0.0, "event": "agent_start", "rank": -1, "pid": 1},
          {"t": 0.5, "event": "rendezvous", "rank": -1, "pid": 1, "world_size": 2}]
    ev += [{"t": 1.0 + s / 10, "event": "step", "step": s, "rank": 0, "pid": 10, "world_size": 2} for s in range(1, 30)]
    ev.append({"t": 1.05, "event": "save", "step": 1, "rank": 0, "pid": 10, "stall_s": 0.02, "duration_s": 0.2,
               "bytes": 1000})
    ev.append({"t": 5.0, "event": "agent_exit", "rank": -1, "pid": 1, "ok": True})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    return run


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], [], ["report", "run"], ["report", "run", "--json"], _PLAN, [*_PLAN, "--json"],
    ["report", "--help"], ["plan", "--help"], ["doctor", "--help"], ["ls", "--help"], ["inspect", "--help"],
    ["verify", "--help"], ["export", "--help"], ["convert", "--help"], ["consolidate", "--help"],
    ["bench", "--help"], ["demo", "--help"], ["plan", "--bogus"],
], ids=lambda a: " ".join(a) or "no-args")
def test_commands_that_read_no_checkpoint_do_not_import_torch(tmp_path, args):
    _run_dir(tmp_path)
    res, out = _cli(args, tmp_path)
    assert not res["torch"], f"trainguard {' '.join(args)} imported torch"
    if args in (["--help"], ["report", "--help"], ["plan", "--help"], ["--version"]):
        assert not res["numpy"], f"trainguard {' '.join(args)} imported numpy"
    if args == ["plan", "--bogus"]:
        assert res["code"] == 2
        return
    assert res["code"] == (0 if args else 2), out  # `trainguard` alone: the help, exit 2 on click 8.2
    if args[:1] == ["report"] and "--help" not in args:
        assert ("goodput" in out) if "--json" in args else ("Steps" in out or "step" in out), out
    if args[:1] == ["plan"] and "--help" not in args:
        assert "Young" in out or "young" in out, out


@pytest.mark.parametrize("module", ["trainguard", "trainguard.cli"])
def test_python_m_report_does_not_import_torch(tmp_path, module):
    """``python -m trainguard report RUN``: its modules as -X importtime lists them, and (runpy, as -m
    runs it) sys.modules after the command."""
    _run_dir(tmp_path)
    p = _py(["-X", "importtime", "-m", module, "report", "run", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "goodput" in json.loads(p.stdout)
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "trainguard" in imported and "torch" not in imported
    code = ("import runpy, sys\nsys.argv = ['trainguard', 'report', 'run']\ntry:\n"
            f"    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nprint('torch' in sys.modules, 'trainguard.report' in sys.modules)")
    p = _py(["-c", code], tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "False True", p.stdout


def test_the_commands_that_read_checkpoints_still_work(tmp_path):
    """ls, inspect, verify import the checkpoint modules (and torch) when they run."""
    p = _py(["-c", "import torch, trainguard as tg; tg.save('ckpts/step-000000001', "
                   "{'model': torch.nn.Linear(2, 2), 'progress': tg.StateDict(step=7)})"], tmp_path)
    assert p.returncode == 0, p.stderr
    res, out = _cli(["ls", "ckpts", "--json"], tmp_path)
    assert res["code"] == 0 and [r["status"] for r in json.loads(out)] == ["valid"]
    res, out = _cli(["inspect", "ckpts/step-000000001"], tmp_path)
    assert res["code"] == 0 and "weight" in out and "step=7" in out, out
    res, out = _cli(["verify", "ckpts"], tmp_path)
    assert res["code"] == 0 and "OK" in out, out


_API = r"""
import os, pickle, sys, threading
import trainguard as tg
assert "torch" not in sys.modules, "import trainguard imported torch"
assert set(tg.__all__) <= set(dir(tg))
assert tg.__version__ and issubclass(tg.CorruptCheckpointError, tg.CheckpointError) and tg.PERMANENT_EXIT == 78
assert "torch" not in sys.modules, "an error class imported torch"
import trainguard.doctor  # the submodule first: tg.doctor is still the function
assert callable(tg.doctor) and tg.doctor.__module__ == "trainguard.doctor", tg.doctor
from trainguard import CheckpointManager, RNGState
import torch
assert "torch" in sys.modules and tg.CheckpointManager is CheckpointManager and tg.RNGState is RNGState
for name in tg.__all__:
    assert getattr(tg, name) is not None, name
ns = {}
exec("from trainguard import *", ns)
assert set(tg.__all__) <= set(ns), set(tg.__all__) - set(ns)
model = torch.nn.Linear(3, 3)
with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(1), keep=tg.KeepLatest(2)) as mgr:
    state = {"model": model, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}
    mgr.save(1, state)
    h = tg.save("direct", state, async_=True)
    h.result()
assert tg.verify("ckpts/step-000000001").ok and isinstance(h, tg.SaveHandle)
fresh = {"model": torch.nn.Linear(3, 3), "rng": tg.RNGState(), "progress": tg.StateDict(step=5)}
tg.load("direct", fresh)
assert torch.equal(fresh["model"].weight, model.weight) and fresh["progress"]["step"] == 0
for obj in (tg.EveryNSteps(5), tg.KeepLatest(2), tg.StateDict(a=1), tg.CheckpointError("x")):
    back = pickle.loads(pickle.dumps(obj))
    assert type(back) is type(obj) and type(back).__module__.startswith("trainguard."), back
assert sys.excepthook.__module__ == "trainguard.permanent", sys.excepthook
assert "trainguard.exitdrain" in [getattr(f, "func", f).__module__ for f in threading._threading_atexits]
print("api ok")
"""


def test_library_api_unchanged_and_torch_imported_at_first_use(tmp_path):
    env = _env()
    env["TRAINGUARD_AGENT_PID"] = "1"  # as in a worker of `trainguard run`: import trainguard sets the excepthook
    p = _py(["-c", _API], tmp_path, env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("api ok")


def test_submodules_as_attributes_before_the_first_use(tmp_path):
    """``tg.inspect.describe``, ``tg.storage.for_path`` (tests do so): the eager import had bound them."""
    code = ("import sys, trainguard as tg; assert callable(tg.storage.for_path) and 'torch' not in sys.modules; "
            "assert [c.status for c in tg.inspect.list_checkpoints('.')] == []; assert not hasattr(tg, 'nope'); "
            "print('ok')")
    p = _py(["-c", code], tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_tg_doctor_can_be_monkeypatched_and_put_back():
    import trainguard as tg

    real = tg.doctor
    mp = pytest.MonkeyPatch()
    mp.setattr(tg, "doctor", lambda *a, **k: "patched")
    assert tg.doctor() == "patched"
    mp.undo()
    assert tg.doctor is real


# Records the process-wide hooks registered while a script imports trainguard and starts saving,
# in order, with the module that registered each (tracing the registration functions).
_HOOKS = r"""
import atexit, os, sys, tempfile, threading
rec = []
def by():
    f = sys._getframe(2)
    return f.f_globals.get("__name__", "?")
def trace(mod, name, kind):
    orig = getattr(mod, name)
    def w(*a, **k):
        rec.append((kind, by()))
        return orig(*a, **k)
    setattr(mod, name, w)
trace(atexit, "register", "atexit")
trace(threading, "_register_atexit", "threading_atexit")
trace(os, "register_at_fork", "at_fork")
how = sys.argv[1]
if how == "package":
    import trainguard as tg
    assert [r for r in rec if r[1].startswith("trainguard")] == [
        ("threading_atexit", "trainguard.exitdrain"), ("atexit", "trainguard.staledefaults"), ("at_fork", "trainguard")], rec
    tg.CheckpointManager
elif how == "manager":
    from trainguard.manager import CheckpointManager
elif how == "api":
    import torch
    from trainguard.api import save
    save(tempfile.mkdtemp() + "/c", {"w": torch.ones(2)}, async_=True).result()
mine = [r for r in rec if r[1].startswith("trainguard")]
print(mine)
print(rec.index(("threading_atexit", "concurrent.futures.thread")) < rec.index(("threading_atexit", "trainguard.exitdrain")))
print(max(i for i, r in enumerate(rec) if r[1].startswith("torch")) < rec.index(("atexit", "trainguard.exitdrain")))
"""


@pytest.mark.parametrize("how", ["package", "manager", "api"])
def test_hooks_registered_before_the_first_save_in_the_eager_order(tmp_path, how):
    """The exit's drain: threading's hook at ``import trainguard`` (after concurrent.futures': it runs
    before the executors shut down, and before the hooks a script registers after the import:
    tests/test_ram_exit42.py), atexit's after dist's and torch's (it runs before the heartbeats stop);
    the at-fork reset after dist's hook, as the eager ``__init__`` had them. ``manager``, ``api``: code
    that imports deep paths only (every manager; an async save)."""
    p = _py(["-c", _HOOKS, how], tmp_path)
    assert p.returncode == 0, p.stderr
    mine, after_executor, after_torch = p.stdout.strip().splitlines()
    assert ast.literal_eval(mine) == [("threading_atexit", "trainguard.exitdrain"), ("atexit", "trainguard.staledefaults"),
                                      ("at_fork", "trainguard"), ("atexit", "trainguard.dist"),
                                      ("at_fork", "trainguard.forks"), ("atexit", "trainguard.exitdrain")]
    assert after_executor == "True" and after_torch == "True"


def test_first_use_from_two_threads_at_once():
    code = r"""
import sys, threading
import trainguard as tg
out, go = {}, threading.Barrier(4)
def use(name):
    go.wait(timeout=60)
    out[name] = getattr(tg, name)
ts = [threading.Thread(target=use, args=(n,)) for n in ("save", "CheckpointManager", "RNGState", "doctor")]
[t.start() for t in ts]
[t.join(timeout=120) for t in ts]
from trainguard.api import save
from trainguard.manager import CheckpointManager
from trainguard.stateful import RNGState
from trainguard.doctor import doctor
assert out == {"save": save, "CheckpointManager": CheckpointManager, "RNGState": RNGState, "doctor": doctor}, out
print("ok")
"""
    p = _py(["-c", code], ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_type_checkers_see_every_lazy_name():
    """mypy and pyright read ``if TYPE_CHECKING:``'s imports: each name of ``__all__`` the package
    binds at its first use is imported there, from the module ``_WHERE`` names."""
    import trainguard as tg

    tree = ast.parse((SRC / "trainguard" / "__init__.py").read_text())
    seen = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1
                seen.update({a.asname or a.name: imp.module for a in imp.names})
    assert seen == tg._WHERE
