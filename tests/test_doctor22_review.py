"""Doctor review 22: a restore inside the training loop, a save inside accelerate's
``accumulate()`` block, an optimizer or scheduler built after the restore."""

from __future__ import annotations

import textwrap

from trainguard.doctor import Settings, check
from trainguard.doctor_source import check_source

IN_LOOP = """
import torch
import trainguard as tg

def main():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": opt, "rng": tg.RNGState()}
    with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(5)) as mgr:
        for step in range(100):
            mgr.restore(state)
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.save(step, state)
"""


def findings(src: str, name: str, hooked: bool = False) -> list:
    s = Settings(source=textwrap.dedent(src))
    return [f for f in (check({}, s) if hooked else check_source(s)) if f.check == name]


def test_a_restore_on_every_pass_of_the_training_loop_is_a_warning() -> None:
    # Seen (bench): 20 SGD steps, a save every 5, mgr.restore(state) at the top of each pass: the
    # weights ended 9 updates from the start, not 20 (every pass put the last checkpoint back).
    for hooked in (False, True):
        (f,) = findings(IN_LOOP, "restore in loop", hooked)
        assert f.severity == "warning" and "line 11: mgr.restore(state)" in f.message, f
        assert "(line 10)" in f.message and "before the loop" in f.fix
    # tg.load at the end of each epoch, the steps in an inner loop; a helper of the script that restores
    epoch = """
    def main(model, opt, loader, mgr, state):
        step = 0
        for epoch in range(10):
            for x in loader:
                model(x).sum().backward()
                opt.step()
                step += 1
                mgr.save(step, state)
            tg.load("ckpts", state)
    """
    (f,) = findings(epoch, "restore in loop")
    assert f.severity == "warning" and "line 10: tg.load('ckpts', state)" in f.message and "(line 4)" in f.message, f
    helper = IN_LOOP.replace("mgr.restore(state)", "resume(mgr, state)") + "\ndef resume(m, s):\n    return m.restore(s)\n"
    (f,) = findings(helper, "restore in loop")
    assert f.severity == "warning" and "line 11: resume(mgr, state)" in f.message, f


def test_restores_that_run_once_or_on_purpose_are_not_reported() -> None:
    before = IN_LOOP.replace("            mgr.restore(state)\n", "").replace(
        "        for step in range(100):\n", "        start = mgr.restore(state)\n        for step in range(100):\n")
    rollback = IN_LOOP.replace("            mgr.restore(state)\n", "").replace(
        "            loss.backward()\n", "            if not torch.isfinite(loss):\n                mgr.restore(state)\n"
        "                continue\n            loss.backward()\n")
    retry = IN_LOOP.replace("        for step in range(100):\n", "        while True:\n").replace(
        "            mgr.save(step, state)\n", "            mgr.save(step, state)\n            break\n")
    per_run = IN_LOOP.replace('        for step in range(100):\n', '    for seed in range(3):\n').replace(
        '    with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(5)) as mgr:\n', '').replace(
        "            mgr.restore(state)\n",
        '        with tg.CheckpointManager(f"run-{seed}") as mgr:\n            mgr.restore(state)\n')
    fresh = IN_LOOP.replace("mgr.restore(state)", "tg.load('ckpts', {'model': torch.nn.Linear(8, 1)})")
    ema = IN_LOOP.replace("mgr.restore(state)", "ema.restore(model.parameters())")
    evaluate = "for step in mgr.steps():\n    mgr.restore(state, step=step)\n    evaluate(model)\n"
    for src in (before, rollback, retry, per_run, fresh, evaluate):
        (f,) = findings(src, "restore in loop")
        assert f.severity == "ok", (src, f)
    timer = IN_LOOP.replace("mgr.restore(state)", "timer.restore()")  # no state: not a checkpoint's restore
    for src in (ema, timer):
        assert findings(src, "restore in loop") == [], src  # no checkpoint restore at all: nothing to judge


ACCEL = """
from accelerate import Accelerator

def main(model, optimizer, scheduler, loader, mgr, state, args):
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = mgr.restore(state) or 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            mgr.save(step, state)
"""


