"""Session 49, helper leftovers49: small defects the session-48 reviews saw and left alone.

``RNGState.load_state_dict`` is all-or-nothing (every state parsed and tried before any generator changes);
``reseed_for_rank`` re-seeds a numpy Generator's SeedSequence (its ``spawn()`` children); a NaN hyperparameter
the checkpoint holds too is not warned about as changed; -0.0 and 0.0 as a shared value on two ranks are not
warned as differing; an Enum in the state is refused with what to save instead; ``trainguard convert`` of a source without tensors
is refused (exit 2, nothing written); a checksum mismatch names the checkpoint (directory or URL, step) and
the file, not the file alone; a closed CheckpointManager's channel leaves the process's context, and a closed
async manager the process's reference to its last save; a demo whose agent is SIGKILLed leaves no directory."""

from __future__ import annotations

import contextlib
import enum
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main as cli
from trainguard.errors import CorruptCheckpointError, UnsupportedValueError


def _numpy_bad(sd: dict) -> dict:
    """``sd`` with NumPy's global state damaged (a pos past a C long: set_state raises OverflowError)."""
    return {**sd, "numpy": {**sd["numpy"], "pos": 2**70}}


def test_rngstate_load_that_fails_on_the_numpy_state_changes_no_generator():
    rng = tg.RNGState()
    bad = _numpy_bad(rng.state_dict())
    random.seed(123)
    np.random.seed(5)
    torch.manual_seed(9)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        rng.load_state_dict(bad)
    assert random.getstate() == before[0], "the python RNG was set before the numpy state failed to parse"
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_rngstate_load_that_fails_on_a_generator_changes_none_of_them():
    py, npg, tg_ = random.Random(1), np.random.default_rng(2), torch.Generator().manual_seed(3)
    rng = tg.RNGState(generators={"a_py": py, "b_np": npg, "c_torch": tg_})
    sd = rng.state_dict()
    sd["generators"]["c_torch"] = {**sd["generators"]["c_torch"], "state": torch.zeros(3, dtype=torch.uint8)}
    random.seed(7)
    py.seed(8)
    npg.bit_generator.state = np.random.default_rng(9).bit_generator.state
    tg_.manual_seed(10)
    want = random.getstate(), py.getstate(), npg.bit_generator.state, tg_.get_state()
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        rng.load_state_dict(sd)
    assert random.getstate() == want[0] and py.getstate() == want[1]
    assert npg.bit_generator.state == want[2]
    assert torch.equal(tg_.get_state(), want[3])


def _children_after_reseed(rank: int) -> list[float]:
    """What a rank the world size grew by draws from ``spawn()`` of the generator its script built (one seed
    on every rank), after the loader re-seeded it."""
    g = np.random.default_rng(0)
    tg.RNGState(generators={"g": g}).reseed_for_rank(rank, step=10)
    return [c.random() for c in g.spawn(2)]


def test_reseed_for_rank_reseeds_a_numpy_generators_spawned_children():
    two, three = _children_after_reseed(2), _children_after_reseed(3)
    assert not set(two) & set(three), "the new ranks' spawn() children are the same streams"
    assert _children_after_reseed(2) == two, "not reproducible from the same checkpoint"


def _nan_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    opt.param_groups[0].update(betas=(0.9, float("nan")), weight_decay=float("nan"))  # Adam() refuses a NaN beta
    return m, opt


def test_a_nan_hyperparameter_the_checkpoint_holds_too_is_not_warned_about(tmp_path: Path):
    m, opt = _nan_optim()
    tg.save(tmp_path / "step-000000001", {"model": m, "optim": opt})
    m, opt = _nan_optim()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tg.load(tmp_path / "step-000000001", {"model": m, "optim": opt})
    assert [str(w.message) for w in seen if "nan" in str(w.message)] == []
    opt.param_groups[0]["weight_decay"] = 0.1  # a real change is still warned about
    with pytest.warns(UserWarning, match="weight_decay: the script set 0.1, the checkpoint has nan"):
        tg.load(tmp_path / "step-000000001", {"model": m, "optim": opt})


def _signed_zero_ranks(rank: int, world: int, root: str) -> list[str]:
    from trainguard.sharedvalues import SharedValuesDifferWarning

    model = torch.nn.Linear(2, 2)
    # -0.0 on rank 0 and 0.0 on rank 1 (a loss or metric rounded to zero from either side): equal values.
    state = {"model": model, "progress": tg.StateDict(step=1, best=-0.0 if rank == 0 else 0.0, hist=[0.0, -0.0 * rank])}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tg.save(f"{root}/step-000000001", state)
        state["progress"]["best"] = 1.0 + rank  # a real difference is still warned about
        tg.save(f"{root}/step-000000002", state)
    return [str(w.message) for w in seen if issubclass(w.category, SharedValuesDifferWarning)]


