"""Async saves in a job whose memory is nearly all used (a cgroup limit: Slurm, a container, a pod).

Before (3dac339) the staging pool was allocated whole, and the kernel's OOM killer ended the
training process (SIGKILL: the run dead, no error). Now the pool takes only what fits
(``memroom.room``), the save stages in batches, and the checkpoint is the state at the call.
Each test runs a real training process inside a real memory cgroup (v1 or v2) whose limit is
set, once the process has built its model, to its usage plus half of what full staging takes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, TESTS

CHILD = r"""
import sys, torch, xxhash, trainguard as tg
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
path, with_optim = sys.argv[1], sys.argv[2] == "1"
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 128 MiB of weights
state = {"model": model}
if with_optim:  # one step: gradients and Adam's moments exist (their 256 MiB are staged by the save thread)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).square().mean().backward()
    opt.step()
    state["optim"] = opt
def digest():
    out = [xxhash.xxh3_64_hexdigest(p.detach().numpy().tobytes()) for p in model.parameters()]
    if with_optim:
        out += [xxhash.xxh3_64_hexdigest(v.numpy().tobytes()) for s in opt.state.values() for v in s.values()]
    return out
before = digest()
print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
h = tg.save(path, state, async_=True)
if with_optim:  # training goes on: the next step waits until the last batch is copied
    model(torch.randn(4, 2048)).square().mean().backward()
    opt.step()
h.result(timeout=300)
print("saved", h.staging_batches, h.staged_sync_bytes, flush=True)
tg.save(path + "-again", state, async_=True).result(timeout=300)  # the same shortage: no second warning
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
tg.load(path, state)
print("equal", digest() == before, flush=True)
"""


KINDS = (  # (hierarchy, limit file, usage file, inactive page cache key in memory.stat)
    (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),  # v1
    (Path("/sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file"),  # v2
)


def _cgroup() -> tuple[Path, str, str, str] | None:
    """A new memory cgroup this test may limit: (dir, limit file, usage file, inactive key), or None."""
    if os.geteuid() != 0:
        return None
    for root, limit_file, usage_file, inactive_key in KINDS:
        if not (root / (limit_file if root.name == "memory" else "cgroup.subtree_control")).exists():
            continue
        if root.name != "memory" and "memory" not in (root / "cgroup.subtree_control").read_text():
            continue
        d = root / f"trainguard-test-{uuid.uuid4().hex[:8]}"
        try:
            d.mkdir()
        except OSError:
            return None
        return d, limit_file, usage_file, inactive_key
    return None


def _working_set(d: Path, usage_file: str, inactive_key: str) -> int:
    usage = int((d / usage_file).read_text())
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    return usage - int(stat.get(inactive_key, 0))


def run_in_cgroup(script: str, args: list[str], above: int, cleanup: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """Run ``script`` in a new memory cgroup (joined before Python starts: all it allocates is charged
    there); once it prints "ready", limit the cgroup to its working set plus ``above`` bytes and send
    "go". Returns (exit status, stdout, stderr). Whatever the child started is killed, by pid, and the
    cgroup removed; ``cleanup``: directories a killed child leaves."""
    group = _cgroup()
    if group is None:
        pytest.skip("needs root and a memory cgroup this test can create")
    d, limit_file, usage_file, inactive_key = group
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_WORLD_SIZE", None)
    child = subprocess.Popen(
        ["bash", "-c", f'echo $$ > {d}/cgroup.procs && exec "$0" -c "$@"', sys.executable, script, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        (d / limit_file).write_text(str(_working_set(d, usage_file, inactive_key) + above))
        out, err = child.communicate("go\n", timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        for pid in (d / "cgroup.procs").read_text().split():  # what the child started (ranks): this cgroup's only
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):  # bounded: gone from the cgroup once reaped
            if not (d / "cgroup.procs").read_text().split():
                break
            time.sleep(0.1)
        d.rmdir()
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
    return child.returncode, out, err


def _run_limited(script: str, args: list[str], above: int, cleanup: tuple[str, ...] = ()) -> tuple[str, str]:
    """:func:`run_in_cgroup`, asserting that the child exited 0 (-9: the OOM killer); (stdout, stderr)."""
    rc, out, err = run_in_cgroup(script, args, above, cleanup)
    assert rc == 0, f"exit {rc} (-9: the OOM killer)\n{out}\n{err[-3000:]}"
    return out, err


@pytest.mark.parametrize("with_optim", [True, False], ids=["model+adam", "model-only"])
def test_async_save_near_a_memory_limit_stages_in_batches_instead_of_being_killed(tmp_path: Path, with_optim: bool) -> None:
    staged = (3 if with_optim else 1) * (128 << 20)  # what a whole staging pool takes
    out, err = _run_limited(CHILD, [str(tmp_path / "ck"), "1" if with_optim else "0"], staged // 2)
    batches, sync_bytes = out.split("saved")[1].split()[:2]
    assert int(batches) > 1, out
    if not with_optim:  # every weight is copied in the call by default: none could be here
        assert int(sync_bytes) == 0 and "the save thread stages them in batches that fit" in err, err[-3000:]
    assert err.count("a staging buffer for all") == 1, err[-3000:]  # once, though the second save was short too
    assert err.count("copying 128 MiB of tensors in the save call") == (0 if with_optim else 1), err[-3000:]
    assert out.strip().endswith("equal True"), out


RAM_CHILD = r"""
import sys, torch, trainguard as tg
from torch import nn
torch.manual_seed(0)
run, layers, async_save = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(layers)])  # 16 MiB of weights each
want = [p.detach().clone() for p in model.parameters()][:1]  # one layer kept to compare (16 MiB)
with tg.CheckpointManager(run, ram_tier=True, async_save=async_save, handle_signals=False) as mgr:
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    mgr.save(1, {"model": model}, force=True)
    mgr.wait()
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
with tg.CheckpointManager(run, handle_signals=False) as mgr:
    print("restored", mgr.restore({"model": model}), torch.equal(next(model.parameters()), want[0]), flush=True)
"""


def test_a_ram_tier_copy_past_the_memory_limit_goes_to_the_run_directory(tmp_path: Path) -> None:
    """A RAM-tier save whose copy (tmpfs pages, charged to the job's cgroup) would pass the limit
    had the OOM killer end the job; it is now saved straight to the run directory, with a warning."""
    from trainguard.tiers import ram_dir

    run = tmp_path / "run"
    out, err = _run_limited(RAM_CHILD, [str(run), "8", "0"], 64 << 20, cleanup=(ram_dir(str(run)),))  # 128 MiB, sync
    assert "in the memory this job can still use" in err and "is saved straight to" in err, err[-3000:]
    assert (run / "step-000000001" / "manifest.json").is_file()
    assert out.strip().endswith("restored 1 True"), out