def test_a_save_on_every_micro_batch_inside_accelerates_accumulate_is_a_warning() -> None:
    # accelerate is not imported (nor needed): the script is read as text. Its optimizer.step() inside
    # accumulate() steps only when accelerator.sync_gradients, so the save runs mid-window.
    (f,) = findings(ACCEL, "save mid-accumulation")
    assert f.severity == "warning" and "line 16: mgr.save(step, state)" in f.message, f
    assert "accelerator.accumulate(model)" in f.message and "(line 9)" in f.message
    after = ACCEL.replace("            mgr.save(step, state)\n", "        mgr.save(step, state)\n")  # after the block
    (f,) = findings(after, "save mid-accumulation")
    assert f.severity == "warning" and "line 16: mgr.save(step, state)" in f.message, f


def test_saves_at_the_end_of_accelerates_window_are_not_reported() -> None:
    gated = ACCEL.replace("            mgr.save(step, state)\n",
                          "        if accelerator.sync_gradients:\n            mgr.save(step, state)\n")
    counted = ACCEL.replace("            step += 1\n            mgr.save(step, state)\n",
                            "        if accelerator.sync_gradients:\n            step += 1\n        mgr.save(step, state)\n")
    single = ACCEL.replace("Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)", "Accelerator()")
    for src in (gated, counted, single):
        (f,) = findings(src, "save mid-accumulation")
        assert f.severity == "ok", (src, f)


LATE = """
import torch
import trainguard as tg

def main(args):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt, "rng": tg.RNGState()}
    with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(5)) as mgr:
        start = mgr.restore(state)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        state["sched"] = sched
        model.load_state_dict(torch.load(args.pretrained))
        first = 0 if start is None else start + 1
        for step in range(first, 100):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            sched.step()
            mgr.save(step, state)
"""


def test_an_optimizer_scheduler_or_file_load_after_the_restore_is_a_warning() -> None:
    # Seen (bench): a resume at step 9 with model.load_state_dict(torch.load(pretrained)) after
    # mgr.restore: bias back to the pretrained -0.0314 (saved: -0.1313); AdamW built after
    # mgr.restore(state, strict=False): 0 Adam steps after the resume (10 saved).
    for hooked in (False, True):
        (f,) = findings(LATE, "after restore", hooked)
        assert f.severity == "warning" and "line 11: the LR scheduler (torch.optim.lr_scheduler.Cosine" in f.message, f
    (f,) = findings(LATE.replace("        state[\"sched\"] = sched\n", "").replace(
        "torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)", "None"), "after restore")
    assert f.severity == "warning" and "line 12: model.load_state_dict(torch.load(args.pretrained))" in f.message, f
    late_opt = LATE.replace('"optim": opt, ', "").replace("    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n", "")
    late_opt = late_opt.replace("        sched = torch.optim", "        opt = torch.optim.AdamW(model.parameters())\n"
                                "        state['optim'] = opt\n        sched = torch.optim")
    (f,) = findings(late_opt, "after restore")
    assert f.severity == "warning" and "line 10: the optimizer (torch.optim.AdamW)" in f.message, f
    bare = LATE.replace("torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)", "OneCycleLR(opt, 0.1, 100)")
    (f,) = findings(bare, "after restore")  # from torch.optim.lr_scheduler import OneCycleLR
    assert f.severity == "warning" and "line 11: the LR scheduler (OneCycleLR)" in f.message, f


def test_what_runs_before_the_restore_or_on_a_fresh_start_only_is_not_reported() -> None:
    ordered = LATE.replace("        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)\n", "").replace(
        "        state[\"sched\"] = sched\n", "").replace(
        '    state = {"model"', '    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)\n'
        '    state = {"sched": sched, "model"')
    ordered = ordered.replace("        model.load_state_dict(torch.load(args.pretrained))\n", "").replace(
        "        start = mgr.restore(state)\n", "        model.load_state_dict(torch.load(args.pretrained))\n"
        "        start = mgr.restore(state)\n")
    fresh = ordered.replace("        model.load_state_dict(torch.load(args.pretrained))\n", "").replace(
        "        first = 0", "        if start is None:\n            model.load_state_dict(torch.load(args.pretrained))\n"
        "        first = 0")
    # an optimizer kept out of the state (the optimizer+scheduler check's), a copy into a target network
    unsaved = ordered.replace("        first = 0", "        opt2 = torch.optim.SGD(model.parameters())\n"
                              "        target.load_state_dict(model.state_dict())\n        first = 0")
    warm = ordered.replace("start = mgr.restore(state)", "tg.load(args.init, {'model': model})").replace(
        "        first = 0", "        opt2 = torch.optim.SGD(model.parameters())\n        first = 0")
    for src in (ordered, fresh, unsaved, warm):
        (f,) = findings(src, "after restore")
        assert f.severity == "ok", (src, f)
