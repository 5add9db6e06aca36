"""Findings of session 32's audit, each with the behaviour that was wrong before."""

from __future__ import annotations

import errno
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import trainguard as tg
from trainguard.storage import local

from conftest import held_pwrite
from dist_helper import run_ranks


def test_unnamed_optimizer_param_warns_once_per_load(tmp_path: Path) -> None:
    """A parameter of the optimizer in no module of the state is keyed by index, with a warning;
    a load gave that warning twice (once from reading the current state, once from matching the
    groups)."""
    m = torch.nn.Linear(2, 2)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([*m.parameters(), extra])
    m(torch.ones(1, 2)).sum().backward()
    extra.grad = torch.ones(3)
    opt.step()
    with warnings.catch_warnings(record=True) as saved:
        warnings.simplefilter("always")
        tg.save(tmp_path / "c", {"model": m, "optim": opt})
    saved_extra = extra.detach().clone()
    with torch.no_grad():
        extra.add_(1)
    with warnings.catch_warnings(record=True) as loaded:
        warnings.simplefilter("always")
        tg.load(tmp_path / "c", {"model": m, "optim": opt})
    ours = [w for w in loaded if "belong to no nn.Module" in str(w.message)]
    assert len([w for w in saved if "belong to no nn.Module" in str(w.message)]) == 1
    assert len(ours) == 1, [str(w.message) for w in loaded]
    assert torch.equal(opt.state[extra]["exp_avg"], torch.full((3,), 0.1))  # loaded by index
    assert not torch.equal(extra, saved_extra)  # not an entry of the state: left as it is


def test_step_during_a_capped_save_whose_write_is_stuck_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``max_staging_bytes`` the save thread copies, writes, copies...: a write stuck between
    two copies held ``staged()`` back, and ``optimizer.step()`` (the pre-step hook) and
    ``wait_staged()`` waited for it with no bound, so the training thread never reached the next
    save/wait/close that raises ``StuckWriteError`` (with several ranks, the others then waited
    in their next collective). Now they raise it after the manager's timeout; the save stays in
    flight and commits once the write returns."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # 2 MiB of parameters
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    entered, gate = held_pwrite(monkeypatch, "step-000000002")
    mgr = tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), async_save=True, timeout=0.5,
                               max_staging_bytes=1 << 20).open()
    got: list[BaseException | None] = []
    try:
        mgr.save(1, state)
        mgr.wait()
        expect = {k: v.detach().clone() for k, v in model.state_dict().items()}
        h = mgr.save(2, state)
        assert entered.wait(60)
        assert not h.staged()  # the cap left chunks to copy after the held write

        def step() -> None:
            try:
                opt.step()
                got.append(None)
            except BaseException as e:  # noqa: B902 - handed to the test's thread
                got.append(e)

        t = threading.Thread(target=step, daemon=True)
        t.start()
        t.join(60)
        assert got and isinstance(got[0], tg.StuckWriteError), got  # before: still waiting (released below)
        assert re.search(r"the save of step 2 has been stuck for \d+ s in a write of .*step-000000002", str(got[0]))
        with pytest.raises(tg.StuckWriteError, match="save of step 2"):
            h.wait_staged()
    finally:
        monkeypatch.undo()
        gate.set()
    mgr.timeout = 120.0
    mgr.wait()  # the save, in flight all along, commits with the state at its call
    mgr.close()
    loaded = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    tg.load(tmp_path / "step-000000002", {"model": loaded}, strict=False)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expect.items())


_EXIT = textwrap.dedent("""
    import sys, threading, torch, trainguard as tg
    from trainguard.storage import local
    orig = local._LocalWriter.pwrite

    def held(self, data, offset):  # the writes of step 2 never return
        if "step-000000002" in self.path:
            threading.Event().wait()
        return orig(self, data, offset)

    local._LocalWriter.pwrite = held
    state = {"a": torch.ones(1 << 20)}
    mgr = tg.CheckpointManager(sys.argv[1], save=tg.EveryNSteps(1), async_save=True, timeout=1.0).open()
    mgr.save(1, state)
    mgr.wait()
    mgr.save(2, state)
    raise RuntimeError("training blew up")  # no close(), no wait(): the exit finds the save in flight
""")


