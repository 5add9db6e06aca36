"""Every script under examples/ runs as documented (torchrun ones on 2 gloo ranks, 127.0.0.1), and
resumes bit-identically: a run SIGKILLed at a save (``TRAINGUARD_CRASH_AT=begin``, ``kill``) and
restarted ends with the same model and optimizer bytes as a run that never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.commit import read_manifest
from trainguard.export import iter_tensors
from trainguard.storage import for_path

from conftest import free_port, run_py

EX = Path(__file__).resolve().parent.parent / "examples"
STOP = Path(__file__).resolve().parent / "stop_at_step.py"
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def kill_at_save(n: int) -> dict[str, str]:
    """Environment that SIGKILLs the process(es) when the ``n``-th save (1-based) begins."""
    return {"TRAINGUARD_CRASH_AT": "begin", "TRAINGUARD_CRASH_KIND": "kill", "TRAINGUARD_CRASH_SKIP": str(n - 1)}


def differing(a: Path, b: Path) -> list[str]:
    """Names of the tensors and JSON entries in which checkpoints ``a`` and ``b`` differ (bit for
    bit, dtype and shape too), the RNG entries left out: two processes start NumPy and Python
    ``random`` from different OS seeds, which a script that never draws from them does not use."""
    out: list[str] = []
    dumps = []
    for path in (a, b):
        storage, d = for_path(str(path))
        m = read_manifest(storage, d)
        entries = sorted({t.split("/")[0] for t in m.tensors if not t.startswith("rng")})
        tensors = {f"{e}/{n}": t for e in entries for n, t in iter_tensors(storage, d, m, e)}
        dumps.append((tensors, {k: v for k, v in m.objects.items() if not k.startswith("rng")}))
    (ta, oa), (tb, ob) = dumps
    out += sorted(set(ta) ^ set(tb)) + sorted(k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k))
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            out.append(k)
    return out


def _scripts(args: tuple[str, ...]) -> list[str]:
    """``args`` with an example's file name made its path."""
    return [str(EX / a) if a.endswith(".py") and "/" not in a else a for a in args]


def _torchrun(*args: str, env: dict[str, str] | None = None, ok: bool = True) -> str:
    port = free_port()
    r = run_py(
        ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", *_scripts(args)],
        env={**ENV, **(env or {})}, timeout=180,
    )  # subprocess.run kills the launcher on timeout
    assert (r.returncode == 0) == ok, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_plain_loop_resumes_bit_identically(tmp_path):
    straight = run_py([str(EX / "plain_loop.py"), "--dir", str(tmp_path / "a"), "--steps", "20"], timeout=120)
    assert straight.returncode == 0, straight.stderr[-3000:]
    args = [str(EX / "plain_loop.py"), "--dir", str(tmp_path / "b"), "--steps", "20"]
    first = run_py([str(STOP), "11", *args], timeout=120)  # SIGTERM in step 11: saved, and the loop exits
    assert first.returncode == 143, first.stderr[-3000:]  # preempted: mgr.exit_code, for a requeue wrapper
    assert "fresh start" in first.stdout and "stopped at step 11, saved step 11" in first.stdout, first.stdout
    killed = run_py(args, env=kill_at_save(1), timeout=120)  # SIGKILL at step 15's save
    assert killed.returncode == -9 and "resumed from step 11" in killed.stdout, killed.stderr[-3000:]
    second = run_py(args, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 11" in second.stdout and "saved step 19" in second.stdout
    assert differing(tmp_path / "a" / "step-000000019", tmp_path / "b" / "step-000000019") == []
    again = run_py(args, timeout=120)  # a finished job started again (a requeue) has nothing to do
    assert again.returncode == 0 and "done at step 19" in again.stdout, again.stderr[-3000:]


def test_ddp_under_torchrun_resumes_bit_identically(tmp_path):
    assert "fresh start" in _torchrun("ddp_torchrun.py", "--dir", str(tmp_path / "a"), "--steps", "10")
    b = ["ddp_torchrun.py", "--dir", str(tmp_path / "b"), "--steps", "10"]
    out = _torchrun(str(STOP), "5", *b, env={"STOP_RANK": "1"})  # SIGTERM to rank 1 alone in step 5
    assert "stopped at step 5, saved step 5" in out or "stopped at step 6, saved step 6" in out, out
    _torchrun(*b, env=kill_at_save(1), ok=False)  # both ranks SIGKILLed as step 8's save begins
    out = _torchrun(*b)
    assert ("resumed from step 5" in out or "resumed from step 6" in out) and "saved step 9" in out
    assert differing(tmp_path / "a" / "step-000000009", tmp_path / "b" / "step-000000009") == []


def test_fsdp2_under_torchrun_restores_sharded_state_and_resumes_bit_identically(tmp_path):
    out = _torchrun("fsdp2.py", "--dir", str(tmp_path / "a"), "--steps", "9")
    assert "restored step 8 on 2 ranks: state equal = True" in out
    b = ["fsdp2.py", "--dir", str(tmp_path / "b"), "--steps", "9"]
    _torchrun(*b, env=kill_at_save(2), ok=False)  # SIGKILLed as step 6's save begins
    out = _torchrun(*b)
    assert differing(tmp_path / "a" / "step-000000008", tmp_path / "b" / "step-000000008") == []
    assert "resumed from step 3" in out and "restored step 8 on 2 ranks: state equal = True" in out


def test_transformers_export_loads_in_transformers_and_resumes_bit_identically(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    r = run_py([str(EX / "hf_transformers.py"), "--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), "--steps", "6"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "logits equal = True" in r.stdout
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "config.json").exists()
    args = [str(EX / "hf_transformers.py"), "--dir", str(tmp_path / "b"), "--out", str(tmp_path / "hf_b"), "--steps", "6"]
    killed = run_py(args, env=kill_at_save(2), timeout=240)  # SIGKILL at step 4's save
    assert killed.returncode == -9, killed.stderr[-3000:]
    r = run_py(args, timeout=240)
    assert r.returncode == 0 and "logits equal = True" in r.stdout, r.stderr[-3000:]
    assert differing(tmp_path / "ck" / "step-000000005", tmp_path / "b" / "step-000000005") == []
