"""The doctor: every check with a state that has the mistake and one that does not; the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd
from trainguard.daly import DalyInterval
from trainguard.doctor import Finding, Settings, check, doctor, filesystem_of, parse_mountinfo
from trainguard.policies import EveryNSteps, EverySeconds, KeepBest, KeepEvery, KeepLatest, RetentionPolicy
from trainguard.reliability import make_plan


class RNGState:  # stands in for trainguard.RNGState: detected by class name
    def state_dict(self) -> dict:
        return {}


class ResumableSampler:
    def state_dict(self) -> dict:
        return {"pos": 0}


class StatefulDataLoader:
    def state_dict(self) -> dict:
        return {}


class KeepNewest(RetentionPolicy):  # a custom policy that keeps one checkpoint
    def __init__(self, n: int) -> None:
        self.n = n

    def select(self, checkpoints):  # type: ignore[no-untyped-def]
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-self.n:]}


def good_state() -> dict[str, Any]:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 10),
            "data": ResumableSampler(), "rng": RNGState(), "progress": {"step": 0}}


def one(state: dict[str, Any], name: str, **settings: Any) -> Finding | None:
    found = [f for f in check(state, Settings(**settings)) if f.check == name]
    assert len(found) <= 1
    return found[0] if found else None


def test_good_state_is_clean() -> None:
    findings = check(good_state(), Settings())
    assert {f.check for f in findings} == {"model", "optimizer+scheduler", "rng", "data position", "amp", "async"}
    assert all(f.severity == "ok" for f in findings), findings


def test_optimizer_and_scheduler() -> None:
    s = good_state()
    assert one(s, "optimizer+scheduler").severity == "ok"
    del s["sched"]
    f = one(s, "optimizer+scheduler")
    assert f.severity == "warning" and "without an LR scheduler" in f.message and "sched" in f.fix
    s = good_state()
    del s["optim"]
    f = one(s, "optimizer+scheduler")
    assert f.severity == "error" and "optimizer is not" in f.message
    s = good_state()  # the scheduler drives a different optimizer than the one saved
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    s["sched"] = torch.optim.lr_scheduler.StepLR(other, 10)
    assert one(s, "optimizer+scheduler").severity == "error"
    s = good_state()  # nested containers are searched
    s["optims"] = [s.pop("optim")]
    assert one(s, "optimizer+scheduler").severity == "ok"


def test_rng_state() -> None:
    s = good_state()
    assert one(s, "rng").severity == "ok"
    del s["rng"]
    f = one(s, "rng")
    assert f.severity == "warning" and "RNGState()" in f.fix
    s["extra"] = {"torch_rng": torch.get_rng_state()}  # a hand-made RNG entry counts
    assert one(s, "rng").severity == "ok"


def test_data_position() -> None:
    s = good_state()
    assert one(s, "data position").severity == "ok"
    s["data"] = StatefulDataLoader()
    assert one(s, "data position").severity == "ok"
    s["data"] = torch.utils.data.RandomSampler(range(10))
    f = one(s, "data position")
    assert f.severity == "error" and "RandomSampler, which has no state_dict" in f.message
    assert "ResumableSampler" in f.fix
    s["data"] = torch.utils.data.DataLoader(list(range(10)))
    assert one(s, "data position").severity == "error"
    del s["data"]
    assert one(s, "data position").severity == "error"
    s["progress"] = {"step": 3, "samples_seen": 96}
    assert one(s, "data position").severity == "warning"


def test_amp_needs_a_grad_scaler() -> None:
    s = good_state()
    fp16_src = "with torch.autocast(device_type='cuda'):\n    loss = model(x)\n"
    assert one(s, "amp", source="x = 1\n").severity == "ok"
    f = one(s, "amp", source=fp16_src)
    assert f.severity == "error" and "line 1" in f.message and "GradScaler" in f.fix
    assert one(s, "amp", amp="float16").severity == "error"
    bf16_src = "with torch.autocast('cuda', dtype=torch.bfloat16):\n    pass\n"
    assert one(s, "amp", source=bf16_src).severity == "ok"
    assert one(s, "amp", source="torch.autocast('cpu')").severity == "ok"  # CPU autocast is bfloat16
    s["model"] = torch.nn.Linear(2, 2).half()  # pure float16 training needs loss scaling too
    assert one(s, "amp").severity == "error"
    s["scaler"] = torch.amp.GradScaler("cpu")
    assert one(s, "amp", source=fp16_src).severity == "ok"


@pytest.mark.parametrize("keep, severity", [
    (KeepLatest(2), "ok"),
    (KeepLatest(3) | KeepEvery(1000), "ok"),
    (KeepBest("loss", n=1) | KeepLatest(2), "ok"),
    (KeepNewest(1), "error"),  # the KeepLatest(1) that KeepLatest itself refuses
    (KeepNewest(1) | KeepEvery(10_000), "error"),
    (SimpleNamespace(n=1), "error"),  # any retention object with n == 1
    (KeepBest("loss", n=1), "error"),  # with no metrics yet it keeps one
    (KeepEvery(10_000), "error"),  # keeps none of the recent ones
])
def test_retention_keeps_more_than_one(keep: Any, severity: str) -> None:
    f = one(good_state(), "retention", keep=keep)
    assert f.severity == severity, f
    if severity == "error":
        assert "KeepLatest(2)" in f.fix
    assert one(good_state(), "retention") is None  # no manager: not checked


def test_interval_against_the_plan() -> None:
    plan = make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=600, step_time_s=2)
    assert plan.steps(plan.optimal_interval_s) == 873
    s = good_state()
    f = one(s, "interval", save_policy=EveryNSteps(50), plan=plan)
    assert f.severity == "warning" and "too frequent" in f.message and "EveryNSteps(873)" in f.fix
    f = one(s, "interval", save_policy=EveryNSteps(5000), plan=plan)
    assert f.severity == "warning" and "too rare" in f.message and "GPU-hours/day" in f.message
    assert one(s, "interval", save_policy=EveryNSteps(1000), plan=plan).severity == "ok"
    assert one(s, "interval", save_policy=EverySeconds(6 * 3600), plan=plan).severity == "warning"
    assert one(s, "interval", save_policy=EverySeconds(1800), plan=plan).severity == "ok"
    assert one(s, "interval", save_policy=DalyInterval(node_failures_per_day=0.0065, nodes=256)).severity == "ok"
    assert one(s, "interval", save_policy=EveryNSteps(50)) is None  # no plan: not checked


MOUNTS = textwrap.dedent("""\
    27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
    30 27 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684096k
    31 27 0:28 / /scratch rw - tmpfs tmpfs rw
    32 31 0:29 / /scratch/persist rw - lustre 10.0.0.1@tcp:/fs rw
    33 27 0:30 / /my\\040disk rw - xfs /dev/sdb rw
    """)
OVERLAY = "1 0 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/a,upperdir=/b\n"


def test_mountinfo_parsing() -> None:
    mounts = parse_mountinfo(MOUNTS)
    assert ("/my disk", "xfs") in mounts
    assert filesystem_of("/dev/shm/ckpt", mounts) == "tmpfs"
    assert filesystem_of("/scratch/persist/run1", mounts) == "lustre"  # the deepest mount wins
    assert filesystem_of("/scratchy", mounts) == "ext4"  # a prefix of the name is not a parent


@pytest.mark.parametrize("root, mountinfo, severity", [
    ("/dev/shm/ckpts", MOUNTS, "error"),
    ("/scratch/run1", MOUNTS, "error"),
    ("/scratch/persist/run1", MOUNTS, "ok"),
    ("/home/me/ckpts", MOUNTS, "ok"),
    ("/workspace/ckpts", OVERLAY, "error"),
])
def test_storage_location(root: str, mountinfo: str, severity: str) -> None:
    f = one(good_state(), "storage", root=root, mountinfo=mountinfo)
    assert f.severity == severity
    if severity == "error":
        assert "tmpfs" in f.message or "container" in f.message
    assert one(good_state(), "storage", root="s3://bucket/run1", mountinfo=MOUNTS) is None


def test_async_saving_works_with_any_process_group() -> None:
    s = good_state()
    assert one(s, "async").message == "synchronous saves"
    # trainguard coordinates through the c10d store, never the training group: NCCL alone is fine
    for backend in ("nccl", "cpu:gloo,cuda:nccl", "gloo", None):
        assert one(s, "async", async_save=True, backend=backend).severity == "ok"


RANK0_SAVE = """\
import torch.distributed as dist
for step in range(10):
    train()
    if step % 100 == 0 and dist.get_rank() == 0:
        mgr.save(step, state)
