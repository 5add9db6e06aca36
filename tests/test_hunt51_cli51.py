"""The commands that only read manifests and checksums do not import torch (session 51, "cli51").

Before, ``trainguard ls``, ``inspect``, ``verify`` and ``doctor`` (on a script without
``trainguard_state()``) imported torch through the checkpoint modules (``inspect`` -> ``commit`` ->
``capture``/``dist``; ``manifest`` -> ``dtypes``/``flatten``/``tied``; ``doctor._optimizer_names``):
about 1.7 s of CPU and 230 MB each on the test machine, where 0.13 s and 23-27 MB do (doctor: 0.23 s,
37 MB) for a login node or a scheduler's health check. Now the reading side is torch-free (``skeleton``, ``dtypenames``,
``ramview``, ``commitfence`` split off) and the output is what it was. A child forked by such a
process resets the torch-free modules without importing torch (``forkreset``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg

ROOT = Path(__file__).resolve().parent.parent
SRC = Path(tg.__file__).resolve().parent.parent  # the trainguard this test imports

# trainguard's command with argv[1:], in this process; then, on stdout's last line, its exit code and
# whether torch was imported, as JSON.
_CLI = r"""
import json, sys
from trainguard.cli import main
code = 0
try:
    main(sys.argv[1:], prog_name="trainguard")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
sys.stdout.flush()
print("\n" + json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(ROOT), env.get("PYTHONPATH", "")])
    env["COLUMNS"] = "200"  # rich's tables: no column folded
    env.pop("TRAINGUARD_AGENT_PID", None)
    return env


