"""Doctor checks that fired wrongly or stayed quiet (review of the planning/doctor promise)."""

from __future__ import annotations

from typing import Any

import torch

from trainguard.doctor import Finding, Settings, check
from trainguard.policies import EveryNSteps
from trainguard.reliability import make_plan


class RNGState:
    def state_dict(self) -> dict:
        return {}


def one(state: dict[str, Any], name: str, **settings: Any) -> Finding:
    (found,) = [f for f in check(state, Settings(**settings)) if f.check == name]
    return found


def test_async_save_with_an_nccl_only_group_is_fine() -> None:
    # Saves coordinate through the c10d store, never the training process group (docs/async.md).
    f = one({}, "async", async_save=True, backend="nccl")
    assert f.severity == "ok" and "store" in f.message


def test_an_optimizer_built_by_the_script_but_not_saved_is_an_error() -> None:
    src = "import torch\nmodel = torch.nn.Linear(4, 4)\n\nopt = torch.optim.AdamW(model.parameters())\n"
    f = one({"model": torch.nn.Linear(4, 4)}, "optimizer+scheduler", source=src)
    assert f.severity == "error" and "line 4" in f.message and "torch.optim.AdamW" in f.message
    assert one({"model": torch.nn.Linear(4, 4)}, "optimizer+scheduler", source="x = 1\n").severity == "ok"


def test_a_state_dict_snapshot_instead_of_the_optimizer_is_an_error() -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    f = one({"model": model, "optim": opt.state_dict()}, "optimizer+scheduler")
    assert f.severity == "error" and "optim is a copy" in f.message
    f = one({"model": model, "optim": opt, "sched": sched.state_dict()}, "optimizer+scheduler")
    assert f.severity == "error" and "sched is a copy" in f.message


def test_a_seed_is_not_an_rng_state() -> None:
    assert one({"config": {"rng_seed": 1234}}, "rng").severity == "warning"
    assert one({"extra": {"torch_rng": torch.get_rng_state()}}, "rng").severity == "ok"


def test_exports_under_rank_zero_are_not_checkpoint_errors() -> None:
    src = ("import torch, numpy as np\nfor step in range(9):\n    mgr.save(step, state)\n"
           "if dist.get_rank() == 0:\n    torch.save(model.state_dict(), 'final.pt')\n    np.save('e.npy', e)\n")
    f = one({}, "all ranks save", source=src)
    assert f.severity == "warning" and "line 5" in f.message and "line 6" not in f.message
    src += "if rank == 0:\n    self.mgr.save(step, state)\n"
    f = one({}, "all ranks save", source=src)
    assert f.severity == "error" and "line 8" in f.message and "5" not in f.message


def test_interval_finding_states_the_restart_it_assumed() -> None:
    plan = make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=0, step_time_s=2)
    f = one({}, "interval", save_policy=EveryNSteps(1), plan=plan)
    assert f.severity == "warning" and "0s restart" in f.message


def test_a_stateful_object_of_the_users_own_may_hold_the_data_position() -> None:
    class TokenStream:  # a resumable iterable dataset: not named *Sampler/*DataLoader
        def state_dict(self) -> dict:
            return {"offset": 0}

        def load_state_dict(self, d: dict) -> None:
            pass

    f = one({"data": TokenStream()}, "data position")
    assert f.severity == "warning" and "unless data (TokenStream)" in f.message
    model = torch.nn.Linear(2, 2)  # modules, optimizers, schedulers, scalers are no data position
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 10),
             "scaler": torch.amp.GradScaler("cpu")}
    assert one(state, "data position").severity == "error"
    state["loader"] = torch.utils.data.DataLoader(list(range(4)))  # a plain DataLoader stays an error
    assert one(state | {"data": TokenStream()}, "data position").severity == "error"


def test_a_step_policy_without_a_step_time_says_it_was_not_checked() -> None:
    plan = make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=600)  # no step time
    f = one({}, "interval", save_policy=EveryNSteps(1), plan=plan)
    assert f.severity == "info" and "not checked" in f.message and "step time" in f.message
    assert "--step-time" in f.fix and "29.1m" in f.message  # the optimum it would compare with