"""
ALL_SAVE = """\
for step in range(10):
    train()
    if rank == 0:
        print("step", step)
    mgr.save(step, state)
"""
DECORATED = """\
@rank_zero_only
def checkpoint(step):
    torch.save(model.state_dict(), "m.pt")
"""


def test_saving_from_one_rank_only() -> None:
    s = good_state()
    f = one(s, "all ranks save", source=RANK0_SAVE)
    assert f.severity == "error" and "line 5" in f.message and "every rank" in f.fix
    assert one(s, "all ranks save", source=ALL_SAVE).severity == "ok"
    f = one(s, "all ranks save", source=DECORATED)  # torch.save on rank 0: an export or a partial checkpoint
    assert f.severity == "warning" and "line 3" in f.message
    assert one(s, "all ranks save", source=DECORATED.replace("torch.save", "tg.save")).severity == "error"
    env = "import os\nif int(os.environ['RANK']) == 0:\n    tg.save('x', state)\n"
    assert one(s, "all ranks save", source=env).severity == "error"
    assert one(s, "all ranks save") is None  # no source: not checked


def test_doctor_reads_a_manager_by_duck_typing() -> None:
    plan = make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=600, step_time_s=2)
    mgr = SimpleNamespace(root="/dev/shm/run1", save_policy=EveryNSteps(10), keep=KeepNewest(1), async_save=False)
    findings = doctor(good_state(), mgr, plan=plan, source=None)
    by = {f.check: f.severity for f in findings}
    assert by["retention"] == "error" and by["interval"] == "warning"
    assert "all ranks save" not in by
    as_dict = doctor(good_state(), {"root": "/tmp/x", "save": EveryNSteps(900), "keep": KeepLatest(2)},
                     plan=plan, source=None)
    assert {f.check: f.severity for f in as_dict}["interval"] == "ok"
    with pytest.raises(TypeError, match="dict"):
        doctor([1, 2], source=None)  # type: ignore[arg-type]


SCRIPT = """\
import torch
import trainguard.policies as pol

