"""Every script under examples/ runs as documented (torchrun ones on 2 gloo ranks, 127.0.0.1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import run_py

EX = Path(__file__).resolve().parent.parent / "examples"
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _torchrun(script: str, *args: str) -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = run_py(
        ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", str(EX / script), *args],
        env=ENV, timeout=180,
    )  # subprocess.run kills the launcher on timeout
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_plain_loop_resumes(tmp_path):
    first = run_py([str(EX / "plain_loop.py"), "--dir", str(tmp_path), "--steps", "12"], timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "fresh start" in first.stdout and "saved step 11" in first.stdout
    second = run_py([str(EX / "plain_loop.py"), "--dir", str(tmp_path), "--steps", "20"], timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 11" in second.stdout and "saved step 19" in second.stdout


def test_ddp_under_torchrun_resumes(tmp_path):
    assert "fresh start" in _torchrun("ddp_torchrun.py", "--dir", str(tmp_path), "--steps", "6")
    out = _torchrun("ddp_torchrun.py", "--dir", str(tmp_path), "--steps", "10")
    assert "resumed from step 5" in out and "saved step 9" in out


def test_fsdp2_under_torchrun_restores_sharded_state(tmp_path):
    out = _torchrun("fsdp2.py", "--dir", str(tmp_path), "--steps", "6")
    assert "restored step 5 on 2 ranks: state equal = True" in out


def test_transformers_export_loads_in_transformers(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    r = run_py([str(EX / "hf_transformers.py"), "--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "logits equal = True" in r.stdout
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "config.json").exists()
