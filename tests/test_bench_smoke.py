"""Smoke test of the benchmark harness (bench/): a minuscule run of every method, one steady rep.

Checks the outputs' shape and that every figure is positive, not the speeds themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYNC = ("torch_save", "safetensors", "dcp_t1", "dcp_t2", "trainguard", "raw_1", "raw_2", "raw_d2", "limit")
ASYNC = ("dcp_async", "dcp_async_reuse", "dcp_async_bgstage", "trainguard_async", "trainguard_async_bg")
TG = ("trainguard", "trainguard_async", "trainguard_async_bg")


def _run(tmp_path: Path) -> tuple[dict, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench.run", "--scale", "0.001", "--reps", "1", "--only", "100mb",
           "--step-seconds", "0.02", "--cold", "fadvise", "--timeout", "90",
           "--out-dir", str(out), "--tmp", str(tmp_path / "tmp")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "latest.png").stat().st_size > 0
    assert not any((tmp_path / "tmp").iterdir()), "temporary checkpoints were left behind"
    return json.loads((out / "latest.json").read_text()), (out / "latest.md").read_text()


def test_bench_smoke(tmp_path: Path) -> None:
    doc, md = _run(tmp_path)
    st = doc["states"]["100mb"]
    info = st["info"]
    assert info["errors"] == {}, info["errors"]
    assert info["bytes"] > 0 and info["world"] == 1
    skipped = info["skipped"]
    assert set(skipped) <= set(TG)  # only trainguard may be skipped, and then with a note in the markdown
    for name in skipped:
        assert f"skipped `{name}`" in md
    rows = {(r["method"], r["op"]): r for r in st["rows"]}

    for m in SYNC:
        if m in skipped:
            continue
        for op in ("save", "load_hot", "load_cold"):
            r = rows[(m, op)]
            sec = r["metrics"]["seconds"]
            assert sec["first"] > 0 and sec["median"] > 0 and sec["n"] == 1, (m, op)
            assert r["gbps"] > 0 and r["peak_pct"]["median"] >= 0
    assert rows[("memcpy", "copy")]["gbps"] > 0
    for m in ASYNC:
        if m in skipped:
            continue
        met = rows[(m, "async")]["metrics"]
        assert met["stall_s"]["median"] > 0 and met["latency_s"]["median"] > 0, m
        assert met["consistent"]["median"] == 1.0, f"{m}: the snapshot holds data from a later step"

    if not skipped:
        ops = {(x["other"], x["op"]) for x in st["ratios"]}
        assert ("torch_save", "save") in ops and ("dcp_t2", "load_hot") in ops
        assert ("dcp_async", "async") in ops
    for label in ("torch.save", "safetensors", "DCP save (thread_count=2)", "DCP async_save (default)",
                  "limit: best of raw_1 / raw_2", "## Machine", "### Save (durable)", "### Load",
                  "## Targets (issue 6)"):
        assert label in md, label
    judged = [t for t in doc["targets"] if t["state"] == "100mb"]  # --only 100mb: judged on that state
    assert judged and all(t["median"] > 0 and t["met"] in (True, False) for t in judged if "trainguard" not in skipped)


def test_direct_ab_smoke(tmp_path: Path) -> None:
    """bench.direct_ab (the A/B behind docs/checkpoints.md's direct I/O figures) runs both ways
    and leaves the environment as it found it."""
    from bench import direct_ab

    before = os.environ.get("TRAINGUARD_DIRECT_IO")
    for extra in ([], ["--async"]):
        res = direct_ab.main(["--gb", "0.02", "--rounds", "2", "--tmp", str(tmp_path / "ab"), *extra])
        assert set(res) == {"direct", "buffered"}
        assert all(len(v) == 2 and all(x[0] > 0 for x in v) for v in res.values())
    assert os.environ.get("TRAINGUARD_DIRECT_IO") == before
    assert not (tmp_path / "ab").exists()


def test_per_byte_smoke(tmp_path: Path) -> None:
    """bench.per_byte (issue 6's small/large per-byte ratio, paired in one process): both states
    saved every round in alternating order, the ratio taken round by round, nothing left behind."""
    from bench import per_byte

    out = tmp_path / "per_byte.json"
    res = per_byte.main(["--scale", "0.002", "--n-small", "40", "--rounds", "2", "--out", str(out),
                         "--tmp", str(tmp_path / "pb")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert [r["order"] for r in res["rounds"]] == [["large", "small"], ["small", "large"], ["large", "small"]]
    for r in res["rounds"]:
        rate = {k: res["bytes"][k] / r["seconds"][k] / 1e9 for k in ("large", "small")}
        assert r["ratio"] == rate["small"] / rate["large"] > 0
    assert res["tensors"] == {"large": 408, "small": 40}
    assert res["ratio"]["min"] <= res["ratio"]["median"] <= res["ratio"]["max"]
    assert not (tmp_path / "pb").exists()


def test_gc_full_smoke(tmp_path: Path) -> None:
    """bench.gc_full (docs/async.md's full-collection counts): its three arms run, the hold's
    setting is restored, the JSON holds what it returned, nothing is left behind."""
    from bench import gc_full
    from trainguard import gcpause

    out = tmp_path / "gc.json"
    res = gc_full.main(["--saves", "3", "--layers", "2", "--width", "16", "--out", str(out), "--tmp", str(tmp_path / "ck")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    arms = res["arms"]
    assert list(arms) == ["hold", "no hold", "no saves"]
    assert arms["hold"]["saves"] == arms["no hold"]["saves"] == 3 and arms["no saves"]["saves"] == 0
    assert arms["hold"]["tensors"] == 16 and arms["hold"]["call_median_s"] > 0
    assert gcpause.ASYNC_HOLD_S == 120.0 and not gcpause._held
    assert list((tmp_path / "ck").iterdir()) == []