def trainguard_state():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {{"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 10)}}
    {extra}
    return state, {{"root": {root!r}, "save": pol.EveryNSteps(1000), "keep": pol.KeepLatest(3)}}

if __name__ == "__main__":
    raise SystemExit("training must not run under the doctor")
"""
FIXES = """class ResumableSampler:
        def state_dict(self):
            return {}
    class RNGState:
        def state_dict(self):
            return {}
    state.update(data=ResumableSampler(), rng=RNGState())"""


def test_doctor_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(SCRIPT.format(extra="pass", root="s3://bucket/run1"))  # no dependence on the real mounts
    res = CliRunner().invoke(doctor_cmd, [str(bad)], terminal_width=200)
    assert res.exit_code == 1, res.output
    assert "data position" in res.output and "ResumableSampler" in res.output and "error" in res.output
    good = tmp_path / "good.py"
    good.write_text(SCRIPT.format(extra=FIXES, root="s3://bucket/run1"))
    args = [str(good), "--nodes", "256", "--node-failures-per-day", "0.0065", "--save-stall", "30s",
            "--step-time", "2s", "--json"]
    res = CliRunner().invoke(doctor_cmd, args)
    assert res.exit_code == 0, res.output
    found = {f["check"]: f["severity"] for f in json.loads(res.output)}
    assert found["interval"] == "ok" and found["retention"] == "ok" and found["all ranks save"] == "ok"
    assert set(found.values()) == {"ok"}
    res = CliRunner().invoke(doctor_cmd, [str(good), "--amp", "float16", "--json"])
    assert res.exit_code == 1 and {f["check"]: f["severity"] for f in json.loads(res.output)}["amp"] == "error"


def test_doctor_cli_without_hook(tmp_path: Path) -> None:
    script = tmp_path / "nohook.py"
    script.write_text("x = 1\n")
    res = CliRunner().invoke(doctor_cmd, [str(script)])
    assert res.exit_code == 1 and "trainguard_state()" in res.output
    broken = tmp_path / "broken.py"
    broken.write_text("def trainguard_state():\n    raise RuntimeError('no GPU here')\n")
    res = CliRunner().invoke(doctor_cmd, [str(broken)])
    assert res.exit_code == 2 and "RuntimeError: no GPU here" in res.output  # the script's error, not a finding