def test_shared_values_minus_zero_and_zero_on_two_ranks_are_not_warned_as_differing(tmp_path: Path):
    from dist_helper import run_ranks

    res = run_ranks(_signed_zero_ranks, 2, str(tmp_path), timeout=60)
    assert all(r.ok for r in res), [r.error for r in res]
    warned = res[0].value
    assert len(warned) == 1 and "save of step 2" in warned[0], warned
    assert res[1].value == []


class _Phase(enum.Enum):
    WARMUP = 1
    MAIN = 2


@pytest.mark.parametrize("value", [{"phase": _Phase.MAIN}, {"by_phase": {_Phase.MAIN: 3}}])
def test_an_enum_in_the_state_is_refused_saying_to_save_its_value_or_name(tmp_path: Path, value: dict):
    with pytest.raises(UnsupportedValueError) as e:
        tg.save(tmp_path / "step-000000001", {"progress": tg.StateDict(step=1, **value)})
    assert "save its .value (2) or .name ('MAIN')" in str(e.value) and "_Phase(value) or _Phase[name]" in str(e.value)
    assert not (tmp_path / "step-000000001").exists()


@pytest.mark.parametrize(("saved", "found"), [({}, "nothing but empty containers"),
                                              ({"step": 5, "lr": 0.1}, "step: int, lr: float"),
                                              ({"model": {}, "optim": {"state": {}, "param_groups": []}}, "nothing but")])
def test_convert_of_a_source_without_tensors_is_refused_and_writes_nothing(tmp_path: Path, saved: dict, found: str):
    torch.save(saved, tmp_path / "w.pt")
    out = tmp_path / "run" / "step-000000000"
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "w.pt"), str(out)])
    assert res.exit_code == 2, res.output
    assert "the torch file holds no tensors (found: " + found in res.output
    assert not out.exists() and not out.parent.exists()


def test_convert_of_an_empty_safetensors_file_is_refused(tmp_path: Path):
    from safetensors.torch import save_file

    save_file({}, tmp_path / "w.safetensors")
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "w.safetensors"), str(tmp_path / "run" / "step-000000000")])
    assert res.exit_code == 2 and "the safetensors file holds no tensors" in res.output, res.output


def _flip_a_data_byte(step_dir: Path) -> None:
    data = step_dir / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[20] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_checksum_mismatch_names_the_checkpoint_its_step_and_the_file(tmp_path: Path):
    run = tmp_path / "run"
    with tg.CheckpointManager(run) as mgr:
        mgr.save(5, {"model": torch.nn.Linear(16, 16)}, force=True)
    _flip_a_data_byte(run / "step-000000005")
    with pytest.raises(CorruptCheckpointError) as e:
        tg.load(run / "step-000000005", {"model": torch.nn.Linear(16, 16)})
    # before: "data-00000.bin: checksum mismatch ... the checkpoint is corrupt The load had begun ..."
    assert str(e.value).startswith(f"{run}/step-000000005/data-00000.bin (checkpoint of step 5): checksum mismatch "
                                   "in tensor 'model/bias'"), str(e.value)
    assert "corrupt. The load had begun" in str(e.value)
    with tg.CheckpointManager(run) as mgr, pytest.raises(tg.CheckpointError) as e:
        mgr.restore({"model": torch.nn.Linear(16, 16)})
    assert f"\nstep 5: {run}/step-000000005/data-00000.bin: checksum mismatch " in str(e.value)  # each once (leftovers50)


def _load_corrupt_ranks(rank: int, world: int, root: str) -> str:
    try:
        tg.load(f"{root}/step-000000007", {"model": torch.nn.Linear(16, 16)})
    except CorruptCheckpointError as e:
        return str(e)
    return "loaded"


def test_a_checksum_mismatch_in_a_two_rank_load_names_the_checkpoint_on_every_rank(tmp_path: Path):
    from dist_helper import run_ranks

    tg.save(tmp_path / "step-000000007", {"model": torch.nn.Linear(16, 16)})
    _flip_a_data_byte(tmp_path / "step-000000007")
    res = run_ranks(_load_corrupt_ranks, 2, str(tmp_path), timeout=60)
    assert all(r.ok for r in res), [r.error for r in res]
    for r in res:
        assert f"{tmp_path}/step-000000007/data-00000.bin (checkpoint of step 7): checksum mismatch" in r.value, r.value


