"""Session 52 review (review52b) of the torch-free readers (cli51) and the DCP streaming (dcpimport51)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import trainguard as tg

ROOT = Path(__file__).resolve().parent.parent
SRC = Path(tg.__file__).resolve().parent.parent

# A torch-free reader (``trainguard.inspect.verify``) forks while another of its threads is importing torch, as a
# reader thread's first float8/uint16 tensor does (``dtypenames.stored``): the import is mimicked as it stands
# midway (the module in sys.modules, its spec initializing, importlib's lock of it held by that thread), without
# running torch. The child verifies a checkpoint (no torch needed) and exits; its exit code is printed.
_FORK_MIDWAY = r"""
import importlib._bootstrap as bs, importlib.util, os, signal, sys, threading, time
import trainguard.inspect as tgi
ckpt = sys.argv[1]
assert tgi.verify(ckpt).ok and "torch" not in sys.modules
held, release = threading.Event(), threading.Event()
def importing():
    spec = importlib.util.find_spec("torch")
    mod = importlib.util.module_from_spec(spec)
    with bs._ModuleLockManager("torch"):
        spec._initializing = True
        sys.modules["torch"] = mod
        held.set()
        release.wait(30)
        del sys.modules["torch"]
t = threading.Thread(target=importing)
t.start()
assert held.wait(30)
pid = os.fork()
if pid == 0:
    os._exit(0 if tgi.verify(ckpt).ok else 1)
release.set()
t.join()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.02)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child hung")
"""


def test_a_fork_while_another_thread_imports_torch_does_not_hang_the_child(tmp_path):
    """Before: the fork hook saw ``torch`` in sys.modules (half-imported) and imported ``trainguard.forks``
    in the child, which imports torch: it waited for good on the import lock of the parent's importing
    thread, which the child does not have (the child hung before running a line of its own)."""
    tg.save(tmp_path / "c", {"m": tg.StateDict(t=torch.arange(4.0))})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _FORK_MIDWAY, str(tmp_path / "c")], env=env, capture_output=True,
                       text=True, timeout=90)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "child 0", p.stdout + p.stderr


def test_dcp_import_of_a_conjugate_or_negative_view_gives_its_values(tmp_path):
    """A complex tensor saved by ``dcp.save`` as a conjugate view (``t.conj()``: DCP writes it with torch.save's
    ``{'conj': True}``, the storage holding the unconjugated numbers): before, the streamed import read the
    storage's bytes as the values (every imaginary part's sign flipped), where ``dcp.load`` and the non-streamed
    import give the view's values. A contiguous negative view (``{'neg': True}``) is checked beside it."""
    import torch.distributed.checkpoint as dcp

    from trainguard.convert import convert

    torch.manual_seed(0)
    conj = torch.randn(3, 2, dtype=torch.complex64).conj()
    neg = torch.randn(2, dtype=torch.complex64).conj().imag[:1]  # a contiguous negative view: one element
    plain = torch.randn(4, 3)
    assert conj.is_conj() and neg.is_neg() and neg.is_contiguous()
    dcp.save({"m": {"conj": conj, "neg": neg, "plain": plain}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    want = {"conj": torch.zeros(3, 2, dtype=torch.complex64), "neg": torch.zeros(1), "plain": torch.zeros(4, 3)}
    dcp.load({"m": want}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(want["conj"], conj.resolve_conj()) and torch.equal(want["neg"], neg.resolve_neg())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's metadata is a pickle: convert warns so
        convert(tmp_path / "dcp", tmp_path / "tg")
    got = {"m": tg.StateDict(conj=torch.zeros(3, 2, dtype=torch.complex64), neg=torch.zeros(1), plain=torch.zeros(4, 3))}
    tg.load(tmp_path / "tg", got)
    for k in want:
        assert torch.equal(got["m"][k], want[k]), (k, got["m"][k], want[k])