def _cli(args: list[str], cwd: Path) -> tuple[int, bool, str, str]:
    """(exit code, torch imported, stdout, stderr) of ``trainguard ARGS`` run in a child's own process."""
    p = subprocess.run([sys.executable, "-c", _CLI, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out, _, last = p.stdout.rstrip("\n").rpartition("\n")
    res = json.loads(last)
    return res["code"], res["torch"], out, p.stderr


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``single``: one ``tg.save`` (a tied weight: format 3's alias entries, an optimizer, progress, metadata);
    ``run``: a manager's run directory with steps 3, 4, 5 (KeepLatest(3)) and a RAM tier under ``shm``."""
    d = tmp_path_factory.mktemp("cli51")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # a tie: saved once, the second name an alias
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    tg.save(d / "single", {"model": model, "optim": opt, "progress": tg.StateDict(step=7, epoch=1)},
            metadata={"note": "cli51"})
    (d / "shm").mkdir()
    with warnings.catch_warnings():  # the RAM tier is not on a tmpfs here: it warns so
        warnings.simplefilter("ignore")
        mgr = tg.CheckpointManager(d / "run", save=tg.EveryNSteps(1), keep=tg.KeepLatest(3), ram_tier=str(d / "shm"),
                                   handle_signals=False).open()
    for step in range(1, 6):
        mgr.save(step, {"model": model, "optim": opt, "progress": tg.StateDict(step=step)})
    mgr.close(keep_ram_tier=True)  # as a job that died: its RAM copy stays for the next restart on this node
    return d


def test_ls_reads_the_run_directory_and_its_ram_tier_without_torch(ckpts):
    code, torch_in, out, err = _cli(["ls", "run", "--ram-tier", "shm"], ckpts)
    assert (code, torch_in) == (0, False), err
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    durable = [(c[0].strip(), c[4].strip()) for c in rows[:3]]
    assert durable == [("3", "valid"), ("4", "valid"), ("5", "valid")], out
    assert "RAM tier of this node" in out and ("5", "valid") in [(c[0].strip(), c[4].strip()) for c in rows[3:]], out
    code, torch_in, out, err = _cli(["ls", "run", "--json"], ckpts)
    assert (code, torch_in) == (0, False), err
    got = json.loads(out)
    assert [(r["step"], r["status"], r["entries"]) for r in got] == [(3, "valid", 3), (4, "valid", 3), (5, "valid", 3)]


def test_inspect_prints_the_tree_and_values_without_torch(ckpts):
    code, torch_in, out, err = _cli(["inspect", "single"], ckpts)
    assert (code, torch_in) == (0, False), err
    assert "step 0, world size 1" in out and "format v3" in out, out
    assert "0.weight  float32 (8, 8)  256 B  (1 chunk(s))" in out, out
    assert "1.weight  float32 (8, 8)  256 B  (alias of model/0.weight: no bytes of its own)" in out, out
    assert "progress  step=7, epoch=1" in out and "state/0.bias/exp_avg_sq  float32 (8,)" in out, out
    code, torch_in, out, err = _cli(["inspect", "run/step-000000004", "--json"], ckpts)
    assert (code, torch_in) == (0, False), err
    got = json.loads(out)
    assert got["step"] == 4 and list(got["entries"]) == ["model", "optim", "progress"], got
    assert got["entries"]["progress"]["values"] == {"step": 4}
    assert got["entries"]["model"]["tensors"]["1.weight"] == {"dtype": "float32", "shape": [8, 8], "bytes": 256,
                                                              "alias": "model/0.weight"}


def test_verify_checks_every_checksum_and_finds_a_flipped_byte_without_torch(ckpts, tmp_path):
    code, torch_in, out, err = _cli(["verify", "run"], ckpts)
    assert (code, torch_in) == (0, False), err
    assert [line.split()[0] for line in out.splitlines()] == ["OK"] * 3, out
    bad = tmp_path / "bad"
    shutil.copytree(ckpts / "single", bad)
    data = bad / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    code, torch_in, out, err = _cli(["verify", str(bad), "--json"], tmp_path)
    assert (code, torch_in) == (1, False), err
    (res,) = json.loads(out)
    assert res["status"] == "corrupt" and res["step"] == 0 and any("data-00000.bin" in e for e in res["errors"]), res
    code, torch_in, out, err = _cli(["verify", str(ckpts / "single")], tmp_path)
    assert (code, torch_in) == (0, False) and out.startswith("OK"), out + err


_SOURCE_ONLY = """\
import torch
import trainguard as tg

model = torch.nn.Linear(4, 4)
mgr = tg.CheckpointManager("ckpts", save=tg.EveryNSteps(10))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
state = {"model": model, "optim": opt}
start = mgr.restore(state)
opt = AdamW(model.parameters(), lr=0.1)
for step in range(start or 0, 100):
    mgr.save(step, state)
"""


def test_doctor_on_a_script_without_the_hook_reads_its_source_without_torch(tmp_path):
    (tmp_path / "train.py").write_text(_SOURCE_ONLY)
    code, torch_in, out, err = _cli(["doctor", "train.py", "--json"], tmp_path)
    assert (code, torch_in) == (1, False), err  # 1: no trainguard_state(), only the source was checked
    found = {f["check"]: f for f in json.loads(out)}
    assert "the optimizer (AdamW) is built after the restore" in found["after restore"]["message"], found


def test_optimizer_and_scheduler_names_read_from_torchs_source_are_torchs_classes():
    """``doctor_torchfree.class_names`` (without torch) gives the set the doctor takes from torch's classes."""
    from trainguard.doctor_torchfree import class_names

    opt = torch.optim.Optimizer
    want = {n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, opt) and c is not opt}
    assert class_names("optim/__init__.py", "Optimizer") == want and "AdamW" in want
    base = torch.optim.lr_scheduler.LRScheduler
    want = {n for n, c in vars(torch.optim.lr_scheduler).items() if isinstance(c, type) and issubclass(c, base)
            and c is not base and not n.startswith("_")}
    assert class_names("optim/lr_scheduler.py", "LRScheduler") == want and "OneCycleLR" in want


def test_the_dtype_table_without_torch_is_torchs():
    from trainguard.dtypenames import BASE, ITEMSIZE, NEWER, stored
    from trainguard.dtypes import DTYPES

    assert list(DTYPES) == [*BASE, *(n for n in NEWER if hasattr(torch, n))]
    assert {n: d.itemsize for n, d in DTYPES.items()} == {n: ITEMSIZE[n] for n in DTYPES}
    assert all(stored(n) == (n in DTYPES) for n in [*ITEMSIZE, "float128", "Tensor"])


def test_a_checkpoint_of_a_newer_dtype_is_listed_and_verified(tmp_path):
    """A dtype of ``dtypenames.NEWER`` (uint16): accepted where torch has it (``stored`` asks torch)."""
    tg.save(tmp_path / "run" / "step-000000002", {"w": torch.arange(6).to(torch.uint16)})
    code, _, out, err = _cli(["ls", "run", "--json"], tmp_path)
    assert code == 0 and [r["status"] for r in json.loads(out)] == ["valid"], out + err
    code, _, out, err = _cli(["inspect", "run/step-000000002"], tmp_path)
    assert code == 0 and "uint16 (6,)  12 B" in out, out + err


_FORK = r"""
import os, sys, threading
from trainguard.inspect import verify
from trainguard.storage import local
assert verify(sys.argv[1]).ok and "torch" not in sys.modules
held, go = threading.Event(), threading.Event()
def hold():
    with local._LOCK:  # another thread holds the storage's lock at the fork
        held.set()
        go.wait(30)
t = threading.Thread(target=hold)
t.start()
held.wait(30)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    ok = local._LOCK.acquire(timeout=10)  # reset in the child (forkreset): free
    os.write(w, f"{'torch' in sys.modules} {ok}".encode())
    os._exit(0)
os.close(w)
print(os.read(r, 100).decode())
os.waitpid(pid, 0)
go.set()
t.join(30)
"""


def test_a_child_forked_after_a_torch_free_read_resets_without_importing_torch(ckpts):
    """Before, the package's fork hook imported ``forks`` in the child, which imports torch: about 1 s and
    200 MB in each child of a process that only read checkpoints."""
    p = subprocess.run([sys.executable, "-c", _FORK, str(ckpts / "single")], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True"], p.stdout


_NEEDS_TORCH = r"""
import importlib, json, sys
class Blocked:  # torch cannot be imported: a module that needs it fails to import
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch blocked")
sys.meta_path.insert(0, Blocked())
import trainguard
needs = {}
for mod in trainguard._FORK_RESET:
    try:
        importlib.import_module("trainguard." + mod)
        needs[mod] = False
    except ImportError:
        needs[mod] = True
print(json.dumps(needs))
"""


def test_modules_the_fork_reset_skips_without_torch_import_torch():
    """``trainguard._fork_child`` resets only ``forkreset``'s modules where torch is not imported: each other
    module of ``_FORK_RESET`` imports torch, so none of them can be loaded then."""
    p = subprocess.run([sys.executable, "-c", _NEEDS_TORCH], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    free = {"gcpause", "iostall", "storage._direct", "storage.local"}
    assert json.loads(p.stdout) == {m: m not in free for m in tg._FORK_RESET}