def _sweep_ranks(rank: int, world: int, root: str, n: int) -> dict:
    """One CheckpointManager per trial, each in its own directory (a hyperparameter sweep), on 2 ranks; then
    a manager of a name used before (a trial resumed) saves and restores on a new channel."""
    import gc

    from trainguard.dist import DistContext, StoreDistContext

    m = torch.nn.Linear(4, 4)
    for i in range(n):
        with tg.CheckpointManager(f"{root}/trial-{i}", async_save=i % 20 == 1) as mgr:
            if i % 20 < 2:  # a sync and an async save now and then: the async-save channel of the manager's too
                mgr.save(1, {"m": m}, force=True)
    del mgr
    gc.collect()
    home = DistContext.current()
    live = sum(isinstance(c, StoreDistContext) for c in home._channels.values())
    objects = sum(isinstance(o, StoreDistContext) for o in gc.get_objects())
    with tg.CheckpointManager(f"{root}/trial-1", async_save=True) as again:
        restored = again.restore({"m": torch.nn.Linear(4, 4)})
        again.save(2, {"m": m}, force=True)
    return {"live": live, "objects": objects, "restored": restored, "chan": again.ctx.chan}


@pytest.mark.parametrize("trials", [60, pytest.param(200, marks=pytest.mark.slow)])  # 200: 16 s here, 60: 5 s
def test_closed_managers_channels_go_away_in_a_sweep(tmp_path: Path, trials: int):
    from dist_helper import run_ranks

    res = run_ranks(_sweep_ranks, 2, str(tmp_path), trials, timeout=120)
    assert all(r.ok for r in res), [r.error for r in res]
    for r in res:
        # before, after 200: 200 channels held by the process's context, 211 contexts (the async saves' too)
        assert r.value["live"] == 0 and r.value["objects"] <= 2, r.value
        assert r.value["restored"] == 1 and r.value["chan"].endswith("/manager:trial-1#1"), r.value
    assert (tmp_path / "trial-1" / "step-000000002" / "manifest.json").exists()


def test_a_closed_async_manager_keeps_no_reference_to_its_last_save(tmp_path: Path):
    """The last save's handle (and through it the save's manifest: 290,000 objects, 34 MiB for 10,000 Adam
    parameters) stayed referenced by the process after close(), until the next async save."""
    import gc
    import weakref

    model = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(50)])
    with tg.CheckpointManager(tmp_path, async_save=True) as mgr:
        handle = mgr.save(1, {"model": model}, force=True)
    assert handle is not None and handle.done() and handle.result().step == 1
    gone = weakref.ref(handle)
    del handle, mgr
    gc.collect()
    assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]


def _below(pid: int) -> list[int]:
    """The processes below ``pid``, children first (from /proc)."""
    import os

    parent = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[0]]
        out += kids
        todo = todo[1:] + kids
    return out


def test_demo_whose_agent_is_sigkilled_leaves_no_directory_and_no_process(tmp_path: Path):
    """torch's agent makes a ``torchelastic_*`` directory in the temp directory when given no ``--log-dir``
    and never removes it: every demo left two, a SIGKILLed agent's too. Now the demo gives its agents a
    log directory inside its own, removed with it. And the SIGKILLed agent's orphaned workers wrote their
    "orphaned" event after the demo had removed its directory, making ``trainguard-demo-*/kill`` again
    (2 of 3 tries): the demo now ends them before it removes it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from trainguard.elastic.reap import running

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TMPDIR=str(tmp_path))
    demo = subprocess.Popen([sys.executable, "-m", "trainguard", "demo", "--size", "tiny", "--steps", "100000",
                             "--fault-step", "99999", "--save-every", "1000", "--plot", ""],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    below: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not any(" loss " in f.read_text(errors="replace") for f in tmp_path.glob("trainguard-demo-*/kill.log")):
            assert demo.poll() is None and time.monotonic() < deadline, "the demo's first run did not train"
            time.sleep(0.05)
        below = _below(demo.pid)
        os.kill(below[0], signal.SIGKILL)  # the agent: the demo's one child
        out, _ = demo.communicate(timeout=120)
        assert demo.returncode == 1 and "exit code -9" in out, out[-2000:]
        # the log's tail is shown line by line under the error, not as one line with \x0a escapes (session 49)
        err = out[out.index("error: the kill run failed"):]
        assert "\\x0a" not in err and len(err.splitlines()) > 2, err[-2000:]
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("torchelastic_", "trainguard-demo-"))) == []
        assert [p for p in below if running(p)] == []
    finally:
        for pid in [demo.pid, *below]:  # what is left (a failed assert): by PID
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=60)