def test_a_dict_manager_without_save_has_the_managers_default_policy() -> None:
    from trainguard.doctor import doctor

    plan = make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=600, step_time_s=2)
    (f,) = [f for f in doctor({}, {"root": "/tmp/x"}, plan=plan, source=None) if f.check == "interval"]
    assert f.severity == "ok" and "every 1000 steps" in f.message  # CheckpointManager's EveryNSteps(1000)


def test_doctor_cli_shows_info_findings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from trainguard.commands.plan import doctor_cmd

    script = tmp_path / "train.py"
    script.write_text("import trainguard.policies as pol\n\ndef trainguard_state():\n"
                      "    return {}, {'root': 's3://b/r', 'save': pol.EveryNSteps(1)}\n")
    res = CliRunner().invoke(doctor_cmd, [str(script), "--node-failures-per-day", "1", "--save-stall", "30s"],
                             terminal_width=200)
    assert "info" in res.output and "--step-time" in res.output, res.output


def test_retention_is_probed_with_the_steps_the_save_policy_produces() -> None:
    from trainguard.policies import KeepEvery, KeepLatest

    # saves every 1000 steps, KeepEvery(1000) keeps them all: not "0 of 20"
    assert one({}, "retention", keep=KeepEvery(1000), save_policy=EveryNSteps(1000)).severity == "ok"
    assert one({}, "retention", keep=KeepEvery(500), save_policy=EveryNSteps(1000)).severity == "ok"
    # KeepEvery(10_000) with saves every 1000: between multiples only the newest is left
    f = one({}, "retention", keep=KeepEvery(10_000), save_policy=EveryNSteps(1000))
    assert f.severity == "error" and "keeps 1 of" in f.message
    assert one({}, "retention", keep=KeepLatest(2) | KeepEvery(10_000), save_policy=EveryNSteps(1000)).severity == "ok"
    assert one({}, "retention", keep=KeepEvery(1000)).severity == "error"  # unknown save steps: as before


def test_rank_zero_saves_written_as_not_rank_or_an_else_branch_are_seen() -> None:
    cases = {"if not rank:\n    mgr.save(step, state)\n": "line 2",
             "if not dist.get_rank():\n    x = 1\n    mgr.save(step, state)\n": "line 3",
             "if rank != 0:\n    pass\nelse:\n    mgr.save(step, state)\n": "line 4",
             "if dist.get_rank() > 0:\n    wait()\nelif step % 10 == 0:\n    mgr.save(step, state)\n": "line 4",
             "if not is_main_process:\n    pass\nelse:\n    mgr.save(step, state)\n": "line 4"}
    for src, line in cases.items():
        f = one({}, "all ranks save", source=src)
        assert f.severity == "error" and line in f.message, (src, f)
    fine = ["if rank != 0:\n    mgr.save(step, state)\n",  # other ranks only: not this mistake
            "if not (rank == 0):\n    mgr.save(step, state)\nelse:\n    print(1)\n",  # was taken for rank 0
            "if rank == 0:\n    print('saving')\nelse:\n    pass\nmgr.save(step, state)\n"]
    for src in fine:
        assert one({}, "all ranks save", source=src).severity == "ok", src


STAGED = """\
import trainguard as tg
mgr = tg.CheckpointManager("ckpts", async_save=True,
                           stage_in_background=True)
for step in range(100):
    loss = model(x).sum()
    h = mgr.save(step, state)
"""


def test_stage_in_background_without_wait_staged_is_an_error() -> None:
    f = one({}, "background staging", source=STAGED)
    assert f.severity == "error" and "line 2" in f.message and "wait_staged()" in f.fix
    ok = STAGED + "    if h is not None:\n        h.wait_staged()\n"
    assert one({}, "background staging", source=ok).severity == "ok"
    # the manager's setting counts too; without stage_in_background (or without source) nothing to check
    f = one({}, "background staging", source="mgr.save(1, state)\n", stage_in_background=True)
    assert f.severity == "error"
    assert [f.check for f in check({}, Settings(source=STAGED.replace("True", "False")))
            if f.check == "background staging"] == []
    assert [f.check for f in check({}, Settings(stage_in_background=True)) if f.check == "background staging"] == []