def test_exit_with_a_stuck_async_save_in_flight_ends(tmp_path: Path) -> None:
    """A training script that crashes while its manager's async save is held in a write: the exit
    joined the save thread with no bound (the process never ended; here: the subprocess timeout).
    Now it waits the save's timeout, says the save was not committed, and exits."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", _EXIT, str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "training blew up" in p.stderr
    assert re.search(r"the async save of step 2 was not committed: .*stuck for \d+ s", p.stderr), p.stderr[-3000:]
    assert sorted(q.name for q in (tmp_path / "run").iterdir() if q.name.startswith("step-") and ".tmp-" not in q.name) == [
        "step-000000001"]


@pytest.mark.parametrize("call", ["pwrite", "write"])
def test_a_write_that_writes_nothing_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """A write returning 0 (some FUSE file systems) made the local writer's loops spin for good;
    now the save fails, naming the file, and the previous checkpoint stays."""
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", "0")
    state = {"w": torch.arange(4096.0)}
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, state)
        real = getattr(os, call)
        monkeypatch.setattr(local.os, call, lambda fd, data, *a: 0 if len(data) else real(fd, data, *a))
        with pytest.raises(tg.CheckpointError, match=r"accepted no byte of a write .*step-000000002"):
            mgr.save(2, {"w": torch.zeros(4096)})
        monkeypatch.setattr(local.os, call, real)
    got = {"w": torch.zeros(4096)}
    tg.load(tmp_path / "step-000000001", got)
    assert torch.equal(got["w"], state["w"]) and tg.CheckpointManager(tmp_path).latest_step() == 1


def test_an_io_error_of_a_write_names_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.pwrite``/``os.fsync`` errors carry no file name: a failed save said only
    "[Errno 5] Input/output error"."""
    monkeypatch.setenv("TRAINGUARD_DIRECT_IO", "0")

    def eio(*a: object) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(local.os, "pwrite", eio)
    with pytest.raises(tg.CheckpointError, match=r"Input/output error: '.*c\.tmp-[^/']*/data-00000\.bin'"):
        tg.save(tmp_path / "c", {"w": torch.arange(4096.0)})


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3,), float(i))


def _masked(samples: list[torch.Tensor]) -> torch.Tensor:
    x = torch.stack(samples)
    return x * (torch.rand(x.shape) > 0.5)  # drawn in the worker that collates the batch


def test_collate_fn_draws_resume_identically_at_another_num_workers(tmp_path: Path) -> None:
    """A ``collate_fn`` that draws ran with the worker's generators, whose state depended on the
    batches that worker had collated since its iterator started: a resume mid-epoch masked
    differently (the docs' recipe followed: ResumableSampler(with_epoch=True), SeededDataset)."""

    def make(workers: int) -> tuple[tg.ResumableSampler, torch.utils.data.DataLoader]:
        sampler = tg.ResumableSampler(24, seed=3, with_epoch=True)
        loader = torch.utils.data.DataLoader(tg.SeededDataset(_Rows(), seed=5), batch_size=4, sampler=sampler,
                                             num_workers=workers, collate_fn=_masked, generator=torch.Generator(),
                                             persistent_workers=workers > 0)
        return sampler, loader

    sampler, loader = make(2)
    straight = []
    for x in loader:
        straight.append(x)
        sampler.advance(len(x))
        if len(straight) == 3:
            tg.save(tmp_path / "c", {"data": sampler})
    for workers in (3, 1):
        sampler, loader = make(workers)
        tg.load(tmp_path / "c", {"data": sampler})
        resumed = list(loader)
        assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(straight[3:], resumed, strict=True)), workers
    assert any(bool((x == 0).any()) and bool((x != 0).any()) for x in straight)  # the masks are random


@pytest.mark.parametrize("argv", [["export", "{ck}", "--to", "{ck}/data-00000.bin"],
                                  ["convert", "{ck}", "{ck}/manifest.json", "--to", "safetensors"]])
def test_export_or_convert_into_a_checkpoint_is_refused(tmp_path: Path, argv: list[str]) -> None:
    """An output named like a checkpoint's own file, inside it, replaced that file (exit 0): the
    checkpoint was destroyed. Now refused with exit 2, and the checkpoint verifies."""
    from click.testing import CliRunner

    from trainguard.cli import main

    ck = tmp_path / "step-000000001"
    tg.save(ck, {"model": {"w": torch.arange(1000.0)}})
    got = CliRunner().invoke(main, [a.format(ck=ck) for a in argv])
    assert got.exit_code == 2, got.output
    assert "is a trainguard checkpoint; writing a file into it could replace one of its own" in got.output
    assert tg.verify(ck).ok


def _gens() -> dict:
    return {"t": torch.Generator().manual_seed(1), "n": np.random.default_rng(2),
            "m": np.random.Generator(np.random.MT19937(3)), "p": np.random.Generator(np.random.Philox(4)),
            "s": np.random.Generator(np.random.SFC64(5)), "l": np.random.RandomState(6), "r": random.Random(7)}


def _draw(g: dict) -> list:
    return [torch.randn(3, generator=g["t"]).tolist(), g["n"].random(2).tolist(), g["m"].integers(0, 1 << 40, 2).tolist(),
            g["p"].normal(size=2).tolist(), g["s"].random(2).tolist(), g["l"].randn(3).tolist(),
            [g["r"].gauss(0, 1) for _ in range(3)]]


