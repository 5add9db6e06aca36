"""Async saves in a job whose memory is nearly all used (a cgroup limit: Slurm, a container, a pod).

Before (3dac339) the staging pool was allocated whole, and the kernel's OOM killer ended the
training process (SIGKILL: the run dead, no error). Now the pool takes only what fits
(``memroom.room``), the save stages in batches, and the checkpoint is the state at the call.
Each test runs a real training process inside a real memory cgroup (v1 or v2) whose limit is
set, once the process has built its model, to its usage plus half of what full staging takes.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _cgroup(tmp_name: str) -> tuple[Path, str, str, str] | None:
    """A new memory cgroup this test may limit: (dir, limit file, usage file, inactive key), or None."""
    if os.geteuid() != 0:
        return None
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        d = v1 / tmp_name
        try:
            d.mkdir()
        except OSError:
            return None
        return d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
    v2 = Path("/sys/fs/cgroup")
    if "memory" in (v2 / "cgroup.subtree_control").read_text() if (v2 / "cgroup.subtree_control").exists() else False:
        d = v2 / tmp_name
        try:
            d.mkdir()
        except OSError:
            return None
        return d, "memory.max", "memory.current", "inactive_file"
    return None


def _working_set(d: Path, usage_file: str, inactive_key: str) -> int:
    usage = int((d / usage_file).read_text())
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    return usage - int(stat.get(inactive_key, 0))


@pytest.mark.parametrize("with_optim", [True, False], ids=["model+adam", "model-only"])
def test_async_save_near_a_memory_limit_stages_in_batches_instead_of_being_killed(tmp_path: Path, with_optim: bool) -> None:
    group = _cgroup(f"trainguard-test-{uuid.uuid4().hex[:8]}")
    if group is None:
        pytest.skip("needs root and a memory cgroup this test can create")
    d, limit_file, usage_file, inactive_key = group
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_WORLD_SIZE", None)
    child = subprocess.Popen(  # joins the cgroup before Python starts: everything it allocates is charged there
        ["bash", "-c", f'echo $$ > {d}/cgroup.procs && exec "$0" -c "$1" "$2" "$3"', sys.executable, CHILD,
         str(tmp_path / "ck"), "1" if with_optim else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        staged = (3 if with_optim else 1) * (128 << 20)  # what a whole staging pool takes
        (d / limit_file).write_text(str(_working_set(d, usage_file, inactive_key) + staged // 2))
        out, err = child.communicate("go\n", timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        d.rmdir()
    assert child.returncode == 0, f"exit {child.returncode} (-9: the OOM killer)\n{out}\n{err[-3000:]}"
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
run = sys.argv[1]
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 128 MiB of weights
want = [p.detach().clone() for p in model.parameters()][:1]  # one layer kept to compare (16 MiB)
with tg.CheckpointManager(run, ram_tier=True, handle_signals=False) as mgr:
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

    group = _cgroup(f"trainguard-test-{uuid.uuid4().hex[:8]}")
    if group is None:
        pytest.skip("needs root and a memory cgroup this test can create")
    d, limit_file, usage_file, inactive_key = group
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_WORLD_SIZE", None)
    child = subprocess.Popen(
        ["bash", "-c", f'echo $$ > {d}/cgroup.procs && exec "$0" -c "$1" "$2"', sys.executable, RAM_CHILD, str(run)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.stderr else ""
        (d / limit_file).write_text(str(_working_set(d, usage_file, inactive_key) + (64 << 20)))
        out, err = child.communicate("go\n", timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        d.rmdir()
        import shutil

        shutil.rmtree(ram_dir(str(run)), ignore_errors=True)  # what a killed child left in /dev/shm
    assert child.returncode == 0, f"exit {child.returncode} (-9: the OOM killer)\n{out}\n{err[-3000:]}"
    assert "in the memory this job can still use" in err and "is saved straight to" in err, err[-3000:]
    assert (run / "step-000000001" / "manifest.json").is_file()
    assert out.strip().endswith("restored 1 True"), out
