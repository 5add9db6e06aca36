"""Session 49, ``trainguard doctor`` on realistic training scripts (``tests/doctor49_scripts``: DDP under
torchrun, gradient accumulation, AMP with a GradScaler, Hugging Face's no_trainer layout, an
accelerate-style loop without accelerate, a torchtitan-like ``TrainState``, epochs over a
``DistributedSampler``, an iterable stream, an EMA, a GAN, early stopping), each correct (resumed after a
SIGKILL, bit-identical to an uninterrupted run: the slow test at the end) and broken in one or two ways.

Found and fixed:
- a restore whose result never reaches the training loop (``mgr.restore(state)`` then ``for step in
  range(N)``) was not reported; the resumed loop trains from step 0 on the restored weights and its first
  save behind the restored step raises CheckpointError: now the "resume start" error;
- a loop resumed at the restored step + 1 that saves each step before training it (nanoGPT's order with
  the README's ``start + 1``) never trains the saved step after a resume: now the "resume start" error too;
- an LR scheduler the loop steps but the state leaves out was a warning, also when another one was saved
  (a GAN's ``schedD``: "ok"); its schedule restarts at each resume: now an error (a warning for an
  ``ExponentialLR``, which only multiplies the restored learning rate: measured exact);
- ``bad_epochs`` (any name containing "epoch", "sample" or "batch") was taken for a data counter;
- ``tg.ResumableIterable`` in the state was "no sampler or data loader with a state_dict" (a warning);
- a state with only a counter (or a StateDict) and a save inside the loop over a plain ``DataLoader``
  (a ``DistributedSampler``, mid-epoch) was a warning; the resume trains the epoch's first batches
  again (seen: ``save(step=8)`` refused after a resume at step 9): now an error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd
from trainguard.doctor import Settings, check
from trainguard.doctor_source import check_source

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "doctor49_scripts"
W, E = "warning", "error"
DP = ("data position", W)

# Every finding that is not "ok", for each correct script.
CORRECT = {
    "accel_like": {DP}, "amp_scaler": {DP}, "ddp_steps": set(), "early_stop": set(), "ema": {DP},
    "epoch_ddp": {DP}, "gan": {DP}, "grad_accum": set(), "hf_style": {DP}, "iterable": set(), "titan_like": {DP},
}

# name: (script, edits (old, new), every finding that is not "ok", words of the finding the edit causes)
BROKEN = {
    "ddp_steps__ignored": ("ddp_steps", [("start = mgr.restore(state)\n        step = 0 if start is None else start + 1",
                                          "mgr.restore(state)\n        step = 0")],
                           {("resume start", E)}, "while step < args.steps (step from 0)"),
    "ddp_steps__nosched": ("ddp_steps", [('"sched": sched, ', ''),
                                         ('state["sched"], state["data"]',
                                          'LambdaLR(state["optim"], lambda s: 1.0 / (1 + s)), state["data"]'),
                                         ("from torch.utils.data import",
                                          "from torch.optim.lr_scheduler import LambdaLR\nfrom torch.utils.data import")],
                           {("optimizer+scheduler", E)}, "steps 1 LR scheduler(s) (sched, line 25: LambdaLR)"),
    "ddp_steps__torchsave": ("ddp_steps", [("    dist.destroy_process_group()",
                                            '    torch.save(model.module.state_dict(), "final.pt")\n'
                                            "    dist.destroy_process_group()")],
                             {("one file, every rank", W)}, "torch.save(model.module.state_dict(), 'final.pt')"),
    "ddp_steps__distsampler": ("ddp_steps", [("    sampler = tg.ResumableSampler(DATA, seed=0)\n", ""),
                                             ('"data": sampler,\n             ', ''),
                                             ('state["sched"], state["data"]', 'state["sched"], DistributedSampler(DATA, seed=0)'),
                                             ("                sampler.advance(len(x))\n", ""),
                                             ("sampler.next_epoch()", "sampler.set_epoch(sampler.epoch + 1)"),
                                             ("DataLoader, TensorDataset", "DataLoader, DistributedSampler, TensorDataset")],
                               {("data position", E)}, "unless progress (StateDict) holds it; but the script saves "
                               "inside its loop over a DataLoader (line 42: for x, y in loader)"),
    "grad_accum__midaccum": ("grad_accum", [('                    global_step += 1\n'
                                             '                    state["meta"]["global_step"] = global_step\n'
                                             '                    mgr.save(global_step, state)',
                                             '                global_step += 1\n'
                                             '                state["meta"]["global_step"] = global_step\n'
                                             '                mgr.save(global_step, state)')],
                             {("save mid-accumulation", W)}, "runs on every micro-batch"),
    "grad_accum__ignored": ("grad_accum", [("global_step = 0 if resumed is None else resumed", "global_step = 0")],
                            {("resume start", E)}, "save(global_step, ...)"),
    "amp__noscaler": ("amp_scaler", [('"scaler": scaler, ', '')], {DP, ("amp", E)}, "no GradScaler in the state"),
    "amp__ignored": ("amp_scaler", [("        first = 0\n        if (r := mgr.restore(state)) is not None:\n"
                                     "            first = r + 1\n        for step in range(first, args.steps):",
                                     "        mgr.restore(state)\n        for step in range(args.steps):")],
                     {DP, ("resume start", E)}, "line 31: the training loop starts at the same step on every run: "
                     "for step in range(args.steps), whatever mgr.restore(state) (line 30) restored"),
    "amp__savefirst": ("amp_scaler", [("            x = torch.randn(64, 32, device=DEVICE)",
                                       '            state["step"]["step"] = step\n            mgr.save(step, state)\n'
                                       "            x = torch.randn(64, 32, device=DEVICE)"),
                                      ('            state["step"]["step"] = step\n            mgr.save(step, state)\n'
                                       "            if mgr.should_stop:", "            if mgr.should_stop:")],
                       {DP, ("resume start", E)}, "saves each step before training it (line 35: mgr.save(step, "
                       "state), before line 40: scaler.scale(loss).backward()) and resumes at the restored step + 1"),
    "hf_style__ignored": ("hf_style", [("        restored = mgr.restore(state)\n        if restored is not None:\n"
                                        "            completed_steps = restored\n"
                                        "            starting_epoch = completed_steps // num_update_steps_per_epoch\n"
                                        "            resume_step = completed_steps % num_update_steps_per_epoch\n",
                                        "        mgr.restore(state)\n")],
                          {DP, ("resume start", E)}, "for epoch in range(starting_epoch, args.num_train_epochs)"),
    "accel__ignored": ("accel_like", [('        starting_epoch = progress["completed_steps"] // updates_per_epoch\n'
                                       '        resume_step = (progress["completed_steps"] % updates_per_epoch) * '
                                       'args.gradient_accumulation_steps\n',
                                       '        starting_epoch, resume_step, completed_steps = 0, 0, 0\n'),
                                      ('                    progress["completed_steps"] += 1\n'
                                       '                    mgr.save(progress["completed_steps"], state)',
                                       '                    completed_steps += 1\n'
                                       '                    progress["completed_steps"] = completed_steps\n'
                                       '                    mgr.save(completed_steps, state)')],
                       {DP, ("resume start", E)}, "range(starting_epoch, args.num_train_epochs)"),
    "titan__nostate": ("titan_like", [(', "train_state": TrainState()', ''),
                                      ('data, train_state = states["dataloader"], states["train_state"]',
                                       'data, train_state = states["dataloader"], TrainState()')],
                       {DP, ("resume start", E)}, "while train_state.step < args.steps (train_state.step from TrainState())"),
    "titan__local_step": ("titan_like", [("        while train_state.step < args.steps:\n            train_state.step += 1",
                                          "        step = 0\n        while step < args.steps:\n            step += 1\n"
                                          "            train_state.step = step"),
                                         ("checkpoint.save(train_state.step, states, force=train_state.step == args.steps)",
                                          "checkpoint.save(step, states, force=step == args.steps)")],
                          {DP, ("resume start", E)}, "whatever checkpoint.restore(states) (line 59) restored"),
    "titan__norng": ("titan_like", [(', "rng": tg.RNGState()', '')], {DP, ("rng", W)}, "no RNG state"),
    "epoch_ddp__norng": ("epoch_ddp", [(', "rng": tg.RNGState()', '')], {DP, ("rng", W)}, "no RNG state"),
    "epoch_ddp__torchsave": ("epoch_ddp", [("            mgr.save(epoch, state)",
                                            "            mgr.save(epoch, state)\n            torch.save("
                                            '{"model": model.state_dict(), "epoch": epoch}, "last.pt")')],
                             {DP, ("one file, every rank", W)}, "'last.pt'"),
    "epoch_ddp__midepoch": ("epoch_ddp", [("            train_one_epoch(model, loader, optimizer)\n",
                                           "            for i, (x, y) in enumerate(loader):\n"
                                           "                loss = nn.functional.cross_entropy(model(x), y)\n"
                                           "                optimizer.zero_grad()\n                loss.backward()\n"
                                           "                optimizer.step()\n"
                                           "                mgr.save(epoch * len(loader) + i, state)\n"),
                                          ("start_epoch = 0 if last is None else last + 1",
                                           "start_epoch = 0 if last is None else last // len(loader)"),
                                          ("            mgr.save(epoch, state)\n", "")],
                            {("data position", E)}, "only a counter (progress/epoch): a resume is exact only if your "
                            "loader skips ahead by exactly that much; but the script saves inside its loop over a "
                            "DataLoader (line 50: for i, (x, y) in enumerate(loader))"),
    "iterable__plain": ("iterable", [("stream = tg.ResumableIterable(records, batch_size=10)", "stream = Records()"),
                                     ('"stream": stream, ', ''),
                                     ("def trainguard_state(", "class Records(torch.utils.data.IterableDataset):\n"
                                      "    def __iter__(self):\n        return records(0)\n\n"
                                      "    def advance(self, n):\n        pass\n\n    def next_epoch(self):\n"
                                      "        pass\n\n\ndef trainguard_state("),
                                     ('state["sched"], state["stream"]', 'state["sched"], Records()')],
                        {("data position", E)}, "unless progress (StateDict) holds it; but the script saves inside "
                        "its loop over a DataLoader (line 49: for x in loader)"),
    "iterable__nogen": ("iterable", [(", generator=torch.Generator())", ")")], {("data randomness", W)},
                        "DataLoader without generator= (line 34)"),
    "ema__noema": ("ema", [('"ema": ema_model, ', ''),
                           ('state["ema"]', 'AveragedModel(state["model"], multi_avg_fn=get_ema_multi_avg_fn(0.99))')],
                   {DP, ("ema", W)}, "is not in the state"),
    "gan__nooptD": ("gan", [('"optD": optD, ', ''), ('state["optG"], state["optD"]', 'state["optG"], state["schedD"].optimizer')],
                    {DP, ("optimizer+scheduler", E)}, "the scheduler at schedD drives an optimizer that is not in the state"),
    "gan__noschedD": ("gan", [(', "schedD": schedD', ''),
                              ('schedG, schedD = state["schedG"], state["schedD"]',
                               'schedG = state["schedG"]\n    schedD = torch.optim.lr_scheduler.LambdaLR(optD, lambda it: 1.0 - it / 200)')],
                      {DP, ("optimizer+scheduler", E)}, "steps 2 LR scheduler(s) (schedG, line 18: LambdaLR; schedD, line "
                      "19: LambdaLR) and the state holds 1: the optimizer optD is saved without one"),
    "early__plain_dict": ("early_stop", [('"stopping": tg.StateDict(best_val=float("inf"), bad_epochs=0)',
                                          '"stopping": {"best_val": float("inf"), "bad_epochs": 0}'),
                                         ('"sampler": sampler,\n             ', ''),
                                         ('state["plateau"], state["sampler"]', 'state["plateau"], None'),
                                         ("train_loader = DataLoader(TRAIN, batch_size=12, sampler=sampler, generator="
                                          "torch.Generator())", "train_loader = DataLoader(TRAIN, batch_size=12, "
                                          "shuffle=True, generator=torch.Generator())"),
                                         ("sampler.epoch < args.max_epochs", "True"),
                                         ("                sampler.advance(len(x))\n", ""),
                                         ("            sampler.next_epoch()\n            mgr.save(sampler.epoch, state)",
                                          "            mgr.save(0 if mgr.last_saved_step is None else "
                                          "mgr.last_saved_step + 1, state)")],
                          {("data position", E)}, "no sampler or data loader with a state_dict in the state: a resume "
                          "replays or skips data"),
}


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A Python child in ``cwd`` (bounded in time: subprocess.run kills it at the timeout)."""
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    return subprocess.run([sys.executable, *args], env=e, cwd=cwd, capture_output=True, text=True, timeout=300)