def test_explicit_generators_resume_through_rngstate(tmp_path: Path) -> None:
    """A loop drawing from its own generators resumed differently with no warning, and putting
    one in the state got the generic "cannot be saved without pickle"."""
    g = _gens()
    _draw(g)
    g["r"].gauss(0, 1)  # a cached Gaussian pending in random.Random and RandomState
    g["l"].randn(1)
    tg.save(tmp_path / "c", {"rng": tg.RNGState(generators=g)})
    want = _draw(g)
    h = _gens()
    assert _draw(h) != want
    tg.load(tmp_path / "c", {"rng": tg.RNGState(generators=h)})
    assert _draw(h) == want

    # A generator the checkpoint has no state for, or of another kind: refused before anything changes.
    for bad in ({**_gens(), "extra": torch.Generator()}, {**_gens(), "t": random.Random(0)}):
        torch.manual_seed(11)
        kept = bad["n"].bit_generator.state
        with pytest.raises(tg.CheckpointError, match="no state for generator|saved as a torch generator"):
            tg.load(tmp_path / "c", {"rng": tg.RNGState(generators=bad)})
        assert torch.equal(torch.get_rng_state(), torch.manual_seed(11).get_state())
        assert bad["n"].bit_generator.state == kept

    with pytest.raises(tg.UnsupportedValueError, match=r"tg.RNGState\(generators="):
        tg.save(tmp_path / "d", {"noise": torch.Generator()})
    loader = torch.utils.data.DataLoader(list(range(4)))
    with pytest.raises(tg.UnsupportedValueError, match="tg.ResumableSampler"):
        tg.save(tmp_path / "e", {"data": {"loader": loader}})
    with pytest.raises(TypeError, match="supported are torch.Generator"):
        tg.RNGState(generators={"x": object()})


def test_explicit_generators_reseed_per_rank() -> None:
    """A rank the checkpoint has no state for (the world grew) re-seeds them: by rank and step."""
    a, b, c = _gens(), _gens(), _gens()
    tg.RNGState(generators=a).reseed_for_rank(2, step=10)
    tg.RNGState(generators=b).reseed_for_rank(2, step=10)
    tg.RNGState(generators=c).reseed_for_rank(3, step=10)
    da, db, dc = _draw(a), _draw(b), _draw(c)
    assert da == db and all(x != y for x, y in zip(da, dc, strict=True))


def test_set_epoch_back_from_a_restored_epoch_warns(tmp_path: Path) -> None:
    """A DistributedSampler-style loop, ``for epoch in range(E): sampler.set_epoch(epoch)``,
    restarted after a restore at epoch 1 moved the sampler back to epoch 0 silently: the run
    trained those epochs again."""
    sampler = tg.ResumableSampler(16, seed=0)
    sampler.set_epoch(1)
    sampler.advance(8)
    tg.save(tmp_path / "c", {"data": sampler})
    fresh = tg.ResumableSampler(16, seed=0)
    tg.load(tmp_path / "c", {"data": fresh})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.set_epoch(1)  # the restored epoch: keeps its position, no warning
    assert (fresh.epoch, fresh.position) == (1, 8)
    with pytest.warns(UserWarning, match=r"set_epoch\(0\) moves back from epoch 1 \(sample 8"):
        fresh.set_epoch(0)