def test_a_state_without_a_model_is_an_error() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    f = one({"optim": opt, "rng": torch.get_rng_state(), "step": 3}, "model")  # an RNG tensor is no model
    assert f.severity == "error" and 'state["model"] = model' in f.fix
    assert one({"model": model, "optim": opt}, "model").severity == "ok"
    assert one({"weights": model.state_dict()}, "model").severity == "ok"  # tensors count
    assert one({"nets": [model]}, "model").severity == "ok"

    class Engine:  # a stateful object of the user's own may hold the weights
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, d: dict) -> None:
            pass

    f = one({"engine": Engine(), "optim": opt}, "model")
    assert f.severity == "warning" and "engine (Engine)" in f.message


def test_a_dataloader_without_its_own_generator_is_a_warning() -> None:
    """docs/data.md: a DataLoader without generator= draws its base seed from the global torch
    generator at each iterator start; a resume draws it elsewhere in the stream (dropout differs)."""
    bare = "from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=4, sampler=s)\n"
    f = one({}, "data randomness", source=bare)
    assert f.severity == "warning" and "line 2" in f.message and "generator=torch.Generator()" in f.fix
    own = "import torch\nloader = torch.utils.data.DataLoader(ds, generator=torch.Generator())\n"
    assert one({}, "data randomness", source=own).severity == "ok"
    assert one({}, "data randomness", source="loader = DataLoader(ds, **kw)\n").severity == "info"  # kw unseen
    assert [f for f in check({}, Settings(source="x = 1\n")) if f.check == "data randomness"] == []


def test_doctor_reads_generator_none_and_a_staging_flag_as_written() -> None:
    """``DataLoader(ds, generator=None)`` is the default spelled out: no generator of its own (it
    counted as one); ``stage_in_background=flag`` was reported as "stage_in_background=True"."""
    f = one({}, "data randomness", source="loader = DataLoader(ds, generator=None)\n")
    assert f.severity == "warning" and "line 1" in f.message
    f = one({}, "background staging", source="flag = args.bg\nh = mgr.save(1, state, stage_in_background=flag)\n")
    assert f.severity == "error" and "stage_in_background=flag (line 2)" in f.message


def test_dataloader_workers_without_ignore_stop_signals_under_a_manager_is_a_warning() -> None:
    # A SIGTERM to the process group (Slurm) kills torch's workers before the preemption save
    # (docs/data.md, "Stop signals and DataLoader workers"; tests/test_e2e_review.py).
    head = "import trainguard as tg\nmgr = tg.CheckpointManager('ck')\n"
    f = one({}, "stop signals", source=head + "loader = DataLoader(ds, batch_size=8, num_workers=args.workers)\n")
    assert f.severity == "warning" and "line 3" in f.message and "ignore_stop_signals" in f.fix
    kw = head + "kw = {'batch_size': 8}\nkw.update(num_workers=4)\nloader = DataLoader(ds, **kw)\n"
    assert one({}, "stop signals", source=kw).severity == "warning"
    fixed = head + "loader = DataLoader(ds, num_workers=4, worker_init_fn=tg.ignore_stop_signals)\n"
    assert one({}, "stop signals", source=fixed).severity == "ok"
    for quiet in (head + "loader = DataLoader(ds, num_workers=0)\n", head + "loader = DataLoader(ds, batch_size=8)\n",
                  "loader = DataLoader(ds, num_workers=4)\n",  # no workers, or no manager to make a preemption save
                  "mgr = tg.CheckpointManager('ck', handle_signals=False)\nloader = DataLoader(ds, num_workers=4)\n"):
        assert [f for f in check({}, Settings(source=quiet)) if f.check == "stop signals"] == []
