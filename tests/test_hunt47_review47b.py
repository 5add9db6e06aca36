"""review47b: defects found in the late commits of session 47."""

from __future__ import annotations

import pytest

PLATEAU_AFTER_EPOCH = """
import torch, trainguard as tg
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
state = {"model": model, "optim": opt, "plateau": plateau}

def evaluate(model, step):
    with torch.no_grad():
        return sum(model(x).sum().item() for x in [torch.randn(4, 2)] * 3)

with tg.CheckpointManager("ck", handle_signals=False) as mgr:
    global_step = mgr.restore(state) or 0
    running = 0.0
    for epoch in range(3):
        for x in [torch.randn(4, 2)] * 5:
            %s
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            opt.step()
            running += loss.item()
            mgr.save(global_step, state)
        %s
        plateau.step(%s)
"""


@pytest.mark.parametrize("train_line,before_step,arg", [
    ("global_step = global_step + 1", "val_loss = evaluate(model, global_step)", "val_loss"),  # the step logged
    ("global_step += 1", "metrics = {'val': evaluate(model, 0), 'step': global_step}", "metrics['val']"),
    ("x = x + 0.01 * torch.randn_like(x); global_step += 1",                     # augmentation of the batch
     "out = model(x)\n        val_loss = out.sum().item()", "val_loss"),
])
def test_doctor_loop_accumulator_no_warning_on_step_counter_or_batch(train_line: str, before_step: str, arg: str) -> None:
    # fe5614e made `x = x + ...` a sum and followed any name computed from a sum: the save's step
    # counter (`global_step = global_step + 1`, restored by restore()) passed to an evaluation, and a
    # batch augmented in place (`for x in loader: x = x + noise`, rebound by the loop each iteration)
    # made the plateau's validation loss "a loop accumulator": warned on correct scripts.
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    src = PLATEAU_AFTER_EPOCH % (train_line, before_step, arg)
    assert [f for f in check_source(Settings(source=src)) if f.check == "loop accumulator"] == []
    # the running training sum read by the plateau is still warned about, in the same script
    src = PLATEAU_AFTER_EPOCH % (train_line, before_step, "running")
    (found,) = [f for f in check_source(Settings(source=src)) if f.check == "loop accumulator"]
    assert "running += loss.item()" in found.message


def test_doctor_loop_accumulator_ema_read_by_plateau_is_warned() -> None:
    # An EMA of the training loss (`avg = 0.9 * avg + 0.1 * loss`) read by the plateau: a resume
    # starts it from its initial value again, a true positive (kept).
    from trainguard.doctor import Settings
    from trainguard.doctor_source import check_source

    src = (PLATEAU_AFTER_EPOCH % ("global_step += 1", "pass", "avg")).replace(
        "running += loss.item()", "avg = 0.9 * avg + 0.1 * loss.item()").replace("running = 0.0", "avg = 0.0")
    (found,) = [f for f in check_source(Settings(source=src)) if f.check == "loop accumulator"]
    assert "avg = 0.9 * avg + 0.1 * loss.item()" in found.message