def _regroup(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from trainguard import dist as tgdist

    tg.save(f"{root}/a", {"w": torch.full((4,), 1.0)})
    old = tgdist.DistContext.current()
    dist.destroy_process_group()
    new_rank = world - 1 - rank  # the ranks renumbered: the dangerous case of a stale context
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store", world), rank=new_rank, world_size=world)
    # The cache is keyed by id(store); make the new group's store find the old context there, as a
    # freed id() given again would.
    tgdist._CACHE[id(dist.distributed_c10d._get_default_store())] = old
    ctx = tgdist.DistContext.current()
    got = {"w": torch.zeros(4)}
    tg.load(f"{root}/a", got, timeout=30)
    tg.save(f"{root}/b", {"w": torch.full((4,), 2.0), "rng": tg.RNGState()}, timeout=30)
    return {"ctx_rank": ctx.rank, "rank": dist.get_rank(), "fresh": ctx is not old, "w": got["w"].tolist()}


def test_a_process_group_made_again_gets_a_fresh_context(tmp_path: Path) -> None:
    """trainguard's context of a process group was cached by ``id(group)``: a group made after
    ``destroy_process_group`` can get the freed group's id, and the old context (its store, rank
    and world size) was used: loads failed after a long wait naming a rank not in the group, or,
    with the ranks renumbered, each rank would act as its old rank."""
    res = run_ranks(_regroup, 2, str(tmp_path), timeout=120)
    for r in res:
        assert r.value["fresh"] and r.value["ctx_rank"] == r.value["rank"], r.value
        assert r.value["w"] == [1.0] * 4
    assert tg.verify(tmp_path / "b").ok


_SCRIPT = '''
import torch, trainguard as tg
print("config: lr=1e-3")                     # a script that prints as it is imported


def trainguard_state():
    print("building the state")
    m = torch.nn.Linear(2, 2)
    return {"model": m}, {"root": "ckpts", "save": tg.EveryNSteps(1)}
'''


def test_doctor_json_is_the_only_stdout_and_a_half_plan_is_named(tmp_path: Path) -> None:
    """The script's prints went to stdout before the JSON (which then did not parse); given a
    failure rate without --save-stall, the interval check was dropped without a word; a hook's
    own error exited 1, as a finding that is an error does."""
    import json

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", "from trainguard.cli import main; main()", "doctor", str(script), "--json"]
    p = subprocess.run([*cmd, "--node-mtbf", "2d", "--nodes", "64"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    found = {f["check"]: f for f in json.loads(p.stdout)}
    assert "config: lr=1e-3" in p.stderr and "building the state" in p.stderr
    assert found["interval"]["severity"] == "info" and "--save-stall" in found["interval"]["message"]
    p = subprocess.run([*cmd, "--save-stall", "30s"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert "--node-mtbf" in {f["check"]: f for f in json.loads(p.stdout)}["interval"]["message"]
    script.write_text("def trainguard_state():\n    raise RuntimeError('no GPU here')\n")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    err = json.loads(p.stdout)  # --json: the error as one JSON object on stdout (an "error:" line on stderr before polish58)
    assert p.returncode == 2 and err["exit_code"] == 2 and "no GPU here" in err["error"], (p.stdout, p.stderr)


def test_report_skips_event_lines_without_the_fields_of_their_kind(tmp_path: Path) -> None:
    """A line with a string ``event`` and a numeric ``t`` but none of its kind's fields (another
    tool's log) made ``trainguard report`` fail with a KeyError traceback; a NaN ``t`` made its
    --json output invalid JSON."""
    import json

    from click.testing import CliRunner

    from trainguard.cli import main

    good = [{"event": "agent_start", "t": 1.0}, {"event": "step", "t": 2.0, "step": 1},
            {"event": "step", "t": 3.0, "pid": 7, "step": 2}]
    bad = ['{"event":"step","t":2.5}', '{"event":"failure","t":2.6}', '{"event":"restore","t":2.7,"rank":0}',
           '{"event":"step","t":2.8,"pid":1,"step":"x"}', '{"event":"step","t":NaN,"pid":7,"step":3}',
           '{"event":"save","t":2.9,"rank":0,"stall_s":"slow"}']
    (tmp_path / "events.jsonl").write_text("\n".join([*(json.dumps(e) for e in good), *bad]) + "\n")
    got = CliRunner().invoke(main, ["report", str(tmp_path), "--json"])
    assert got.exit_code == 0, got.output
    summary = json.loads(got.output)  # strict: no NaN
    assert summary["final_step"] == 2 and summary["steps_run"] == 2 and summary["saves"] == 0
    assert summary["failures"] == 1 and summary["recoveries"][0]["restored_step"] is None


def test_export_messages_and_file_mode(tmp_path: Path) -> None:
    """complex128 into safetensors said ``KeyError: torch.complex128``; a rank-local entry was said
    to hold no tensors; a file written by safetensors' save_file was 0600 where a streamed export
    was 0644 (readable by others or not, by the dtypes it held); a torch file named .safetensors
    was written, which torch.load then refuses."""
    from trainguard.convert import convert
    from trainguard.export import export

    ck = tmp_path / "step-000000001"
    tg.save(ck, {"model": {"w": torch.randn(3), "z": torch.randn(3, dtype=torch.complex64)},
                 "c": {"z": torch.randn(2, dtype=torch.complex128)}, "rng": tg.RNGState()})
    with pytest.raises(tg.CheckpointError, match=r"safetensors has no type for torch.complex128; write a .pt file"):
        export(ck, tmp_path / "c.safetensors", entry="c")
    with pytest.raises(tg.CheckpointError, match="entry 'rng' .* is rank-local"):
        export(ck, tmp_path / "r.pt", entry="rng")
    with pytest.raises(tg.CheckpointError, match="name it .pt"):
        convert(ck, tmp_path / "m.safetensors", dst_format="torch")
    mask = os.umask(0o022)
    try:
        export(ck, tmp_path / "m.safetensors")  # complex64: through save_file
        convert(ck, tmp_path / "n.safetensors")
    finally:
        os.umask(mask)
    assert {oct((tmp_path / n).stat().st_mode & 0o777) for n in ("m.safetensors", "n.safetensors")} == {"0o644"}


def _linked(rank: int, world: int, root: str) -> str:
    run = f"{root}/run" if rank == 0 else f"{root}/run-link"  # one directory, two last names
    try:
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1), timeout=3, handle_signals=False) as mgr:
            mgr.save(1, {"w": torch.ones(2)})
    except tg.CheckpointError as e:
        return str(e)
    return "saved"


def test_a_run_directory_reached_under_another_name_says_so(tmp_path: Path) -> None:
    """A rank reaching the shared run directory through a link of another last name works in
    another channel: both sides waited the timeout and said only that the other "did not arrive"
    and to call with "the same step and state"."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run-link").symlink_to(tmp_path / "run")
    res = run_ranks(_linked, 2, str(tmp_path), timeout=120, env={"TRAINGUARD_DEAD_AFTER": "3"})
    msgs = [r.value for r in res]
    assert "did not arrive" in msgs[0] and "same last name on every rank" in msgs[0], msgs
    assert msgs[1] != "saved", msgs  # it waited for rank 0 in its own channel, then failed too


def test_a_rollback_restored_from_the_ram_tier_removes_nothing_before_a_save(tmp_path: Path) -> None:
    """A rollback (``restore(step=N)``) restored from the RAM tier ran retention once the step was
    on disk, at restore time: the newer checkpoints of another node's run were deleted though no
    save followed (without the RAM tier they stay until this run's first save commits)."""
    root = tmp_path / "run"
    kw = dict(save=tg.EveryNSteps(5), keep=tg.KeepLatest(3), handle_signals=False)

    def st(v: float) -> dict:
        return {"w": torch.full((64,), v), "p": tg.StateDict(step=0)}

    try:  # this node, RAM tier; a crash keeps the RAM copy of 15 for a restart here
        with tg.CheckpointManager(root, ram_tier=True, **kw) as mgr:
            for s in (5, 10, 15):
                mgr.save(s, st(float(s)))
            raise RuntimeError("node lost")
    except RuntimeError:
        pass
    with tg.CheckpointManager(root, **kw) as mgr:  # another node: no RAM copy there
        assert mgr.restore(st(0.0)) == 15
        for s in (20, 25):
            mgr.save(s, st(float(s)))
    try:
        with tg.CheckpointManager(root, ram_tier=True, **kw) as mgr:  # back here: look at step 15
            got = st(0.0)
            assert mgr.restore(got, step=17) == 15 and torch.equal(got["w"], torch.full((64,), 15.0))
            mgr.ram.wait()  # its copy to disk (already there) done
            assert sorted(p.name for p in root.glob("step-*")) == [f"step-{s:09d}" for s in (15, 20, 25)]
    finally:
        tg.CheckpointManager(root, ram_tier=True, **kw).open().close()  # its RAM copies go with a clean close
    assert tg.CheckpointManager(root).latest_step() == 25


def test_the_ram_tier_of_a_run_reached_through_a_link_is_the_same(tmp_path: Path) -> None:
    """The RAM tier was keyed by the run directory's absolute path, not its real one: a restart
    through a symbolic link (the run lock resolves links) did not find the RAM-only newest step,
    and its copy stayed in /dev/shm for good."""
    from trainguard.tiers import ram_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    assert ram_dir(str(tmp_path / "link")) == ram_dir(str(tmp_path / "run")) != ram_dir(str(tmp_path / "other"))


@pytest.mark.parametrize("make", [lambda: tg.EveryNSteps(True), lambda: tg.KeepEvery(True),
                                  lambda: tg.KeepBest("loss", n=True), lambda: tg.KeepLatest(True)])
def test_a_bool_is_no_count_of_steps_or_checkpoints(make) -> None:
    """``EveryNSteps(True)``, ``KeepEvery(True)`` and ``KeepBest(n=True)`` were taken as 1, where a
    step of True is refused."""
    with pytest.raises(ValueError):
        make()


def test_doctor_reads_a_world_size_under_another_name() -> None:
    """``world = dist.get_world_size()`` then ``if world == 1 or dist.get_rank() == 0: mgr.save(...)``
    was reported ok (a world size is read from names holding ``world_size`` only), where the same
    test spelled ``dist.get_world_size() == 1`` is an error."""
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    def rank_check(src: str) -> str:
        found = check_source(Settings(source=src))
        return next(f.severity for f in found if f.check == "all ranks save")

    single = "import torch.distributed as dist\nif {} or dist.get_rank() == 0:\n    mgr.save(1, s)\n"
    for alone in ("world == 1", "n_world == 1", "ws == 1", "nprocs == 1", "self.world < 2"):
        assert rank_check(single.format(alone)) == "error", alone
    assert rank_check(single.format("world_rank == 1")) == "ok"  # a rank, not a world size: the test is no rank-0 one


_LOADER = '''
import random, torch
import trainguard as tg
from torch.utils.data import DataLoader
{defs}
loader = DataLoader({data}, batch_size=4, num_workers=2, {kw})
'''


@pytest.mark.parametrize(("defs", "data", "kw", "expect"), [
    ("def mask(b):\n    x = torch.stack(b)\n    return x * (torch.rand(x.shape) > 0.3)", "ds", "collate_fn=mask", "warning"),
    ("def mask(b):\n    return torch.stack(b) * random.random()", "tg.SeededDataset(ds)", "collate_fn=mask", "ok"),
    ("def init(w):\n    import numpy as np\n    np.random.seed(torch.initial_seed() % 2**32)", "ds", "worker_init_fn=init", None),
    ("def init(w):\n    global SCALE\n    SCALE = random.uniform(0, 1)", "tg.SeededDataset(ds)", "worker_init_fn=init", "warning"),
    ("def noisy(i):\n    return i + torch.randn(1)", "tg.ResumableIterable(rows, batch_size=4, transform=noisy)", "", "warning"),
    ("def noisy(i):\n    return i + torch.randn(1)", "tg.ResumableIterable(rows, batch_size=4, transform=noisy, seed=0)", "",
     None),
])
def test_doctor_reports_draws_in_collate_worker_init_and_transform(defs: str, data: str, kw: str, expect) -> None:
    """The worker randomness check looked at dataset classes only: draws in a worker loader's
    collate_fn, worker_init_fn or a ResumableIterable's transform were reported ok."""
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    found = {f.check: f for f in check_source(Settings(source=_LOADER.format(defs=defs, data=data, kw=kw)))}
    got = found.get("worker randomness")
    assert (got.severity if got else None) == expect, got


def test_sighup_is_a_stop_signal_of_the_manager_unless_ignored(tmp_path: Path) -> None:
    """trainguard run's agent forwards SIGHUP to the workers as it got it (its exit code table calls
    it a stop after a save), but the manager handled SIGTERM/SIGINT only: a worker died of it
    without its preemption save. A SIGHUP ignored (nohup) or handled by the program stays so, and
    SIGQUIT is left alone (faulthandler's stack dumps)."""
    before, quit_before = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGQUIT)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (a CI runner may ignore it, as nohup does)
    try:
        _sighup_stops(tmp_path, quit_before)
    finally:
        signal.signal(signal.SIGHUP, before)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    try:
        with tg.CheckpointManager(tmp_path / "nohup", handle_signals=True) as mgr:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            mgr.save(1, {"w": torch.ones(2)})
            assert not mgr.should_stop
    finally:
        signal.signal(signal.SIGHUP, before)


def _sighup_stops(tmp_path: Path, quit_before: object) -> None:
    with tg.CheckpointManager(tmp_path, save=tg.EveryNSteps(1000), handle_signals=True) as mgr:
        assert signal.getsignal(signal.SIGQUIT) == quit_before  # left alone
        assert mgr.save(5, {"w": torch.ones(2)}) is None
        os.kill(os.getpid(), signal.SIGHUP)
        h = mgr.save(6, {"w": torch.full((2,), 6.0)})
        assert h is not None and h.done() and mgr.should_stop
    assert mgr.exit_code == 128 + int(signal.SIGHUP)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # given back at close()
    assert tg.CheckpointManager(tmp_path).latest_step() == 6


def _forkserver_worker() -> str:
    """test_exitcodes15_review's worker, whose rank 1 signals every process of the job at step 3
    (Slurm's preemption: the agent, the forkserver, both workers), not itself alone."""
    from test_exitcodes15_review import WORKER

    return (WORKER.replace("    rank = dist.get_rank()\n", "    rank = dist.get_rank()\n    pids = [None, None]\n"
                           "    dist.all_gather_object(pids, os.getpid())\n")
            .replace("                os.kill(os.getpid(), signal.SIGTERM)\n",
                     "                server = os.getppid()  # the forkserver; its parent is the agent\n"
                     "                agent = int(open(f'/proc/{server}/stat').read().rsplit(')', 1)[1].split()[1])\n"
                     "                for pid in (agent, server, *pids):\n"
                     "                    os.kill(pid, signal.SIGTERM)\n")
            # Said before close(): after it, a SIGINT of the dead forkserver (torch's parent-death signal), which
            # may come that late under load, raises KeyboardInterrupt at Python's default handler, and torch's
            # worker wrapper ends the worker quietly (exit 0): the line after the `with` was not printed.
            .replace('    print(f"rank {rank} ended at step {step} ", flush=True)\n',
                     '        print(f"rank {rank} ended at step {step} exit {mgr.exit_code}", flush=True)\n'))


@pytest.mark.timeout(150)
def test_a_sigterm_to_every_process_with_a_forkserver_still_saves(tmp_path: Path) -> None:
    """--start-method forkserver --run-path: a SIGTERM to every process killed the forkserver, whose
    children then read as exited (code 255); torch's close waited for none, trainguard SIGKILLed
    their process groups, and the workers died before their preemption save while the agent still
    exited 143 (and a worker that did save reported 130: torch's parent-death SIGINT came last)."""
    from test_elastic_edges import CLI
    from test_exitcodes15_review import _run

    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(_forkserver_worker()))
    log = tmp_path / "agent.log"
    rc = _run([*CLI, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--run-path", "--start-method",
               "forkserver", str(train), str(tmp_path), "return"], log)
    text = log.read_text(errors="replace")
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    ends = re.findall(r"rank \d ended at step (\d+) exit (\d+)", text)
    assert len(ends) == 2 and len(set(ends)) == 1 and ends[0][1] == "143", text[-3000:]
    assert tg.CheckpointManager(tmp_path / "run").latest_step() == int(ends[0][0]) in (3, 4)


def test_a_failed_sync_after_the_commit_rename_is_no_failed_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename of the temp directory is the commit; an I/O error of the directory sync after it
    was reported as a failed save, while the checkpoint was in place and a restart loaded it.
    Now the save succeeds with a warning that a power loss may undo it."""
    real = local.LocalStorage.rename_dir

    def rename_then_eio(self, src: str, dst: str) -> None:
        real(self, src, dst)
        if "step-000000002" in dst or dst.endswith("/c"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.dirname(dst))

    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        monkeypatch.setattr(local.LocalStorage, "rename_dir", rename_then_eio)
        with pytest.warns(UserWarning, match="step-000000002 is committed, but syncing its parent directory"):
            assert mgr.save(2, {"w": torch.full((2,), 2.0)}) is not None
        assert mgr.last_saved_step == 2
        with pytest.warns(UserWarning, match="is committed, but syncing"):
            tg.save(tmp_path / "c", {"w": torch.ones(2)})
        with pytest.warns(UserWarning, match="is committed, but syncing"):
            tg.save(tmp_path / "c", {"w": torch.full((2,), 3.0)}, overwrite=True)  # the old one set aside first
        monkeypatch.undo()
    got = {"w": torch.zeros(2)}
    with tg.CheckpointManager(tmp_path / "run", handle_signals=False) as mgr:
        assert mgr.restore(got) == 2 and torch.equal(got["w"], torch.full((2,), 2.0))
    tg.load(tmp_path / "c", got)
    assert torch.equal(got["w"], torch.full((2,), 3.0))
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name or ".tmp-" in p.name]


def test_a_failed_script_workers_peers_are_closed_after_the_grace_not_30_s() -> None:
    """Script workers (torch's SubprocessContext, trainguard run without --run-path) were closed by
    torch's _poll with a fixed 30 s once one failed: a peer that did not end on SIGTERM held the
    restart 30 s (the docs say 1 s, SIGTERM, 1 s, SIGKILL). The hook gives that close the grace;
    an exit after a stop signal's save, and the agent's own closes, keep their timeout."""
    from types import SimpleNamespace

    from trainguard.elastic.reap import bound_failure_close

    class Context:  # torch's shape: _poll closes the workers with the default timeout
        def __init__(self, codes: list[int]) -> None:
            self._failures = {i: SimpleNamespace(exitcode=c) for i, c in enumerate(codes)}
            self.waited: list[float] = []

        def _poll(self) -> None:
            self.close()

        def close(self, death_sig: int = signal.SIGTERM, timeout: int = 30) -> None:
            self._close(death_sig, timeout)

        def _close(self, death_sig: int, timeout: int = 30) -> None:
            self.waited.append(timeout)

    bound_failure_close(Context, 1.0)
    failed, preempted = Context([1]), Context([143, 143])
    failed._poll()
    preempted._poll()
    failed.close()  # the agent's own close (a stop signal to it): its timeout
    assert failed.waited == [1, 30] and preempted.waited == [30]


def test_report_pairs_each_failure_with_its_own_attempt() -> None:
    """A failure whose restart began fresh (no checkpoint yet) was given the next failure's restore
    (a negative first-step time); a failure after the watchdog declared a hang timed its recovery
    from the agent's failure event, 30 s after the hang, not from the hang."""
    from trainguard.report import summarize

    ev = [
        {"event": "agent_start", "t": 0.0},
        {"event": "failure", "t": 10.0, "rank": 1},  # before any checkpoint
        {"event": "fresh_start", "t": 12.0, "rank": 0, "skipped": 0},
        {"event": "first_step", "t": 13.0, "rank": 0, "step": 1, "lost_steps": 5},
        {"event": "hang", "t": 30.0, "rank": 0, "step": 20},
        {"event": "failure", "t": 60.0, "rank": 0},
        {"event": "restore", "t": 63.0, "rank": 0, "step": 20, "seconds": 0.5},
        {"event": "first_step", "t": 64.0, "rank": 0, "step": 21, "lost_steps": 0},
    ]
    one, two = summarize(ev)["recoveries"]
    assert one["restored_step"] is None and "first_step_s" not in one and one["recover_s"] == 3.0
    assert two["restored_step"] == 20 and two["detect_s"] == 30.0 and two["recover_s"] == 34.0
    assert two["first_step_s"] == 1.0
    # Another node's agent of the same job reporting the same incident, or joining, bounds nothing;
    # a new job's start does (its restore is not this failure's).
    same = [{"event": "agent_start", "t": 0.0, "job_id": "a"}, {"event": "failure", "t": 10.0},
            {"event": "failure", "t": 12.0}, {"event": "agent_start", "t": 13.0, "job_id": "a"},
            {"event": "restore", "t": 20.0, "rank": 0, "step": 4}]
    assert [r["restored_step"] for r in summarize(same)["recoveries"]] == [4, 4]
    later = [*same[:2], {"event": "agent_start", "t": 15.0, "job_id": "b"}, same[-1]]
    assert [r["restored_step"] for r in summarize(later)["recoveries"]] == [None]


def test_another_saves_long_storage_call_is_not_this_saves_stuck_write() -> None:
    """The stuck-write checks looked at the oldest storage call of the whole process: another
    thread's sync save to another directory, slow but within its own limit, made a healthy async
    save raise StuckWriteError from wait_staged()/step(), and its exit hook then dropped it."""
    from trainguard import iostall
    from trainguard.handle import SaveHandle

    k = object()
    iostall._OPEN[k] = (time.monotonic() - 100.0, "a write of 40 bytes at offset 0 of /x/B/step-000000001.tmp-ab/data-00000.bin",
                        0)  # another thread's call (0: no thread's ident)
    try:
        assert iostall.oldest() is not None and iostall.oldest("/x/B/step-000000001") is not None
        assert iostall.oldest("/x/A/step-000000001") is None
        h = SaveHandle(1, "/x/A/step-000000001")
        h.limit = 0.2
        assert h.block_until_staged(timeout=0.5)[0] is False  # before: StuckWriteError naming B's write
        h.target = "/x/B/step-000000001"
        with pytest.raises(tg.StuckWriteError, match="B/step-000000001.tmp-ab"):
            h.block_until_staged(timeout=5)
    finally:
        iostall._OPEN.pop(k, None)


def test_generators_review_cases(tmp_path: Path) -> None:
    """Review of RNGState(generators=): a RandomState over PCG64 failed to re-seed on growth; a
    random.Random subclass with state of its own saved but never loaded (reported as corrupt);
    SystemRandom was taken and every save failed; a checkpoint saved before a generator was added
    was refused even with strict=False, after other entries had been overwritten."""

    class Mine(random.Random):
        def __init__(self, seed: int) -> None:
            self.extra = 7
            super().__init__(seed)

        def getstate(self):
            return (super().getstate(), self.extra)

        def setstate(self, state):
            super().setstate(state[0])
            self.extra = state[1]

    legacy = np.random.RandomState(np.random.PCG64(1))
    tg.RNGState(generators={"l": legacy}).reseed_for_rank(1, step=3)  # before: TypeError
    a, b = Mine(1), Mine(2)
    a.extra = 9
    tg.save(tmp_path / "m", {"rng": tg.RNGState(generators={"r": a})})
    want = [a.random() for _ in range(3)]
    tg.load(tmp_path / "m", {"rng": tg.RNGState(generators={"r": b})})
    assert [b.random() for _ in range(3)] == want and b.extra == 9
    with pytest.raises(TypeError, match="not SystemRandom"):
        tg.RNGState(generators={"s": random.SystemRandom()})

    tg.save(tmp_path / "old", {"rng": tg.RNGState(), "x": torch.ones(2)})
    g = torch.Generator().manual_seed(5)
    kept = g.get_state()
    x = torch.zeros(2)
    with pytest.raises(tg.CheckpointError, match=r"no state for generator\(s\) \['g'\]"):
        tg.load(tmp_path / "old", {"rng": tg.RNGState(generators={"g": g}), "x": x})
    assert torch.equal(x, torch.zeros(2))  # refused before anything was read
    with pytest.warns(UserWarning, match=r"no state for generator\(s\) \['g'\]; left as they are"):
        tg.load(tmp_path / "old", {"rng": tg.RNGState(generators={"g": g}), "x": x}, strict=False)
    assert torch.equal(x, torch.ones(2)) and torch.equal(g.get_state(), kept)


def test_export_into_a_directory_with_another_tools_manifest_is_taken(tmp_path: Path) -> None:
    """The guard against writing into a checkpoint took any file named manifest.json for one."""
    from trainguard.export import export

    tg.save(tmp_path / "c", {"model": {"w": torch.arange(4.0)}})
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "manifest.json").write_text('{"name": "my-model", "files": []}\n')
    assert export(tmp_path / "c", tmp_path / "release" / "model.safetensors") == 1


def test_a_torch_generator_of_another_device_is_refused_by_name() -> None:
    """A CPU generator's state loaded into a CUDA generator (or back) passed the kind check and
    then failed in set_state, reported as a corrupt checkpoint (a restore skipped every one)."""
    from trainguard import genstate

    g = torch.Generator()
    saved = {"g": genstate.state_of(g)}
    assert saved["g"]["device"] == "cpu"
    genstate.check_saved({"g": g}, saved)
    with pytest.raises(tg.CheckpointError, match="'g' was saved on cuda and is on cpu now"):
        genstate.check_saved({"g": g}, {"g": {**saved["g"], "device": "cuda"}})