def _doctor(script: Path) -> tuple[int, list[dict[str, str]]]:
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert res.exit_code in (0, 1), res.output[-3000:]
    return res.exit_code, json.loads(res.output)


def _broken(name: str, tmp_path: Path) -> Path:
    script, edits, _, _ = BROKEN[name]
    text = (SCRIPTS / f"{script}.py").read_text()
    for old, new in edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    out = tmp_path / f"{name}.py"
    out.write_text(text)
    return out


@pytest.mark.parametrize("script", sorted(CORRECT))
def test_correct_scripts_get_exactly_their_findings(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the hooks' roots are relative: the doctor makes none of them
    code, found = _doctor(SCRIPTS / f"{script}.py")
    assert {(f["check"], f["severity"]) for f in found if f["severity"] != "ok"} == CORRECT[script], found
    assert code == 0
    assert not (tmp_path / "ckpts").exists()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_scripts_get_exactly_their_findings(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, found = _doctor(_broken(name, tmp_path))
    _, _, expected, words = BROKEN[name]
    assert {(f["check"], f["severity"]) for f in found if f["severity"] != "ok"} == expected, found
    assert any(words in f["message"] for f in found if f["severity"] != "ok"), found
    assert code == (1 if any(sev == E for _, sev in expected) else 0)


def _resume(src: str) -> tuple[str, str] | None:
    found = [f for f in check_source(Settings(source=src)) if f.check == "resume start"]
    return (found[0].severity, found[0].message) if found else None


HEAD = "import trainguard as tg\nstate = {'progress': progress, 'data': sampler}\n"
LOOP = "    loss.backward()\n    mgr.save(step, state)\n"


@pytest.mark.parametrize("src", [
    HEAD + "start = mgr.restore(state)\nfor step in range(0 if start is None else start + 1, 100):\n" + LOOP,
    HEAD + "step = mgr.restore(state) or 0\nwhile step < 100:\n    step += 1\n" + LOOP,
    HEAD + "first = 0\nif (r := mgr.restore(state)) is not None:\n    first = r + 1\nfor step in range(first, 100):\n" + LOOP,
    HEAD + "mgr.restore(state)\nfor step in range(progress['step'] + 1, 100):\n" + LOOP,  # a counter of the state
    HEAD + "mgr.restore(state)\nfor step in range(state['progress']['step'], 100):\n" + LOOP,
    "ts = TrainState()\nstate = {'train_state': ts}\nmgr.restore(state)\nfor step in range(ts.step, 100):\n" + LOOP,
    "ts = TrainState()\nstate = {'train_state': ts}\nmgr.restore(state)\nwhile ts.step < 100:\n    ts.step += 1\n"
    "    loss.backward()\n    mgr.save(ts.step, state)\n",
    "class T:\n    def fit(self):\n        self.mgr.restore({'train_state': self})\n        while self.step < 9:\n"
    "            self.step += 1\n            self.mgr.save(self.step, self.state)\n",  # torchtitan: the trainer is saved
    HEAD + "mgr.restore(state)\nwhile sampler.epoch < 3:\n    for x in loader:\n        loss.backward()\n"
    "        mgr.save(sampler.position, state)\n",
    HEAD + "mgr.restore(state)\nstep = mgr.last_saved_step or 0\nfor _ in range(100):\n    step += 1\n" + LOOP,
    HEAD + "start = mgr.restore(state)\nfor step in range(100):\n    if start is not None and step <= start:\n"
    "        continue\n" + LOOP,  # skips what was trained
    HEAD + "start = mgr.restore(state)\nif start is None:\n    for step in range(100):\n" + LOOP.replace("    ", "        "),
    HEAD + "assert mgr.restore(state) is None\nfor step in range(100):\n" + LOOP,
    HEAD + "mgr.restore(state, step=40)\nfor step in range(41, 100):\n" + LOOP,  # a rollback to a step it names
    HEAD + "args.start_epoch = (mgr.restore(state) or -1) + 1\nfor step in range(args.start_epoch, 9):\n" + LOOP,
    HEAD + "def resume():\n    return mgr.restore(state)\nstart = resume()\nfor step in range(start or 0, 9):\n" + LOOP,
    HEAD + "mgr.restore(state)\nfor step in range(args.first, 100):\n" + LOOP,  # a start the text does not show
    HEAD + "mgr.restore(state)\nfor step in range(100):\n    loss.backward()\n",  # no save: no training run's loop
    HEAD + "start = mgr.restore(state)\nfor step in range(start or 0, 100):\n    mgr.save(step, state)\n"
    "    loss.backward()\n",  # nanoGPT's order: a save at the top of the step, resumed at that step
    HEAD + "start = mgr.restore(state)\nfor step in range(0 if start is None else start + 1, 100):\n"
    "    loss.backward()\n    opt.step()\n    mgr.save(step, state)\n",
    HEAD + "src.restore(state)\nfor step in range(100):\n    loss.backward()\n    dst.save(step, state)\n",  # warm start
])
def test_resume_start_accepts_the_ways_a_loop_starts_from_the_restore(src: str) -> None:
    assert _resume(src) == ("ok", "the training loop starts from what the restore returned or restored"), src


@pytest.mark.parametrize(("src", "words"), [
    (HEAD + "mgr.restore(state)\nfor step in range(0, 100):\n" + LOOP, "for step in range(0, 100)"),
    (HEAD + "start = mgr.restore(state)\nprint(start)\nfor step in range(100):\n" + LOOP, "range(100)"),  # only printed
    (HEAD + "if args.resume:\n    mgr.restore(state)\nfor epoch in range(args.epochs):\n"
     "    for x in loader:\n        loss.backward()\n        mgr.save(epoch, state)\n", "for epoch in range(args.epochs)"),
    (HEAD + "mgr.restore(state)\nstep = 0\nwhile True:\n    step += 1\n" + LOOP, "save(step, ...)"),
    (HEAD + "mgr.restore(state)\nfor step in itertools.count():\n" + LOOP, "itertools.count()"),
    (HEAD + "start = mgr.restore(state)\nstep = 0 if start is None else start + 1\nwhile step < 9:\n"
     "    if step % 3 == 0:\n        mgr.save(step, state)\n    loss.backward()\n    opt.step()\n    step += 1\n",
     "saves each step before training it (line 7: mgr.save(step, state), before line 8: loss.backward())"),
    (HEAD + "def main():\n    mgr.restore(state)\n    for step in tqdm(range(9)):\n        loss.backward()\n"
     "        mgr.save(step, state)\n", "tqdm(range(9))"),
])
def test_resume_start_reports_a_loop_that_starts_over(src: str, words: str) -> None:
    sev, message = _resume(src) or ("", "")
    assert sev == "error" and words in message, message


def test_a_loop_that_ignores_the_restore_is_refused_at_its_first_save_behind_it(tmp_path: Path) -> None:
    """What the "resume start" error predicts, run: the second run restores step 5, trains steps 0-2
    again and its save of step 3 is refused."""
    script = tmp_path / "ignored.py"
    script.write_text("import sys\nimport torch\nimport trainguard as tg\n"
                      "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "state = {'model': model, 'optim': opt, 'progress': tg.StateDict(step=0)}\n"
                      "with tg.CheckpointManager('run', save=tg.EveryNSteps(3), handle_signals=False) as mgr:\n"
                      "    mgr.restore(state)\n"
                      "    for step in range(int(sys.argv[1])):\n"
                      "        opt.zero_grad()\n        model(torch.ones(4, 2)).sum().backward()\n        opt.step()\n"
                      "        state['progress']['step'] = step\n"
                      "        print('trained', step, flush=True)\n        mgr.save(step, state)\n")
    first = _run([str(script), "7"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run([str(script), "7"], tmp_path)
    assert again.returncode == 1 and "save(step=3): restore() resumed this run from step 6" in again.stderr, again.stderr[-2000:]
    assert re.findall(r"trained (\d+)", again.stdout) == ["0", "1", "2", "3"]  # trained again, then refused
    sev, message = _resume(script.read_text()) or ("", "")
    assert sev == "error" and "for step in range(int(sys.argv[1]))" in message, message


def _lr_after_resume(sched_cls: type, kwargs: dict[str, float], root: Path) -> tuple[float, float]:
    """The learning rate after 10 steps, straight and resumed after 5 with the scheduler left out of
    the state (a new one built by the resumed process, as a restarted script does)."""
    import trainguard as tg

    def run(steps: range, run: str) -> float:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = sched_cls(opt, **kwargs)
        state = {"model": model, "optim": opt}
        with tg.CheckpointManager(root / f"{sched_cls.__name__}-{run}", save=tg.EveryNSteps(1),
                                  handle_signals=False) as mgr:
            start = mgr.restore(state)
            assert (-1 if start is None else start) == steps.start - 1
            for step in steps:
                opt.step()
                sched.step()
                mgr.save(step, state)
        return opt.param_groups[0]["lr"]

    straight = run(range(10), "straight")
    run(range(5), "resumed")
    return straight, run(range(5, 10), "resumed")


def test_a_scheduler_left_out_of_the_state_restarts_its_schedule_but_exponential_goes_on(tmp_path: Path) -> None:
    """Why the doctor says error for a stepped scheduler left out, a warning for an ExponentialLR."""
    straight, resumed = _lr_after_resume(torch.optim.lr_scheduler.StepLR, {"step_size": 3, "gamma": 0.5}, tmp_path)
    assert straight == 0.125 and resumed == 0.25  # decays at steps 3, 6, 9 straight; at 3 and 5 + 3 = 8 resumed
    straight, resumed = _lr_after_resume(torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.5}, tmp_path)
    assert straight == resumed == 0.5 ** 10


SCHED = ("import torch\nimport trainguard as tg\n\ndef trainguard_state():\n"
         "    model = torch.nn.Linear(2, 1)\n    opt = torch.optim.AdamW(model.parameters())\n"
         "    return {'model': model, 'optim': opt, 'rng': tg.RNGState(), 'data': tg.ResumableSampler(4, seed=0)}\n\n"
         "def main():\n    state = trainguard_state()\n    sched = %s(state['optim'], %s)\n"
         "    with tg.CheckpointManager('run') as mgr:\n        start = mgr.restore(state)\n"
         "        for step in range(0 if start is None else start + 1, 9):\n            state['optim'].step()\n"
         "%s            mgr.save(step, state)\n")


def test_a_scheduler_held_by_an_object_of_the_state_is_no_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCHED.replace("    return {'model'", "    class Schedules:\n        def __init__(self, opt):\n"
                                    "            self.all = [torch.optim.lr_scheduler.StepLR(opt, step_size=2)]\n\n"
                                    "        def state_dict(self):\n            return {}\n\n"
                                    "        def load_state_dict(self, sd):\n            pass\n\n"
                                    "        def step(self):\n            for s in self.all:\n                s.step()\n"
                                    "    return {'sched': Schedules(opt), 'model'") % (
        "torch.optim.lr_scheduler.StepLR", "step_size=2", "            sched.step()\n"))
    code, found = _doctor(script)
    (f,) = [f for f in found if f["check"] == "optimizer+scheduler"]  # not the error: the state's Schedules holds it
    assert f["severity"] == "warning" and "saved without an LR scheduler" in f["message"] and code == 0, f


@pytest.mark.parametrize(("sched", "args", "stepped", "severity", "words"), [
    ("torch.optim.lr_scheduler.StepLR", "step_size=2", True, "error", "steps 1 LR scheduler(s) (sched, line 11: StepLR)"),
    ("torch.optim.lr_scheduler.StepLR", "step_size=2", False, "warning", "saved without an LR scheduler"),
    ("torch.optim.lr_scheduler.ExponentialLR", "gamma=0.9", True, "warning", "only multiplies the learning rate"),
])
def test_a_scheduler_left_out_is_an_error_when_the_loop_steps_it(sched: str, args: str, stepped: bool, severity: str,
                                                                  words: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCHED % (sched, args, "            sched.step()\n" if stepped else ""))
    code, found = _doctor(script)
    (f,) = [f for f in found if f["check"] == "optimizer+scheduler"]
    assert f["severity"] == severity and words in f["message"], f
    assert code == (1 if severity == "error" else 0)


@pytest.mark.parametrize(("name", "counter"), [
    ("epoch", True), ("samples_seen", True), ("consumed_samples", True), ("batch_idx", True), ("numBatchesDone", True),
    ("last_epoch", True), ("bad_epochs", False), ("epochs_without_improvement", False), ("best_epoch", False),
    ("batch_size", False), ("max_epochs", False), ("epoch_loss", False), ("resample_count", False),
])
def test_data_counters_are_named_for_where_the_data_stands(name: str, counter: bool) -> None:
    """A number named for the data's position softens "no data position" to a warning; an early-stopping
    counter (``bad_epochs``) or a setting (``batch_size``) does not, nor a string or a bool."""
    def finding(value: object) -> tuple[str, str]:
        (f,) = [f for f in check({"model": torch.nn.Linear(2, 1), "p": {name: value}}, Settings())
                if f.check == "data position"]
        return f.severity, f.message
    sev, message = finding(3)
    assert (sev, f"only a counter (p/{name})" in message) == (("warning", True) if counter else ("error", False))
    if counter:
        assert finding(2.5)[0] == "warning" and finding(torch.tensor(7))[0] == "warning"


@pytest.mark.parametrize("value", ["3", True, [1, 2]])
def test_a_data_counter_is_a_number(value: object) -> None:
    (f,) = [f for f in check({"model": torch.nn.Linear(2, 1), "p": {"epoch_tag": value}}, Settings())
            if f.check == "data position"]
    assert f.severity == "error", f


EPOCHS = ("for epoch in range(start, 9):\n    for i, (x, y) in enumerate(loader):\n        loss.backward()\n"
          "        %s\n")


@pytest.mark.parametrize(("loader", "save", "severity"), [
    ("DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))", "mgr.save(step, state)", "error"),
    ("DataLoader(ds, batch_size=8, shuffle=True)", "mgr.save(step, state)", "error"),
    ("DataLoader(ds, batch_size=8, shuffle=True)", "if i == len(loader) - 1:\n            mgr.save(epoch, state)", "warning"),
    ("DataLoader(ds, batch_size=8, shuffle=True)", "if i < skip:\n            continue\n        mgr.save(step, state)", "warning"),
    ("DataLoader(ds, batch_size=8, batch_sampler=MyOrder(ds))", "mgr.save(step, state)", "warning"),  # may keep it
    ("DataLoader(ds, 8, False, my_sampler)", "mgr.save(step, state)", "warning"),  # a sampler not read
    ("DataLoader(ds, **loader_kwargs)", "mgr.save(step, state)", "warning"),
])
def test_a_save_inside_the_loop_over_a_forgetful_loader_is_an_error(loader: str, save: str, severity: str) -> None:
    """Only a counter (or a StateDict) for the data position: a warning, unless the script visibly saves
    mid-epoch over a loader whose sampler keeps no position and skips nothing after a resume."""
    import trainguard as tg

    src = f"loader = {loader}\n" + EPOCHS % save
    state = {"model": torch.nn.Linear(2, 1), "progress": tg.StateDict(step=0, epoch=0)}
    (f,) = [f for f in check(state, Settings(source=src)) if f.check == "data position"]
    assert f.severity == severity, (src, f)
    assert ("saves inside its loop over a DataLoader (line 3: for i, (x, y) in enumerate(loader))" in f.message) == (
        severity == "error"), f


def test_readme_and_docs_code_blocks_get_no_error() -> None:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S):
            found = check_source(Settings(source=code))
            assert not [f for f in found if f.severity == "error"], (doc.name, code[:200], found)


@pytest.mark.slow  # ~3 min: three processes a script
@pytest.mark.parametrize(("script", "args", "kill_at"), [
    ("grad_accum", ["--epochs", "2"], 3), ("amp_scaler", ["--steps", "76"], 2), ("hf_style", [], 4),
    ("titan_like", ["--training.steps", "40"], 2), ("iterable", ["--steps", "43"], 4), ("ema", ["--steps", "60"], 3),
    ("gan", ["--niter", "81"], 2), ("early_stop", ["--max_epochs", "8", "--patience", "100"], 4),
    ("accel_like", ["--num_train_epochs", "3"], 4),
])
def test_correct_scripts_resume_bit_identically(script: str, args: list[str], kill_at: int, tmp_path: Path) -> None:
    """The fixtures called correct are: SIGKILLed at a save and run again, each ends with the checkpoint
    an uninterrupted run saves (the DDP ones were checked the same way under torchrun, 2 gloo ranks)."""
    from test_examples import differing, kill_at_save

    for run, env in (("a", None), ("b", kill_at_save(kill_at)), ("b", None)):
        (tmp_path / run).mkdir(exist_ok=True)
        r = _run([str(SCRIPTS / f"{script}.py"), *args], tmp_path / run, env)
        assert r.returncode == (-9 if env else 0), r.stderr[-3000:]
    a, b = (sorted((tmp_path / run).glob("ckpts/*/step-*"))[-1] for run in "ab")
    assert a.name == b.name and differing(a, b) == []
